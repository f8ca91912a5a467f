"""LLMEngine: requests in, one step at a time, outputs out.

    step() = schedule -> execute (model runner + sampler) -> postprocess (append tokens,
             detokenize, stop checks, free finished requests)
"""
from __future__ import annotations

import random
import time
from itertools import count
from typing import Callable

import torch

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.sched.scheduler import Scheduler, SchedulerOutput
from engine.engine.core_types import EngineCoreOutput
from engine.executor.multiproc_executor import Executor, MultiprocExecutor, UniProcExecutor
from engine.hooks import BEGIN, COUNTER, END, INSTANT, SNAPSHOT, Hooks
from engine.model_executor import model_loader
from engine.model_executor.layers.attention import default_backend
from engine.model_executor.models.gpt2 import GPT2Model, check_tp_size
from engine.outputs import CompletionOutput, EngineStats, Logprob, RequestOutput
from engine.request import Request, RequestStatus
from engine.sample.sampler import SamplerOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import IncrementalDetokenizer, load_tokenizer
from engine.trace_names import (
    ABORTED,
    CONFIG,
    DETOKENIZER,
    ENGINE,
    FINISHED,
    NEW_TOKENS,
    QUEUED,
    SCHEDULE,
    SCHEDULED,
    SCHEDULER,
    STEP,
)
from engine.worker.model_runner import ModelRunner
from engine.worker.worker import Worker

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class LLMEngine:
    """The engine core: requests (token ids or text) in, one step at a time, outputs out.

    detokenize=True (offline use, lessons): it also detokenizes, checks stop strings and returns
    RequestOutput. detokenize=False (behind an EngineCore, as in vLLM V1): it returns
    EngineCoreOutput (new token ids) and leaves text and stop strings to the front end's
    OutputProcessor, which finishes a request on a stop string with abort_request(FINISHED_STOPPED)."""

    def __init__(self, config: EngineConfig, hooks: Hooks | None = None, detokenize: bool = True):
        self.config = config
        self.hooks = hooks or Hooks()
        self.detokenize = detokenize
        self.startup: list[tuple[str, float, dict]] = []  # (stage, seconds, details)
        if self.hooks.active:
            self.hooks.emit(ENGINE, CONFIG, model=config.model.model, config=config.to_dict())
        mc, cc = config.model, config.cache
        self.on_dead: Callable[[str], None] | None = None  # a tensor-parallel worker died (set before it can)
        self.device = torch.device(mc.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = DTYPES[mc.dtype or ("float16" if self.device.type == "cuda" else "float32")]
        self.attention_backend = config.attention_backend or default_backend(self.device)

        with self._stage("resolve_model", model=mc.model):
            self.model_path = model_loader.resolve(mc.model)
            model_loader.check_checkpoint(self.model_path)
            self.model_config = model_loader.read_config(self.model_path)
        self.max_model_len = mc.max_model_len or self.model_config.n_positions
        if self.max_model_len > self.model_config.n_positions:
            raise ValueError(f"max_model_len must be <= {self.model_config.n_positions} (the model's "
                             f"n_positions), got {self.max_model_len}")
        with self._stage("tokenizer_load", path=str(self.model_path)) as info:
            self.tokenizer = load_tokenizer(self.model_path)
            info["vocab_size"] = len(self.tokenizer)
        self.eos_token_id = self.model_config.eos_token_id
        if self.eos_token_id is None:
            self.eos_token_id = self.tokenizer.eos_token_id

        self._loaded = 0  # weight bytes last reported (see _load_progress)
        tp = config.parallel.tensor_parallel_size
        check_tp_size(self.model_config, tp)
        with self._stage("model_load", path=str(self.model_path), device=str(self.device),
                         attention_backend=self.attention_backend) as info:
            self.executor = self._make_executor()
            info |= self.executor.load_model(self._load_progress)

        with self._stage("kv_cache_alloc") as info:
            num_blocks, why = self.executor.determine_num_blocks()
            info |= self.executor.initialize_kv_cache(num_blocks)
            info["reason"] = why

        self.block_manager = BlockManager(num_blocks, cc.block_size, cc.enable_prefix_caching, self.hooks)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.hooks)
        self.requests: dict[str, Request] = {}
        self.step_count = 0
        self._ids = count()
        self._rng = random.Random(mc.seed)

    def _make_executor(self) -> Executor:
        args = (self.config, self.model_path, self.model_config, self.device, self.dtype, self.attention_backend)
        if self.config.parallel.distributed_executor_backend == "mp":
            return MultiprocExecutor(*args, self.hooks, on_dead=lambda reason: self.on_dead and self.on_dead(reason))
        return UniProcExecutor(Worker(*args, hooks=self.hooks))

    # With one rank the model, its KV cache and its model runner live here, for lessons to read
    @property
    def model(self) -> GPT2Model:
        return self._driver_worker().model

    @property
    def kv_caches(self) -> list:
        return self._driver_worker().kv_caches

    @property
    def model_runner(self) -> ModelRunner:
        return self._driver_worker().model_runner

    def _driver_worker(self) -> Worker:
        if not isinstance(self.executor, UniProcExecutor):
            raise AttributeError(f"with tensor_parallel_size={self.executor.tensor_parallel_size} the model, its KV "
                                 f"cache and its model runner live in the worker processes, not in this one")
        return self.executor.worker

    @property
    def dead(self) -> str | None:
        """Why the engine can no longer run (a tensor-parallel worker died), or None."""
        return getattr(self.executor, "dead", None)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also at exit). Safe to call twice."""
        self.executor.shutdown()

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | list[int] | dict,
                    params: SamplingParams | None = None, arrival_time: float | None = None) -> Request:
        """Validate, tokenize and queue a request. Raises ValueError before changing any state."""
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt, request_id)
        max_tokens = self._check_lengths(ids, params)
        req = Request(request_id, text, ids, params, self.eos_token_id, max_tokens,
                      arrival_time=arrival_time or time.monotonic())
        req.sampling_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req.generator = torch.Generator().manual_seed(req.sampling_seed)
        if self.detokenize:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        self.requests[request_id] = req
        self.scheduler.add_request(req)
        if self.hooks.active:
            self.hooks.emit(
                ENGINE,
                QUEUED,
                request_id=request_id,
                step=self.step_count,
                num_prompt_tokens=len(ids),
                max_tokens=max_tokens,
                params=vars(params),
            )
        return req

    def _tokenize(self, prompt, request_id: str) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt must have 'prompt_token_ids'")
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
            if self.hooks.active:
                self.hooks.emit(
                    "tokenizer",
                    "encode",
                    request_id=request_id,
                    step=self.step_count,
                    token_ids=ids,
                    pieces=[self.tokenizer.decode([t]) for t in ids],
                )
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, list(prompt)
        else:
            raise ValueError(f"prompt must be a string, a list of token ids or {{'prompt_token_ids': [...]}}, "
                             f"got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab - 1}]")
        return text, ids

    def _check_lengths(self, ids: list[int], params: SamplingParams) -> int:
        n, limit = len(ids), self.max_model_len
        if n >= limit:
            raise ValueError(f"prompt is {n} tokens; max_model_len is {limit}, so it must be at most "
                             f"{limit - 1} tokens to leave room for one generated token")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
        if n + max_tokens > limit:
            raise ValueError(f"max_tokens={max_tokens} plus the prompt's {n} tokens exceeds max_model_len={limit}; "
                             f"max_tokens must be <= {limit - n}")
        bm = self.block_manager
        if bm.blocks_needed(n + max_tokens) > bm.num_usable_blocks:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) needs {bm.blocks_needed(n + max_tokens)} KV-cache "
                f"blocks of {bm.block_size} tokens but the cache has only {bm.num_usable_blocks} (besides the null "
                f"block); it could never finish. "
                f"Lower max_tokens or enlarge the cache (num_kv_blocks / kv_cache_memory)")
        if n > self.config.scheduler.max_num_batched_tokens and not self.config.scheduler.enable_chunked_prefill:
            raise ValueError(f"prompt is {n} tokens, more than max_num_batched_tokens="
                             f"{self.config.scheduler.max_num_batched_tokens}, and chunked prefill is off")
        return max_tokens

    def abort_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                      stop_reason: int | str | None = None) -> None:
        """Stop a request and free its blocks. Unknown or finished ids are ignored. status
        FINISHED_STOPPED: the front end matched a stop string (stop_reason) in its text."""
        req = self.requests.pop(request_id, None)
        if req is None or req.status.finished:
            return
        req.stop_reason = stop_reason
        self.scheduler.finish_requests(req, status)
        if not self.hooks.active:
            return
        if status is RequestStatus.FINISHED_ABORTED:
            self.hooks.emit(ENGINE, ABORTED, request_id=request_id, step=self.step_count)
        else:
            self.hooks.emit(ENGINE, FINISHED, request_id=request_id, step=self.step_count,
                            finish_reason=req.finish_reason, stop_reason=stop_reason,
                            num_output_tokens=req.num_output_tokens)

    def warm_up(self) -> dict:
        """Run the model once on a dummy batch (compiling the Triton kernels on first use),
        traced as the startup stage ``kernel_warmup``. Not a request, not an engine step.
        `vllm-trace serve` calls it before taking requests; offline use may skip it."""
        if self.step_count:  # it writes (then zeroes) cache blocks the prefix cache may now own
            raise RuntimeError("warm_up() must run before the first engine step")
        with self._stage("kernel_warmup", backend=self.attention_backend) as info:
            info |= self.executor.warm_up(self.max_model_len)
        return info

    def held_attention_on_triton(self) -> dict:
        """A utility for viewers: see ModelRunner.held_attention_on_triton."""
        return self.executor.held_attention_on_triton()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step: schedule, execute (unless nothing was scheduled), postprocess.

        Returns an output per request that got a token this step: RequestOutput when
        detokenizing (with output_kind "final_only": only finished requests), else
        EngineCoreOutput. Changes: the scheduler's queues and block tables, the KV cache, each
        scheduled request's num_computed_tokens, tokens, text and logprobs; finished requests
        are removed and their blocks freed; step_count + 1. Hooks: engine/step begin and end
        (with stats), SCHEDULED per admitted request, the schedule snapshot and end, all that
        schedule() and execute() emit, NEW_TOKENS and FINISHED per request; when gated, the
        step, execute, postprocess and step_end gates."""
        if self.hooks.gated:
            self.hooks.gate("step", step=self.step_count)
        if self.hooks.active:
            self.hooks.emit(ENGINE, STEP, BEGIN, step=self.step_count)
        sched = self.scheduler.schedule(self.step_count)
        if self.hooks.active:
            self._trace_schedule(sched)
        sampled = self.executor.execute_model(sched) if not sched.is_empty else None
        if self.hooks.gated:
            self.hooks.gate("postprocess", step=sched.step)
        return self._postprocess(sched, sampled)

    def _postprocess(self, sched: SchedulerOutput, sampled: SamplerOutput | None) -> list[RequestOutput]:
        outputs, now = [], time.monotonic()
        traced = [] if self.hooks.active else None  # this step's NEW_TOKENS, published together (emit_many)
        for i, (s, tok) in enumerate(zip(sched.scheduled, sampled.token_ids if sampled else ())):
            req = s.request
            req.first_scheduled_time = req.first_scheduled_time or now
            req.num_computed_tokens += s.num_tokens
            if req.num_computed_tokens < len(req.all_token_ids):
                continue  # one chunk of a longer prefill: its sampled token is discarded
            req.append_token(tok)
            req.first_token_time = req.first_token_time or now
            if sampled.logprobs[i] is not None:
                req.logprobs.append(self._logprobs(sampled.logprobs[i], tok, sampled.ranks[i]))
            if req.detokenizer is not None:
                piece = req.detokenizer.add(tok)
                req.output_text = req.detokenizer.text
                if traced is not None:
                    traced.append(
                        (
                            DETOKENIZER,
                            NEW_TOKENS,
                            INSTANT,
                            req.request_id,
                            sched.step,
                            {"token_ids": [tok], "text": piece},
                        )
                    )
            status = self._check_stop(req, tok)
            if status is not None:
                if traced:  # published before its blocks are freed
                    self.hooks.emit_many(traced)
                    traced = []
                req.finished_time = now
                self.scheduler.finish_requests(req, status)
                self.requests.pop(req.request_id, None)
                if self.hooks.active:
                    # no text behind an EngineCore: the front end detokenizes (after this event)
                    self.hooks.emit(ENGINE, FINISHED, request_id=req.request_id, step=sched.step,
                                    finish_reason=req.finish_reason, stop_reason=req.stop_reason,
                                    num_output_tokens=req.num_output_tokens,
                                    text=req.output_text if self.detokenize else None)
            if not self.detokenize:
                outputs.append(self._core_output(req))  # every step: the front end detokenizes
            elif status is not None or req.params.output_kind != "final_only":
                outputs.append(self._output(req))
        if traced:
            self.hooks.emit_many(traced)
        if self.hooks.active:
            self.hooks.emit(ENGINE, STEP, END, step=sched.step, num_outputs=len(outputs), stats=vars(self.stats()))
        if self.hooks.gated:
            self.hooks.gate("step_end", step=sched.step)
        self.step_count += 1
        return outputs

    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        p, num_output_tokens = req.params, len(req.output_token_ids)
        if num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and tok == req.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if tok in p.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
            for stop in p.stop_strs if req.detokenizer is not None else ():
                # only the tail can hold a new match: what was checked before had none
                at = req.output_text.find(stop, max(0, len(req.output_text) - len(stop) - 64))
                if at >= 0:
                    req.stop_reason = stop
                    req.output_text = req.output_text[:at + (len(stop) if p.include_stop_str_in_output else 0)]
                    return RequestStatus.FINISHED_STOPPED
        if num_output_tokens >= req.max_tokens or len(req.all_token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _logprobs(self, entry: dict[int, float], sampled: int, rank: int) -> dict[int, Logprob]:
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])
        out = {t: Logprob(lp, i + 1, self.tokenizer.decode([t])) for i, (t, lp) in enumerate(ranked)}
        out[sampled].rank = rank
        return out

    def _output(self, req: Request) -> RequestOutput:
        # Positional arguments: built for every running request every step, so it counts.
        completion = CompletionOutput(0, req.output_text, list(req.output_token_ids),
                                      list(req.logprobs) if req.params.logprobs is not None else None,
                                      req.finish_reason, req.stop_reason)
        metrics = dict(arrival_time=req.arrival_time, first_scheduled_time=req.first_scheduled_time,
                       first_token_time=req.first_token_time, finished_time=req.finished_time,
                       num_preemptions=req.num_preemptions)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion], req.status.finished,
                             req.num_cached_tokens, metrics)

    def _core_output(self, req: Request) -> EngineCoreOutput:
        """The tokens (and logprobs) sampled since the request's last output, for the front end."""
        sent, n = req.num_sent, len(req.output_token_ids)
        req.num_sent = n
        lps = None
        if req.params.logprobs is not None:
            lps = [[[t, lp.logprob, lp.rank, lp.decoded_token] for t, lp in entry.items()]
                   for entry in req.logprobs[sent:]]
        metrics = None
        if sent == 0 or req.finished_time is not None:
            metrics = dict(arrival_time=req.arrival_time, first_scheduled_time=req.first_scheduled_time,
                           first_token_time=req.first_token_time, finished_time=req.finished_time,
                           num_preemptions=req.num_preemptions)
        return EngineCoreOutput(req.request_id, req.output_token_ids[sent:], lps, req.finish_reason,
                                req.stop_reason, req.num_cached_tokens, metrics)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; False (nothing changed) while requests hold blocks."""
        return self.block_manager.reset_prefix_cache()

    # ---- observation --------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            step=self.step_count, num_waiting=len(self.scheduler.waiting), num_running=len(self.scheduler.running),
            num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_usable_blocks,
            num_preemptions=self.scheduler.num_preemptions, prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits, kv_cache_usage=bm.usage(),
        )

    def snapshot(self, sched: SchedulerOutput | None = None) -> dict:
        """The engine's visible state, as plain data (taken at schedule time when traced)."""
        # Dict displays in one comprehension, not dict(...) or a call per request: taken every step
        # for every request while traced.
        def rows(reqs) -> list[dict]:
            return [
                {
                    "request_id": r.request_id,
                    "status": r.status._value_,
                    "num_computed_tokens": r.num_computed_tokens,
                    "num_tokens": len(r.all_token_ids),
                    "num_prompt_tokens": len(r.prompt_token_ids),
                    "num_output_tokens": len(r.output_token_ids),
                    "block_table": r.block_ids.copy(),
                    "num_cached_tokens": r.num_cached_tokens,
                    "num_preemptions": r.num_preemptions,
                }
                for r in reqs
            ]

        snap = {"waiting": rows(self.scheduler.waiting), "running": rows(self.scheduler.running),
                "stats": vars(self.stats())}
        if sched is not None:
            snap |= {
                "step": sched.step, "token_budget": sched.token_budget,
                "num_scheduled_tokens": sched.num_scheduled_tokens,
                "total_num_scheduled_tokens": sched.total_num_scheduled_tokens,
                "scheduled": [{"request_id": s.request.request_id, "num_tokens": s.num_tokens,
                               "num_computed_before": s.num_computed_before,
                               "kind": "prefill" if s.is_prefill else "decode"} for s in sched.scheduled],
                "admitted": sched.admitted, "preempted": sched.preempted, "waiting_reasons": sched.waiting_reasons}
        return snap

    def _trace_schedule(self, sched: SchedulerOutput) -> None:
        h = self.hooks
        for rid in sched.admitted:
            h.emit(SCHEDULER, SCHEDULED, request_id=rid, step=sched.step)
        snap = self.snapshot(sched)
        del snap["step"]  # the event's own step field carries it
        h.emit(SCHEDULER, SCHEDULE, SNAPSHOT, step=sched.step, **snap)
        h.emit(SCHEDULER, SCHEDULE, END, step=sched.step,
               total_num_scheduled_tokens=snap["total_num_scheduled_tokens"])
        if h.gated:
            h.gate("execute", step=sched.step)

    def _load_progress(self, done: int, total: int) -> None:
        """Weights read so far, for the startup progress bar: about every 5 %."""
        if self.hooks.active and (done == total or done - self._loaded >= total / 20):
            self._loaded = done
            self.hooks.emit(ENGINE, "model_load_progress", COUNTER, bytes=done, total_bytes=total)

    def _stage(self, name: str, **details):
        return _Stage(self, name, details)


class _Stage:
    """Times one startup stage, records it, and traces it as a span."""

    def __init__(self, engine: LLMEngine, name: str, details: dict):
        self.engine, self.name, self.details = engine, name, details

    def __enter__(self) -> dict:
        self.t0 = time.perf_counter()
        if self.engine.hooks.active:
            self.engine.hooks.emit(ENGINE, self.name, BEGIN, **self.details)
        return self.details

    def __exit__(self, exc_type, exc, tb) -> None:
        seconds = time.perf_counter() - self.t0
        if exc_type is None:
            self.engine.startup.append((self.name, seconds, self.details))
        if self.engine.hooks.active:
            self.engine.hooks.emit(ENGINE, self.name, END, seconds=seconds, ok=exc_type is None, **self.details)
