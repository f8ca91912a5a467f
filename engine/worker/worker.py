"""A worker: one tensor-parallel rank's model shard, KV-cache shard and model runner (vLLM V1's
``Worker`` / ``GPUModelRunner`` pair).

With one rank the ``UniProcExecutor`` holds a Worker in the engine-core process and hands it the
scheduler's own ``SchedulerOutput``. With N ranks each Worker lives in its own process
(``engine.executor.worker_proc``, started by ``MultiprocExecutor``) and receives the same object,
msgpack-encoded once for all ranks (``ExecuteModel``), then the step's grammar bitmask
(``SampleTokens``). Either way its model runner keeps every live request's state by slot
(engine/worker/states.py) and runs the same forward pass over its shard; the all-reduces and the
logits all-gather inside the model tie the ranks together. Every rank then samples, as in V1:
the same logits and the same seeds give the same tokens; the executor keeps rank 0's.
"""
from __future__ import annotations

import hashlib

import msgspec
import torch

from engine.core.kv_cache_utils import allocate_kv_cache, bytes_per_block, kv_cache_groups_of, num_blocks_for
from engine.core.sched.output import GrammarOutput, SchedulerOutput
from engine.distributed.parallel_state import TPGroup
from engine.hooks import Hooks
from engine.model_executor import model_loader
from engine.model_executor.layers.attention import AttentionBackend
from engine.model_executor.layers.fused_moe.layer import moe_layers
from engine.model_executor.model_loader import ModelArchConfig, load_state_dict
from engine.model_executor.models.registry import model_class
from engine.outputs import DraftTokenIds, ModelRunnerOutput
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.ngram_proposer import NgramProposer
from engine.trace_names import EXECUTE_MODEL, WORKER
from engine.worker.model_runner import ModelRunner


# ---- what the executor sends each worker ------------------------------------------------------
class ExecuteModel(msgspec.Struct, array_like=True, gc=False):
    """One step's scheduler output for every rank, and how to run it."""
    scheduler_output: SchedulerOutput
    output_rank: int = 0  # the rank whose model output goes back (V1's unique_reply_rank)
    gated: bool = False  # a step controller may hold the engine in this step (rank 0 forwards kernel gates)
    trace: bool = False  # ship trace events


class SampleTokens(msgspec.Struct, array_like=True, gc=False):
    """The step's grammar bitmask, if any: the constrained requests and their rows (int32 words, raw bytes)."""
    structured_output_request_ids: list[str] = []
    grammar_bitmask: bytes | None = None
    num_rows: int = 0
    output_rank: int = 0
    trace: bool = False
    num_acceptable_drafts: list[int] | None = None  # per constrained request (GrammarOutput's)


class WorkerReply(msgspec.Struct, array_like=True, gc=False):
    rank: int
    kind: str  # ready | kv | warm | step | sample | gate | rerun | error
    data: object = None
    events: list[tuple] = []  # (layer, name, kind, request_id, step, attrs, perf_counter_ns)


def step_digest(sched: SchedulerOutput) -> str:
    """A short hash of a step's scheduled work: equal on every rank that received the same."""
    h = hashlib.blake2b(digest_size=6)
    starts = sched.num_computed_before()
    for rid, n in sched.num_scheduled_tokens.items():
        h.update(f"{rid}:{starts[rid]}:{n}".encode())
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

    @property
    def rank(self) -> int:
        return self.tp.rank

    def load_model(self, progress=None) -> dict:
        torch.manual_seed(self.config.model.seed)
        backend = AttentionBackend(self.attention_backend)
        self.tp.enable_expert_parallel = self.config.parallel.enable_expert_parallel
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
        moe = moe_layers(self.model)
        if moe:  # a mixture of experts: [first, end) of the experts this rank holds, and how it holds them
            experts = moe[0][1]
            info["experts"] = [experts.expert_start, experts.expert_start + experts.local_num_experts]
            info["expert_parallel"] = experts.ep_size > 1
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
        max_model_len = self.config.model.max_model_len or self.model_config.max_position_embeddings
        self.model_runner = ModelRunner(self.model, self.kv_caches, cc.block_size, self.device, self.hooks,
                                        rank=self.rank, profiler_dir=self.config.profiler_dir,
                                        max_num_reqs=self.config.scheduler.max_num_seqs, max_model_len=max_model_len)
        spec = self.config.speculative
        if spec is not None and spec.method == "ngram" and self.rank == 0:  # output_rank's drafts are the ones used
            self.model_runner.drafter = NgramProposer(spec)
        if self.draft_model is not None:  # the same blocks, in a cache of the draft's own layers and heads
            draft_caches = allocate_kv_cache(num_blocks, cc.block_size, self.draft_config, self.dtype, self.device)
            self.model_runner.drafter = DraftModelProposer(
                self.draft_model, draft_caches, cc.block_size, self.device,
                self.config.speculative.num_speculative_tokens,
                self.config.model.max_model_len or self.model_config.max_position_embeddings)
        if self.config.kv_transfer_config is not None:
            self.model_runner.kv_connector = self._make_kv_connector()
        per_block = bytes_per_block(cfg, cc.block_size, self.dtype, n)
        info = dict(num_blocks=num_blocks, block_size=cc.block_size, bytes=num_blocks * per_block,
                    bytes_per_block=per_block, heads=list(self.tp.shard(cfg.num_heads)),
                    kv_heads=list(self.tp.shard(cfg.num_kv_heads)), num_heads=cfg.num_heads,
                    num_kv_heads=cfg.num_kv_heads, head_size=cfg.head_size, num_layers=cfg.num_layers)
        if self.draft_model is not None:
            info["draft_bytes"] = num_blocks * bytes_per_block(self.draft_config, cc.block_size, self.dtype)
        groups = kv_cache_groups_of(cfg, cc.block_size)
        if len(groups) > 1 or groups[0].kv_cache_spec.sliding_window:  # the layers' KV-cache groups, and windows
            info["kv_cache_groups"] = [dict(layers=g.layer_ids, sliding_window=g.kv_cache_spec.sliding_window)
                                       for g in groups]
        return info

    def _make_kv_connector(self):
        """The KV connector's worker side (engine/distributed/kv_transfer), given this rank's caches."""
        from engine.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from engine.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        connector = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER)
        connector.hooks = self.hooks
        connector.register_kv_caches({f"model.layers.{i}": kv for i, kv in enumerate(self.kv_caches)})
        return connector

    def shutdown(self) -> None:
        if self.model_runner is not None and self.model_runner.kv_connector is not None:
            self.model_runner.kv_connector.shutdown()

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        if self.hooks.active and self.tp.world_size > 1:
            self._trace_execute(scheduler_output)
        self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput | None:
        return self.model_runner.sample_tokens(grammar_output)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        return self.model_runner.take_draft_token_ids()

    def warm_up(self, max_model_len: int) -> dict:
        return self.model_runner.warm_up(max_model_len)

    def profile(self, is_start: bool = True) -> dict:
        """Start or stop profiling every op of this rank's forward passes (vLLM's Worker.profile)."""
        return self.model_runner.profile(is_start)

    def _trace_execute(self, sched: SchedulerOutput) -> None:
        self.hooks.emit(WORKER, EXECUTE_MODEL, step=sched.step, rank=self.rank,
                        num_scheduled_tokens=sched.num_scheduled_tokens,
                        total_num_scheduled_tokens=sched.total_num_scheduled_tokens,
                        finished_req_ids=sorted(sched.finished_req_ids), digest=step_digest(sched))
