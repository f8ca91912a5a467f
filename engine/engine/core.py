"""EngineCore: the inner loop of vLLM V1 (``v1/engine/core.py``), its step cut as vLLM 0.33's:

    step() = scheduler.schedule() -> model_executor.execute_model(scheduler_output)  (forward; None)
             -> scheduler.get_grammar_bitmask() -> model_executor.sample_tokens(grammar_output)
             -> scheduler.update_from_output() -> take_draft_token_ids() -> update_draft_token_ids()

With async scheduling (vLLM's default with CUDA, off on a CPU: ``async_scheduling``) the drivers call
``step_with_batch_queue`` instead (``step_fn``): step N+1 is scheduled (by an ``AsyncScheduler``,
against step N's placeholder tokens) while step N's forward pass runs on the executor's thread, and
a call returns the outputs of the oldest of the two steps in flight. ``step()`` stays the
synchronous step, for async scheduling off and for lessons that take a step apart.

It owns the scheduler (with its KV-cache manager) and the executor (the workers, their model
runners, models and KV caches), takes requests as token ids and returns token ids: no
tokenizing, no text, no stop strings (the front end's Processor and OutputProcessor do
those). Who drives it: ``InprocClient`` calls step() directly (the offline ``LLM``, lessons);
``BusyLoop`` runs it in a thread, in the engine-core process (``EngineCoreProc``) or in the
API server with ``serve --no-multiprocessing``.

The step controller's gates sit between the calls: "step" before scheduling, "execute" after
the schedule's snapshot, "grammar_bitmask" and "sample_tokens" before those calls, "postprocess"
before update_from_output and "step_end" after it.
"""
from __future__ import annotations

import random
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable

import torch

from engine.config import EngineConfig, default_async_scheduling
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_cache_utils import bytes_per_block, hybrid_capacity, kv_cache_groups_of
from engine.core.sched.async_scheduler import AsyncScheduler
from engine.core.sched.output import SchedulerOutput, diff_summary
from engine.core.sched.scheduler import Scheduler
from engine.cpu_threads import place_threads
from engine.engine.core_types import EngineCoreOutputs, EngineCoreRequest
from engine.executor.multiproc_executor import Executor, MultiprocExecutor, UniProcExecutor
from engine.hooks import BEGIN, COUNTER, END, SNAPSHOT, Hooks
from engine.model_executor import model_loader
from engine.model_executor.layers.attention import default_backend
from engine.model_executor.models.registry import check_tp_size
from engine.outputs import DraftTokenIds, EngineStats
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.spec_decode.draft_model import resolve_draft_model
from engine.structured_output import StructuredOutputManager
from engine.tokenizer import load_tokenizer
from engine.trace_names import (
    ABORTED,
    BATCH_QUEUE,
    CONFIG,
    ENGINE,
    FINISHED,
    PROFILE_START,
    PROFILE_STOP,
    PROFILER,
    QUEUED,
    SCHEDULE,
    SCHEDULED,
    SCHEDULER,
    STEP,
    UPDATE_FROM_OUTPUT,
)
from engine.worker.model_runner import ModelRunner
from engine.worker.worker import Worker

# how long a step waits for a grammar when nothing else can run (short: an abort or a new request may come)
GRAMMAR_WAIT_S = 0.05
# how long an empty step waits while only a KV connector's transfers are under way (they run on its threads)
KV_TRANSFER_WAIT_S = 0.002
BATCH_QUEUE_SIZE = 2  # async scheduling: steps in flight at most (V1's batch_queue_size without pipeline parallelism)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def scheduling_text(async_scheduling: bool, device: str) -> str:
    """The Startup panel's words for how steps are scheduled, and why (engine/config.py default_async_scheduling)."""
    if async_scheduling == default_async_scheduling(device):
        why = f"the {'CUDA' if device == 'cuda' else 'CPU'} default, as vLLM"
    else:
        why = "asked for" + ("; vLLM keeps it off on a CPU" if async_scheduling else "")
    return f"async scheduling {'on' if async_scheduling else 'off'} ({why})"


class EngineCore:
    """Requests (token ids) in, one step at a time, EngineCoreOutputs (token ids) out.

    Single-threaded: whoever drives it calls add_request, abort_requests and step from one
    thread at a time (BusyLoop's engine lock guarantees that when several threads are about).
    Builds everything at construction, each startup stage timed and traced."""

    def __init__(self, config: EngineConfig, hooks: Hooks | None = None):
        self.config = config
        self.hooks = hooks or Hooks()
        self.startup: list[tuple[str, float, dict]] = []  # (stage, seconds, details)
        mc, cc = config.model, config.cache
        self.device = torch.device(mc.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if config.scheduler.async_scheduling is None:  # (the device was left to us: engine/config.py)
            config.scheduler.async_scheduling = default_async_scheduling(self.device.type)
        if self.hooks.active:
            self.hooks.emit(ENGINE, CONFIG, model=config.model.model, config=config.to_dict())
        self.on_dead: Callable[[str], None] | None = None  # a tensor-parallel worker died (set before it can)
        self._resolve_model()
        self.attention_backend = config.attention_backend or default_backend(self.device, self.dtype)
        if self.attention_backend == "cpu" and (self.device.type != "cpu" or self.dtype != torch.float32):
            raise ValueError(f"attention_backend='cpu' runs float32 models on a CPU (this one: {self.dtype} on "
                             f"{self.device.type}); use --dtype float32, or attention_backend 'torch'")
        self._load_model()
        num_blocks = self._initialize_kv_caches()
        self.kv_cache_manager = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching, self.hooks,
                                               kv_cache_groups_of(self.model_config, cc.block_size))
        # grammars for structured outputs: xgrammar is imported by the first one, on the compile thread
        self.structured_output_manager = StructuredOutputManager(
            self.tokenizer, self.model_config.vocab_size, self.eos_token_id, config.scheduler.max_num_seqs)
        self._make_scheduler()
        # async scheduling with speculation: step -> Future of the drafts proposed after it, and drafts
        # known but not yet written into the step whose placeholders the worker filled with them
        self._draft_futures: dict[int, Future] = {}
        self._unplaced_drafts: DraftTokenIds | None = None
        self._rng = random.Random(mc.seed)
        self.profiling_since: int | None = None  # the first profiled step, while profiling

    def _resolve_model(self) -> None:
        """The checkpoint, its config, dtype, context length and tokenizer (and a draft model's, checked
        before any worker loads it)."""
        mc = self.config.model
        with self._stage("resolve_model", model=mc.model) as info:
            self.model_path = model_loader.resolve(mc.model)
            model_loader.check_checkpoint(self.model_path)
            self.model_config = model_loader.read_config(self.model_path)
            info["architecture"] = self.model_config.architecture
        self.dtype = DTYPES[mc.dtype or model_loader.default_dtype(self.model_config, self.device.type)]
        max_positions = self.model_config.max_position_embeddings
        self.max_model_len = mc.max_model_len or max_positions
        if self.max_model_len > max_positions:
            raise ValueError(f"max_model_len must be <= {max_positions} (the model's "
                             f"max_position_embeddings), got {self.max_model_len}")
        with self._stage("tokenizer_load", path=str(self.model_path)) as info:
            self.tokenizer = load_tokenizer(self.model_path)
            info["vocab_size"] = len(self.tokenizer)
        self.eos_token_id = self.model_config.eos_token_id
        if self.eos_token_id is None:
            self.eos_token_id = self.tokenizer.eos_token_id

        spec = self.config.speculative
        if spec is not None and spec.method == "draft_model" and any(
                getattr(self.model_config, "layer_sliding_windows", None) or ()):
            raise ValueError("a draft model needs a target without sliding-window layers (its proposer reads the "
                             "target's full-attention block table); use speculative method 'ngram'")
        if spec is not None and spec.method == "draft_model":  # checked here, before any worker loads it
            with self._stage("resolve_draft_model", model=spec.model) as info:
                draft_path, draft = resolve_draft_model(spec, self.model_config, self.tokenizer, self.max_model_len)
                info |= dict(path=str(draft_path), architecture=draft.architecture, num_layers=draft.num_layers)

    def _load_model(self) -> None:
        """The executor and its workers, each loading the weights (timed and traced as model_load)."""
        config = self.config
        self._loaded = 0  # weight bytes last reported (see _load_progress)
        tp = config.parallel.tensor_parallel_size
        check_tp_size(self.model_config, tp)
        self.ep_size = tp if config.parallel.enable_expert_parallel else 1  # ranks a mixture's experts are split over
        with self._stage("model_load", path=str(self.model_path), device=str(self.device),
                         attention_backend=self.attention_backend) as info:
            if self.device.type == "cpu" and tp == 1:  # (each worker places its own under tensor parallelism)
                info["threads"] = place_threads(config.parallel).describe()
            info["scheduling"] = scheduling_text(config.scheduler.async_scheduling, self.device.type)
            self.model_executor = self._make_executor()
            info |= self.model_executor.load_model(self._load_progress)

    def _initialize_kv_caches(self) -> int:
        """V1's name: how many KV blocks fit, and the workers' caches allocated; returns the number."""
        with self._stage("kv_cache_alloc") as info:
            num_blocks, why = self.model_executor.determine_num_blocks()
            info |= self.model_executor.initialize_kv_cache(num_blocks)
            info["reason"] = why
            info |= hybrid_capacity(kv_cache_groups_of(self.model_config, self.config.cache.block_size), num_blocks,
                                    self.max_model_len)
        return num_blocks

    def _make_scheduler(self) -> None:
        """The scheduler (AsyncScheduler with async scheduling: two batches in flight, step_with_batch_queue)."""
        config, spec = self.config, self.config.speculative
        # a draft model proposes in the worker, after the step: its k drafts need k lookahead slots (V1's name)
        lookahead = spec.num_speculative_tokens if spec is not None and spec.method == "draft_model" else 0
        sched_args = (config.scheduler, self.kv_cache_manager, self.max_model_len, self.hooks,
                      self.structured_output_manager)
        connector = self._make_kv_connector()
        if config.scheduler.async_scheduling:  # two batches in flight: step_with_batch_queue
            self.scheduler = AsyncScheduler(*sched_args, num_lookahead_tokens=lookahead, connector=connector,
                                            num_spec_tokens=spec.num_speculative_tokens if spec else 0)
            self.batch_queue: deque | None = deque()
        else:
            self.scheduler = Scheduler(*sched_args, num_lookahead_tokens=lookahead, connector=connector)
            self.batch_queue = None
        self.step_fn = self.step if self.batch_queue is None else self.step_with_batch_queue  # V1's

    def _make_kv_connector(self):
        """The KV connector's scheduler side (its worker side is the Worker's), or None."""
        if self.config.kv_transfer_config is None:
            return None
        from engine.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from engine.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        if self.config.parallel.tensor_parallel_size > 1 or self.kv_cache_manager.num_kv_cache_groups > 1 \
                or self.kv_cache_manager.has_sliding_window:
            raise ValueError("kv_transfer_config needs tensor_parallel_size=1 and a model with one full-attention "
                             "KV-cache group (no sliding-window layers)")
        connector = KVConnectorFactory.create_connector(self.config, KVConnectorRole.SCHEDULER)
        connector.hooks = self.hooks
        if hasattr(connector, "set_num_cpu_blocks"):  # a host-memory tier: its blocks, as the worker counts them
            connector.set_num_cpu_blocks(bytes_per_block(self.model_config, self.config.cache.block_size, self.dtype))
        return connector

    def _make_executor(self) -> Executor:
        args = (self.config, self.model_path, self.model_config, self.device, self.dtype, self.attention_backend)
        if self.config.parallel.distributed_executor_backend == "mp":
            return MultiprocExecutor(*args, self.hooks, on_dead=lambda reason: self.on_dead and self.on_dead(reason))
        return UniProcExecutor(Worker(*args, hooks=self.hooks), self.config.scheduler.async_scheduling)

    # With one rank the model, its KV cache and its model runner live here, for lessons to read
    @property
    def model(self) -> torch.nn.Module:
        return self._driver_worker().model

    @property
    def kv_caches(self) -> list:
        return self._driver_worker().kv_caches

    @property
    def model_runner(self) -> ModelRunner:
        return self._driver_worker().model_runner

    def _driver_worker(self) -> Worker:
        if not isinstance(self.model_executor, UniProcExecutor):
            tp = self.model_executor.tensor_parallel_size
            raise AttributeError(f"with tensor_parallel_size={tp} the model, its KV cache and its model runner "
                                 f"live in the worker processes, not in this one")
        return self.model_executor.worker

    @property
    def dead(self) -> str | None:
        """Why the engine can no longer run (a tensor-parallel worker died), or None."""
        return getattr(self.model_executor, "dead", None)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also at exit). Safe to call twice."""
        self.structured_output_manager.shutdown()
        self.model_executor.shutdown()
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()

    @property
    def step_count(self) -> int:
        return self.scheduler.step_count

    @property
    def requests(self) -> dict[str, Request]:
        """Every unfinished request, by id (the scheduler's)."""
        return self.scheduler.requests

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> Request:
        """Validate and queue a request (its sampling_params a SamplingParams). Raises ValueError
        before changing any state."""
        rid, ids, params = request.request_id, request.prompt_token_ids, request.sampling_params
        if rid in self.scheduler.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        vocab = self.model_config.vocab_size
        if not ids or any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt must be a non-empty list of token ids in [0, {vocab - 1}]")
        max_tokens = self._check_lengths(ids, params)
        kv_params = (params.extra_args or {}).get("kv_transfer_params")  # (copied: a connector updates its own)
        req = Request(rid, request.prompt, ids, params, self.eos_token_id, max_tokens,
                      arrival_time=request.arrival_time or time.monotonic(), priority=request.priority,
                      kv_transfer_params=dict(kv_params) if kv_params else None)
        # every request has a seed (MRv2's): its draws are keyed by (seed, position)
        req.sampling_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        if params.structured_outputs is not None:  # waits in the queue until its grammar compiles
            req.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
            self.structured_output_manager.grammar_init(req)
        self.scheduler.add_request(req)
        if self.hooks.active:
            self._trace_queued(req)
        return req

    def _check_lengths(self, ids: list[int], params: SamplingParams) -> int:
        n, limit = len(ids), self.max_model_len
        if n >= limit:
            raise ValueError(f"prompt is {n} tokens; max_model_len is {limit}, so it must be at most "
                             f"{limit - 1} tokens to leave room for one generated token")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
        if n + max_tokens > limit:
            raise ValueError(f"max_tokens={max_tokens} plus the prompt's {n} tokens exceeds max_model_len={limit}; "
                             f"max_tokens must be <= {limit - n}")
        bm = self.kv_cache_manager
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

    def abort_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                       stop_reason: int | str | None = None) -> None:
        """Stop requests and free their blocks. Unknown or finished ids are ignored. status
        FINISHED_STOPPED: the front end matched a stop string (stop_reason) in its text."""
        for rid in request_ids:
            req = self.scheduler.requests.get(rid)
            if req is None:
                continue
            req.stop_reason = stop_reason
            self.scheduler.finish_requests((rid,), status)
            if self.hooks.active:
                self._trace_aborted(req, status)

    def warm_up(self) -> dict:
        """Run the model once on a dummy batch (compiling the Triton kernels on first use),
        traced as the startup stage ``kernel_warmup``. Not a request, not an engine step.
        `vllm-trace serve` calls it before taking requests; offline use may skip it."""
        if self.step_count:  # it writes (then zeroes) cache blocks the prefix cache may now own
            raise RuntimeError("warm_up() must run before the first engine step")
        with self._stage("kernel_warmup", backend=self.attention_backend) as info:
            info |= self.model_executor.warm_up(self.max_model_len)
        return info

    def profile(self, is_start: bool = True) -> dict:
        """Start or stop profiling (vLLM V1's ``EngineCore.profile``): from the next step on, every
        op of every rank's forward pass and sampler is a kernel launch with its op kind, FLOPs and
        bytes (engine/worker/profiler.py); with ``profiler_dir`` the window is also captured by
        torch.profiler. Call it between steps. Starting twice or stopping when stopped changes
        nothing. Returns {"profiling", "step", "profiler_dir", "ranks": [each rank's answer]}
        (a stopping rank's "trace_file" where torch.profiler wrote). Hooks: profiler/start (step:
        the first profiled step) and profiler/stop (step: the last one)."""
        if is_start == (self.profiling_since is not None):
            return dict(profiling=is_start, step=self.profiling_since, profiler_dir=self.config.profiler_dir, ranks=[])
        ranks = self.model_executor.profile(is_start)
        upcoming = self.scheduler.num_scheduled_steps  # the next step scheduled (async: ahead of step_count)
        step = upcoming if is_start else upcoming - 1
        self.profiling_since = upcoming if is_start else None
        info = dict(profiling=is_start, step=step, profiler_dir=self.config.profiler_dir, ranks=ranks)
        if self.hooks.active:
            self._trace_profile(info)
        return info

    def _trace_profile(self, info: dict) -> None:
        files = [r["trace_file"] for r in info["ranks"] if "trace_file" in r]
        self.hooks.emit(PROFILER, PROFILE_START if info["profiling"] else PROFILE_STOP, step=info["step"],
                        profiler_dir=info["profiler_dir"], **({"trace_files": files} if files else {}))

    def held_attention_on_triton(self) -> dict:
        """A utility for viewers: see ModelRunner.held_attention_on_triton."""
        return self.model_executor.held_attention_on_triton()

    def has_unfinished_requests(self) -> bool:
        """Requests to schedule, or (async scheduling) steps in flight whose outputs are not in yet."""
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """One engine step, as vLLM 0.33's: schedule -> execute_model (the forward pass) ->
        get_grammar_bitmask -> sample_tokens -> update_from_output, then the worker's drafts
        (take_draft_token_ids) -> update_draft_token_ids.

        Returns an EngineCoreOutput per request that got a token. Changes: the scheduler's
        queues and block tables, the KV cache, each scheduled request's num_computed_tokens and
        tokens; finished requests are removed and their blocks freed; step_count + 1. Hooks:
        engine/step begin and end (with stats), SCHEDULED per admitted request, the schedule
        snapshot and end, all that the calls emit; when gated, the step, execute, grammar_bitmask,
        sample_tokens, postprocess and step_end gates."""
        if self.scheduler.waiting_for_grammars():  # nothing could run: let the compile thread have the CPU
            self.structured_output_manager.wait_for_compile(self.scheduler.waiting, GRAMMAR_WAIT_S)
        if self.hooks.gated:
            self.hooks.gate("step", step=self.step_count)
        if self.hooks.active:
            self.hooks.emit(ENGINE, STEP, BEGIN, step=self.step_count)
        scheduler_output = self.scheduler.schedule()
        if self.hooks.active:
            self._trace_schedule(scheduler_output)
        model_output = None
        # the workers free finished slots; a KV connector's transfers go on while nothing is scheduled
        connector = self.scheduler.connector is not None
        if not scheduler_output.is_empty or scheduler_output.finished_req_ids or connector:
            self.model_executor.execute_model(scheduler_output)
        if connector and scheduler_output.is_empty:  # only transfers under way: let their threads run
            time.sleep(KV_TRANSFER_WAIT_S)
        if not scheduler_output.is_empty or connector:
            if self.hooks.gated:
                self.hooks.gate("grammar_bitmask", step=scheduler_output.step)
            grammar_output = self.scheduler.get_grammar_bitmask(scheduler_output)
            if self.hooks.gated:
                self.hooks.gate("sample_tokens", step=scheduler_output.step)
            model_output = self.model_executor.sample_tokens(grammar_output)
        if self.hooks.gated:
            self.hooks.gate("postprocess", step=scheduler_output.step)
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        draft_token_ids = self.model_executor.take_draft_token_ids() if model_output is not None else None
        if draft_token_ids is not None:  # speculative decoding: drafts for the next step
            self.scheduler.update_draft_token_ids(draft_token_ids)
        if self.hooks.active:
            self._trace_step_end(scheduler_output, outputs)
        return outputs

    def step_with_batch_queue(self) -> EngineCoreOutputs:
        """One call of vLLM 0.33's async loop (its batch queue holds BATCH_QUEUE_SIZE steps):
        schedule a step and launch it (execute_model and sample_tokens return futures: the forward
        pass runs on the executor's thread); while the queue has room, return at once, with no
        outputs. Otherwise block on the oldest step, update_from_output it, and return its outputs.
        So step N+1 is scheduled while step N's forward pass runs, against step N's placeholders
        (AsyncScheduler). A step with a grammar request whose tokens are in flight
        (pending_structured_output_tokens) runs its forward pass at once but computes its bitmask
        and samples after the previous step's update_from_output (deferred). With speculation the
        drafts proposed after a step are taken on the executor's thread right after its sampling, and
        the scheduler learns them once that step is updated (_place_drafts): the worker has put them in
        place of the next step's placeholder draft ids.

        Hooks and gates as step()'s, per step: "execute" after its snapshot, "grammar_bitmask" and
        "sample_tokens" before those calls, "postprocess" before its update_from_output and
        "step_end" after; "step" at the start of each call (info: the step it schedules, or finishes
        if it schedules none, and the steps in flight). engine/step begins when a step is scheduled
        and ends when its outputs are in, so two steps' spans overlap; engine/batch_queue at the end
        of a call says what it did (scheduled, executed: the step whose outputs it returned). While a
        step controller may stop the engine (hooks.gated) the calls come in the same order, two steps
        in flight, but the forward pass and sampling a call launches are waited for before its next
        gate: a hold sees them done, and only one thread (the core's or the executor's, at a kernel)
        is ever held."""
        queue, deferred, scheduled = self.batch_queue, None, None
        schedules = self.scheduler.has_unfinished_requests()
        if not schedules and not queue:
            return EngineCoreOutputs(outputs=[])
        if self.hooks.gated:
            self.hooks.gate("step", step=self.scheduler.num_scheduled_steps if schedules else queue[-1][1].step,
                            in_flight=[s.step for _, s, _ in reversed(queue)], schedules=schedules)
        if schedules:
            if self.scheduler.waiting_for_grammars() and not queue:
                self.structured_output_manager.wait_for_compile(self.scheduler.waiting, GRAMMAR_WAIT_S)
            sched, exec_future = self._schedule_and_execute()
            scheduled = sched.step
            if sched.is_empty and self.scheduler.connector is None:
                future = exec_future
            elif sched.pending_structured_output_tokens:
                deferred = (sched, exec_future)  # its bitmask needs the tokens of the step before
            else:
                future = self._sample_async(sched)
            if deferred is None:
                queue.appendleft((future, sched, exec_future))
                if len(queue) < BATCH_QUEUE_SIZE and (not sched.is_empty or self.scheduler.has_unfinished_requests()):
                    if self.hooks.active:  # room for one more: schedule it before blocking
                        self._trace_batch_queue(scheduled, None)
                    return EngineCoreOutputs(outputs=[])
        future, sched, exec_future = queue.pop()
        exec_future.result()  # the forward pass's error, if it raised
        outputs = self._update(sched, future.result())
        self._place_drafts(sched.step, deferred[0] if deferred else queue[-1][1] if queue else None)
        if deferred is not None:  # the tokens it waited for are in: its bitmask, then its sampling
            deferred_sched, exec_future = deferred
            queue.appendleft((self._sample_async(deferred_sched), deferred_sched, exec_future))
        if self.hooks.active:
            self._trace_batch_queue(scheduled, sched.step)
        return outputs

    def _trace_batch_queue(self, scheduled: int | None, executed: int | None) -> None:
        in_flight = [s.step for _, s, _ in reversed(self.batch_queue)]
        self.hooks.emit(ENGINE, BATCH_QUEUE, step=scheduled if scheduled is not None else executed,
                        scheduled=scheduled, executed=executed, in_flight=in_flight)

    def _place_drafts(self, step: int, next_sched: SchedulerOutput | None) -> None:
        """Speculation under async scheduling: step `step` is updated, so the drafts proposed after it
        are known; the worker put them in place of the placeholder draft ids of the next step that
        runs (in flight, deferred, or not yet scheduled: then when it is). The scheduler learns them
        there (update_draft_token_ids_in_output, V1's): what to count as proposed, what its grammar
        bitmask constrains."""
        drafts_future = self._draft_futures.pop(step, None)
        if drafts_future is not None:
            self._unplaced_drafts = drafts_future.result() or DraftTokenIds([], [])
        if self._unplaced_drafts is not None and next_sched is not None and not next_sched.is_empty:
            self.scheduler.update_draft_token_ids_in_output(self._unplaced_drafts, next_sched)
            self._unplaced_drafts = None

    def _schedule_and_execute(self):
        if self.hooks.active:
            self.hooks.emit(ENGINE, STEP, BEGIN, step=self.scheduler.num_scheduled_steps)
        sched = self.scheduler.schedule()
        if self._unplaced_drafts is not None:  # the drafts of the step before, already known
            self._place_drafts(-1, sched)
        if self.hooks.active:
            self._trace_schedule(sched)
        future = self.model_executor.execute_model(sched, non_block=True)
        if sched.is_empty and self.scheduler.connector is not None:  # only transfers under way: let them run
            time.sleep(KV_TRANSFER_WAIT_S)
        if self.hooks.gated:  # a controller's next stop (grammar_bitmask) comes after the forward pass, as in step()
            future.result()
        return sched, future

    def _sample_async(self, sched: SchedulerOutput):
        if self.hooks.gated:
            self.hooks.gate("grammar_bitmask", step=sched.step)
        grammar_output = self.scheduler.get_grammar_bitmask(sched)
        if self.hooks.gated:
            self.hooks.gate("sample_tokens", step=sched.step)
        future = self.model_executor.sample_tokens(grammar_output, non_block=True)
        if self.config.speculative is not None:  # taken after this sampling, before the next step's
            self._draft_futures[sched.step] = self.model_executor.take_draft_token_ids(non_block=True)
        if self.hooks.gated:  # the next gate comes after the sampling (a hold sees its tokens)
            future.result()
        return future

    def _update(self, sched: SchedulerOutput, model_output) -> EngineCoreOutputs:
        if self.hooks.gated:
            self.hooks.gate("postprocess", step=sched.step)
        if self.hooks.active:  # on the core's thread, beside the next step's forward pass
            self.hooks.emit(SCHEDULER, UPDATE_FROM_OUTPUT, BEGIN, step=sched.step)
        outputs = self.scheduler.update_from_output(sched, model_output)
        if self.hooks.active:
            self.hooks.emit(SCHEDULER, UPDATE_FROM_OUTPUT, END, step=sched.step)
            self._trace_step_end(sched, outputs)
        return outputs

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; False (nothing changed) while requests hold blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    # ---- observation --------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm, spec = self.kv_cache_manager, self.scheduler.spec_stats
        return EngineStats(
            step=self.step_count, num_waiting=len(self.scheduler.waiting), num_running=len(self.scheduler.running),
            num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_usable_blocks,
            num_preemptions=self.scheduler.num_preemptions, prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits, kv_cache_usage=bm.usage,
            spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_num_accepted_tokens_per_pos=list(spec.num_accepted_tokens_per_pos),
            moe_expert_tokens={str(k): list(v) for k, v in self.scheduler.expert_load.num_tokens.items()},
            moe_ep_size=self.ep_size,
            connector_prefix_cache_queries=self.scheduler.connector_prefix_cache_queries,
            connector_prefix_cache_hits=self.scheduler.connector_prefix_cache_hits,
            kv_cache_groups=bm.group_stats(),
            kv_connector_stats=self.scheduler.connector.get_kv_connector_stats() if self.scheduler.connector else None,
        )

    def snapshot(self, sched: SchedulerOutput | None = None) -> dict:
        """The engine's visible state, as plain data (taken at schedule time when traced)."""
        # Dict displays in one comprehension, not dict(...) or a call per request: taken every step
        # for every request while traced.
        hybrid = self.kv_cache_manager.num_kv_cache_groups > 1  # each group's table too

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
                    "priority": r.priority,
                    **({"kv_block_tables": [b.copy() for b in r.kv_block_ids]} if hybrid else {}),
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
                "scheduled": self._scheduled_rows(sched),
                "admitted": sched.admitted, "preempted": sched.preempted, "waiting_reasons": sched.waiting_reasons,
                "scheduler_output": diff_summary(sched)}
        return snap

    def _scheduled_rows(self, sched: SchedulerOutput) -> list[dict]:
        """Per scheduled request: its tokens this step, where they start, prefill or decode."""
        starts, requests = sched.num_computed_before(), self.scheduler.requests
        rows = []
        for rid, n in sched.num_scheduled_tokens.items():
            req, start = requests[rid], starts[rid]
            known = len(req.all_token_ids)  # async scheduling: a decode may start past them, at a placeholder
            prefill = known - start > 1 or (start < known and not req.output_token_ids)
            rows.append({"request_id": rid, "num_tokens": n, "num_computed_before": start,
                         "kind": "prefill" if prefill else "decode"})
        return rows

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

    def _trace_step_end(self, sched: SchedulerOutput, outputs: EngineCoreOutputs) -> None:
        self.hooks.emit(ENGINE, STEP, END, step=sched.step, num_outputs=len(outputs.outputs), stats=vars(self.stats()))
        if self.hooks.gated:
            self.hooks.gate("step_end", step=sched.step)

    def _trace_queued(self, req: Request) -> None:
        self.hooks.emit(ENGINE, QUEUED, request_id=req.request_id, step=self.step_count,
                        num_prompt_tokens=req.num_prompt_tokens, max_tokens=req.max_tokens, params=vars(req.params),
                        priority=req.priority, seed=req.sampling_seed)

    def _trace_aborted(self, req: Request, status: RequestStatus) -> None:
        if status is RequestStatus.FINISHED_ABORTED:
            self.hooks.emit(ENGINE, ABORTED, request_id=req.request_id, step=self.step_count)
        else:
            self.hooks.emit(ENGINE, FINISHED, request_id=req.request_id, step=self.step_count,
                            finish_reason=req.finish_reason, stop_reason=req.stop_reason,
                            num_output_tokens=req.num_output_tokens)

    def _load_progress(self, done: int, total: int) -> None:
        """Weights read so far, for the startup progress bar: about every 5 %."""
        if self.hooks.active and (done == total or done - self._loaded >= total / 20):
            self._loaded = done
            self.hooks.emit(ENGINE, "model_load_progress", COUNTER, bytes=done, total_bytes=total)

    def _stage(self, name: str, **details):
        return _Stage(self, name, details)


class _Stage:
    """Times one startup stage, records it, and traces it as a span."""

    def __init__(self, engine: EngineCore, name: str, details: dict):
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
