"""A worker: one tensor-parallel rank's model shard, KV-cache shard and model runner (vLLM V1's
``Worker`` / ``GPUModelRunner`` pair).

With one rank the ``UniProcExecutor`` holds a Worker in the engine-core process and hands it
the scheduler's own objects. With N ranks each Worker lives in its own process
(``engine.executor.worker_proc``, started by ``MultiprocExecutor``) and keeps, as V1's model runner does, a
``CachedRequestState`` per live request: the token ids it has been sent, the sampling
parameters and the request's seed. Every step it receives the same
``WorkerStep`` (the scheduler output as plain data: new requests whole, known ones as the
tokens added since) and runs the same forward pass over its shard; the all-reduces and the
logits all-gather inside the model tie the ranks together. Every rank then samples, as in V1:
the same logits and the same seeds give the same tokens; the executor keeps rank 0's.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch

from engine.core.kv_cache_utils import allocate_kv_cache, bytes_per_block, num_blocks_for
from engine.core.sched.output import ScheduledRequest, SchedulerOutput
from engine.distributed.parallel_state import TPGroup
from engine.hooks import Hooks
from engine.model_executor import model_loader
from engine.model_executor.layers.attention import AttentionBackend
from engine.model_executor.model_loader import ModelArchConfig, load_state_dict
from engine.model_executor.models.registry import model_class
from engine.sample.sampler import SamplerOutput
from engine.sampling_params import SamplingParams
from engine.spec_decode.draft_model import DraftModelProposer
from engine.trace_names import EXECUTE_MODEL, WORKER
from engine.worker.model_runner import ModelRunner


# ---- what the executor sends each worker ------------------------------------------------------
class NewRequestData(msgspec.Struct, array_like=True, gc=False):
    """A request the workers have not seen (V1's name): everything sampling needs."""
    request_id: str
    token_ids: list[int]  # prompt and any tokens generated so far
    num_prompt_tokens: int
    sampling_params: dict
    eos_token_id: int | None
    seed: int  # the request's sampling seed: every rank draws the same tokens the engine's own would


class ScheduledReq(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    new_token_ids: list[int]  # tokens appended since the workers last heard of it
    num_computed_before: int
    num_tokens: int
    block_ids: list[int]
    spec_token_ids: list[int] = []  # speculative decoding: drafts to verify after its last token


class WorkerStep(msgspec.Struct, array_like=True, gc=False):
    """One engine step, the same for every rank (the scheduler output as plain data)."""
    step: int
    new_reqs: list[NewRequestData]
    scheduled: list[ScheduledReq]
    finished_req_ids: list[str]
    output_rank: int = 0  # the rank whose sampled tokens go back (V1's unique_reply_rank)
    gated: bool = False  # a step controller may hold the engine in this step (rank 0 forwards kernel gates)
    trace: bool = False  # ship trace events
    # structured outputs: the constrained requests (in the mask's row order) and their grammar bitmask
    # (int32 words, raw bytes); rank 0 applies it before sampling
    structured_output_request_ids: list[str] = []
    grammar_bitmask: bytes | None = None
    admitted: list[str] = []  # new or resumed after a preemption this step (a draft model recomputes them)


class WorkerReply(msgspec.Struct, array_like=True, gc=False):
    rank: int
    kind: str  # ready | kv | warm | step | gate | rerun | error
    data: object = None
    events: list[tuple] = []  # (layer, name, kind, request_id, step, attrs, perf_counter_ns)


@dataclass
class CachedRequestState:
    """A worker's view of a live request (V1's name): what prepare_inputs and the sampler read."""
    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    eos_token_id: int | None
    sampling_seed: int  # the request's seed: every rank draws the same tokens
    block_ids: list[int] = field(default_factory=list)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]


def step_digest(step: WorkerStep) -> str:
    """A short hash of a step's scheduled work: equal on every rank that received the same."""
    h = hashlib.blake2b(digest_size=6)
    for s in step.scheduled:
        h.update(f"{s.request_id}:{s.num_computed_before}:{s.num_tokens}:{s.block_ids}".encode())
    return h.hexdigest()


class Worker:
    """One rank (see the module docstring).

    load_model() builds this rank's shard and returns what it holds; determine_num_blocks() how
    many KV blocks its budget allows; initialize_kv_cache(n) allocates them; execute_model(sched)
    runs one step (a SchedulerOutput of Requests, or of CachedRequestStates on a worker
    process) and returns the sampled tokens (the same on every rank). Hooks: those of the model
    runner (kernel launches carry this rank)."""

    def __init__(self, config, model_path, model_config: ModelArchConfig, device: torch.device, dtype: torch.dtype,
                 attention_backend: str, tp: TPGroup | None = None, hooks: Hooks | None = None):
        self.config, self.model_path, self.model_config = config, model_path, model_config
        self.device, self.dtype, self.attention_backend = device, dtype, attention_backend
        self.tp = tp or TPGroup()
        self.hooks = hooks or Hooks()
        self.model = None  # the architecture's model class (models/registry.py), this rank's shard
        self.kv_caches: list | None = None
        self.model_runner: ModelRunner | None = None
        # speculative decoding with a draft model (rank 0 only: see engine/spec_decode/draft_model.py)
        spec = config.speculative
        self.draft_path, self.draft_config = None, None
        if spec is not None and spec.method == "draft_model" and self.rank == 0:
            self.draft_path = model_loader.resolve(spec.model)
            self.draft_config = model_loader.read_config(self.draft_path)
        self.draft_model = None
        self.requests: dict[str, CachedRequestState] = {}  # worker processes only

    @property
    def rank(self) -> int:
        return self.tp.rank

    def load_model(self, progress=None) -> dict:
        torch.manual_seed(self.config.model.seed)
        backend = AttentionBackend(self.attention_backend)
        self.model = model_class(self.model_config.architecture)(self.model_config, backend, self.tp)
        self.model.load_hf_weights(load_state_dict(self.model_path, progress))
        self.model.to(device=self.device, dtype=self.dtype).eval()
        params = list(self.model.parameters()) + list(self.model.buffers())
        cfg, tp = self.model_config, self.tp
        embed = self.model.wte if hasattr(self.model, "wte") else self.model.model.embed_tokens  # GPT-2's, Llama's
        info = dict(bytes=sum(p.numel() * p.element_size() for p in params),
                    params=sum(p.numel() for p in self.model.parameters()), model_params=self._model_params(backend),
                    heads=list(tp.shard(cfg.num_heads)), kv_heads=list(tp.shard(cfg.num_kv_heads)),
                    mlp=list(tp.shard(cfg.intermediate_size)), vocab=list(embed.shard_range),
                    vocab_padded=embed.num_embeddings_padded, torch_threads=torch.get_num_threads())
        if self.draft_path is not None:  # unsharded, on this rank alone
            self.draft_model = model_class(self.draft_config.architecture)(self.draft_config, backend, TPGroup())
            self.draft_model.load_hf_weights(load_state_dict(self.draft_path))
            self.draft_model.to(device=self.device, dtype=self.dtype).eval()
            info["draft_params"] = sum(p.numel() for p in self.draft_model.parameters())
        return info

    def _model_params(self, backend) -> int:
        """The whole model's parameter count: the ranks' shards add up to more (norms, position
        embeddings and row-parallel biases are on every rank), so it is counted on a model
        built unsharded on the meta device (no memory)."""
        if self.tp.world_size == 1:
            return sum(p.numel() for p in self.model.parameters())
        with torch.device("meta"):
            whole = model_class(self.model_config.architecture)(self.model_config, backend, TPGroup())
        return sum(p.numel() for p in whole.parameters())

    def determine_num_blocks(self) -> tuple[int, str]:
        draft = self.draft_config if self.draft_model is not None else None  # its blocks share the budget
        return num_blocks_for(self.config.cache, self.model_config, self.dtype, self.device, self.tp.world_size,
                              draft)

    def initialize_kv_cache(self, num_blocks: int) -> dict:
        cc, cfg, n = self.config.cache, self.model_config, self.tp.world_size
        self.kv_caches = allocate_kv_cache(num_blocks, cc.block_size, cfg, self.dtype, self.device, n)
        self.model_runner = ModelRunner(self.model, self.kv_caches, cc.block_size, self.device, self.hooks,
                                        rank=self.rank, profiler_dir=self.config.profiler_dir)
        if self.draft_model is not None:  # the same blocks, in a cache of the draft's own layers and heads
            draft_caches = allocate_kv_cache(num_blocks, cc.block_size, self.draft_config, self.dtype, self.device)
            self.model_runner.drafter = DraftModelProposer(
                self.draft_model, draft_caches, cc.block_size, self.device,
                self.config.speculative.num_speculative_tokens,
                self.config.model.max_model_len or self.model_config.max_position_embeddings)
        per_block = bytes_per_block(cfg, cc.block_size, self.dtype, n)
        info = dict(num_blocks=num_blocks, block_size=cc.block_size, bytes=num_blocks * per_block,
                    bytes_per_block=per_block, heads=list(self.tp.shard(cfg.num_heads)),
                    kv_heads=list(self.tp.shard(cfg.num_kv_heads)), num_heads=cfg.num_heads,
                    num_kv_heads=cfg.num_kv_heads, head_size=cfg.head_size, num_layers=cfg.num_layers)
        if self.draft_model is not None:
            info["draft_bytes"] = num_blocks * bytes_per_block(self.draft_config, cc.block_size, self.dtype)
        return info

    def execute_model(self, sched: SchedulerOutput) -> SamplerOutput:
        return self.model_runner.execute(sched)

    def warm_up(self, max_model_len: int) -> dict:
        return self.model_runner.warm_up(max_model_len)

    def profile(self, is_start: bool = True) -> dict:
        """Start or stop profiling every op of this rank's forward passes (vLLM's Worker.profile)."""
        return self.model_runner.profile(is_start)

    # ---- on a worker process: the wire form of a step ------------------------------------------
    def _trace_execute(self, msg: WorkerStep) -> None:
        self.hooks.emit(WORKER, EXECUTE_MODEL, step=msg.step, rank=self.rank,
                        num_scheduled_tokens={s.request_id: s.num_tokens for s in msg.scheduled},
                        total_num_scheduled_tokens=sum(s.num_tokens for s in msg.scheduled),
                        finished_req_ids=sorted(msg.finished_req_ids), digest=step_digest(msg))

    def execute_step(self, msg: WorkerStep) -> SamplerOutput | None:
        """Update the cached request states from msg, then run the step."""
        for rid in msg.finished_req_ids:
            self.requests.pop(rid, None)
        for new in msg.new_reqs:
            params = SamplingParams(**new.sampling_params)
            self.requests[new.request_id] = CachedRequestState(
                new.request_id, list(new.token_ids), new.num_prompt_tokens, params, new.eos_token_id, new.seed)
        sched = SchedulerOutput(step=msg.step, admitted=msg.admitted, finished_req_ids=set(msg.finished_req_ids))
        if msg.grammar_bitmask is not None:
            # a request's rows: one per position it scores (1 + its drafts)
            num_drafts = {s.request_id: len(s.spec_token_ids) for s in msg.scheduled}
            row = 0
            for rid in msg.structured_output_request_ids:
                sched.structured_output_request_ids[rid] = row
                row += 1 + num_drafts[rid]
            sched.grammar_bitmask = np.frombuffer(bytearray(msg.grammar_bitmask), np.int32).reshape(row, -1)
        for s in msg.scheduled:
            state = self.requests[s.request_id]
            state.all_token_ids += s.new_token_ids
            state.block_ids = s.block_ids
            remaining = len(state.all_token_ids) - s.num_computed_before
            is_prefill = remaining > 1 or not state.output_token_ids
            sched.scheduled.append(ScheduledRequest(state, s.num_tokens, s.num_computed_before, is_prefill,
                                                    s.spec_token_ids))
        self.tp.active = "stepping" if msg.gated else "fast"
        if self.hooks.active:
            self._trace_execute(msg)
        return self.execute_model(sched) if sched.scheduled else None
