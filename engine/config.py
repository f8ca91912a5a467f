"""Engine configuration as dataclasses, validated on construction with messages that name
the parameter and its allowed range. Each setting's default is written here once; ``EngineArgs``
(``engine/arg_utils.py``: the CLI flags and ``LLM``'s keywords) refers to it, as vLLM's does."""
from __future__ import annotations

import os
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A configuration value is out of range."""


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


ATTENTION_BACKENDS = ("torch", "triton", "cpu")
DTYPES = ("float32", "float16", "bfloat16")
DEFAULT_CPU_KV_CACHE_MEMORY = 256 * 1024 * 1024  # bytes: CacheConfig.kv_cache_memory when unset on a CPU


@dataclass
class ModelConfig:
    model: str = "tiny-gpt2"
    dtype: str | None = None  # None: float32 on CPU; float16 on CUDA (bfloat16 for a bf16 checkpoint)
    device: str | None = None  # None: cuda if available else cpu
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    seed: int = 0

    def __post_init__(self) -> None:
        _check(isinstance(self.model, str) and self.model != "", "model must be a non-empty name or path")
        _check(self.dtype is None or self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _check(self.max_model_len is None or self.max_model_len >= 1,
               f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # exact number of blocks; overrides the memory budget
    kv_cache_memory: int | None = None  # bytes for K and V of all layers (None: DEFAULT_CPU_KV_CACHE_MEMORY on a CPU)
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory the process may use
    enable_prefix_caching: bool = True
    kv_offloading_size: float | None = None  # GiB of host memory behind the KV cache (OffloadingConnector)

    def __post_init__(self) -> None:
        _check(isinstance(self.block_size, int) and self.block_size >= 1 and
               self.block_size & (self.block_size - 1) == 0,
               f"block_size must be a power of two >= 1, got {self.block_size}")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 2,
               f"num_kv_blocks must be >= 2 (block 0 is the null block), got {self.num_kv_blocks}")
        _check(self.kv_cache_memory is None or self.kv_cache_memory > 0,
               f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        _check(self.kv_offloading_size is None or self.kv_offloading_size > 0,
               f"kv_offloading_size must be > 0 GiB, got {self.kv_offloading_size}")
        _check(0.0 < self.gpu_memory_utilization <= 1.0,
               f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # "priority": lowest priority value first, ties by arrival (vLLM V1)
    # schedule step N+1 while step N's forward pass runs (AsyncScheduler, EngineCore.step_with_batch_queue).
    # None: on with CUDA, off on a CPU, as vLLM 0.33 resolves it (default_async_scheduling), once the device
    # is known: here if ModelConfig.device is set, else by the EngineCore (the API server never imports torch)
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        _check(self.policy in SCHEDULING_POLICIES,
               f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _check(self.max_num_batched_tokens >= 1,
               f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


EXECUTOR_BACKENDS = ("uni", "mp")
ALL2ALL_BACKENDS = ("allgather_reducescatter",)  # vLLM's default (engine/distributed/all2all.py)


@dataclass
class ParallelConfig:
    """Tensor parallelism (vLLM's names). tensor_parallel_size ranks, each a worker process with
    its own shard of every layer (``distributed_executor_backend="mp"``); 1 keeps the model
    runner in the engine-core process ("uni"). distributed_init_method: where the ranks meet
    (default: a free loopback port, tcp://127.0.0.1:PORT); distributed_timeout_s: how long a
    collective waits for a missing rank before it fails (torch's default is 30 minutes). On the CPU
    each rank's threads and cores follow engine.cpu_threads: cpu_threads overrides its thread count;
    api_process_count (vLLM's ``_api_process_count``) is the API servers sharing the machine, set by
    AsyncLLM: > 0 keeps cores for them."""
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: "uni" for one rank, "mp" for more
    distributed_init_method: str | None = None
    distributed_timeout_s: float = 30.0
    cpu_threads: int | None = None
    api_process_count: int = 0
    # a mixture of experts' layers: E/N whole experts per rank instead of 1/N of each, tokens
    # exchanged by all2all_backend (engine/distributed/all2all.py)
    enable_expert_parallel: bool = False
    all2all_backend: str = "allgather_reducescatter"

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        _check(self.all2all_backend in ALL2ALL_BACKENDS,
               f"all2all_backend must be one of {ALL2ALL_BACKENDS}, got {self.all2all_backend!r}")
        _check(isinstance(tp, int) and tp >= 1, f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        _check(self.distributed_executor_backend in (None, *EXECUTOR_BACKENDS),
               f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
               f"got {self.distributed_executor_backend!r}")
        _check(not (tp > 1 and self.distributed_executor_backend == "uni"),
               f"distributed_executor_backend='uni' runs one rank; tensor_parallel_size={tp} needs 'mp'")
        _check(self.distributed_timeout_s > 0, f"distributed_timeout_s must be > 0, got {self.distributed_timeout_s}")
        _check(self.cpu_threads is None or isinstance(self.cpu_threads, int) and self.cpu_threads >= 1,
               f"cpu_threads must be an integer >= 1, got {self.cpu_threads!r}")
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if tp == 1 else "mp"


SPEC_METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config``): each step a proposer drafts up to
    num_speculative_tokens tokens per request, and the target model verifies them in the next step.
    ngram: prompt lookup over the request's own tokens, the longest matching suffix of
    prompt_lookup_max down to prompt_lookup_min tokens. draft_model: a smaller model with the
    target's tokenizer (``model``: a built-in name such as tiny-gpt2-draft, or a checkpoint
    directory) proposes greedily, one token per forward pass.

    The lookup defaults (3 to 4 tokens; vLLM's, which it calls untuned, are 5 to 5) are the best
    measured with ``python -m benchmarks.spec_decode --prompt-lookup-min M --prompt-lookup-max N``
    on tiny-gpt2's greedy loops and on sampled text that rarely repeats (speed-up over no
    speculation, one run each): 1 to 4 tokens 1.22x and 0.54x, 2 to 4 tokens 1.27-1.40x and
    0.86-0.92x, 3 to 4 tokens 1.36x and 0.95x, 5 to 5 tokens 1.19x and 0.98x. Short matches in
    text that does not repeat propose drafts that are mostly rejected, and each costs a verified
    row; long ones wait longer before a loop is recognised."""
    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 3
    model: str | None = None  # draft_model: the draft checkpoint

    def __post_init__(self) -> None:
        _check(self.method in SPEC_METHODS, f"speculative_config method must be one of {SPEC_METHODS}, "
                                            f"got {self.method!r}")
        _check(isinstance(self.num_speculative_tokens, int) and 1 <= self.num_speculative_tokens <= 16,
               f"num_speculative_tokens must be an integer in [1, 16], got {self.num_speculative_tokens!r}")
        _check(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
               f"prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got "
               f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.method == "draft_model":
            _check(isinstance(self.model, str) and self.model != "",
                   'speculative_config method "draft_model" needs "model": a draft checkpoint with the target\'s '
                   'tokenizer, e.g. {"method": "draft_model", "model": "tiny-gpt2-draft", "num_speculative_tokens": 3}')
        else:
            _check(self.model is None, f'speculative_config "model" is for method "draft_model", not {self.method!r}')

    @classmethod
    def from_dict(cls, d: dict) -> SpeculativeConfig:
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"}
        unknown = set(d) - known
        _check(not unknown, f"speculative_config: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class KVTransferConfig:
    """KV transfer between instances (vLLM's ``kv_transfer_config``): ``kv_connector`` names a
    connector of engine/distributed/kv_transfer/kv_connector/factory.py; ``kv_role`` whether this
    instance produces KV (a prefill instance), consumes it (a decode instance) or both;
    ``kv_connector_extra_config`` the connector's own settings (e.g. ExampleConnector's
    ``shared_storage_path``)."""
    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict)
    engine_id: str | None = None  # this instance's name in kv_transfer_params (None: a random one)

    def __post_init__(self) -> None:
        from engine.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        names = KVConnectorFactory.names()
        _check(self.kv_connector in names,
               f"kv_transfer_config: unknown kv_connector {self.kv_connector!r}; known: {', '.join(names)}")
        _check(self.kv_role in KV_ROLES, f"kv_transfer_config: kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        _check(isinstance(self.kv_connector_extra_config, dict),
               "kv_transfer_config: kv_connector_extra_config must be a JSON object")
        if self.engine_id is None:
            import uuid
            self.engine_id = uuid.uuid4().hex[:12]

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default):
        return self.kv_connector_extra_config.get(key, default)

    @classmethod
    def from_dict(cls, d: dict) -> KVTransferConfig:
        known = {"kv_connector", "kv_role", "kv_connector_extra_config", "engine_id"}
        unknown = set(d) - known
        _check(not unknown, f"kv_transfer_config: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
        _check("kv_connector" in d, 'kv_transfer_config needs "kv_connector", e.g. '
                                    '{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}')
        return cls(**d)


def default_async_scheduling(device: str) -> bool:
    """Async scheduling unless told: on with CUDA, off on a CPU, as vLLM 0.33 decides it (its CPU platform's
    ``check_and_update_config``: "async scheduling is not required on CPU"). On a CPU the second batch in
    flight has no device to overlap with: the forward pass and the scheduler share the cores, and the
    executor thread's hand-offs cost (offline, tiny-gpt2, 64 prompts x 64 tokens: 9,265-9,840 output tok/s
    on against 12,702-13,301 off; benchmarks/RESULTS.md). Unlike vLLM, ``--async-scheduling`` still turns
    it on there, for the lessons that show it."""
    return device.startswith("cuda")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    attention_backend: str | None = None  # None: triton on CUDA, torch on CPU (measured faster)
    speculative: SpeculativeConfig | None = None
    profiler_dir: str | None = None  # where profiling also writes torch.profiler traces (one file per rank)
    kv_transfer_config: KVTransferConfig | None = None  # a KV connector (disaggregated prefill, shared storage)

    def __post_init__(self) -> None:
        if self.scheduler.async_scheduling is None and self.model.device is not None:
            self.scheduler.async_scheduling = default_async_scheduling(self.model.device)
        _check(self.attention_backend is None or self.attention_backend in ATTENTION_BACKENDS,
               f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.profiler_dir:  # made now, so a bad one is said at start, not after a profiled window is lost
            try:
                os.makedirs(self.profiler_dir, exist_ok=True)
                ok = os.access(self.profiler_dir, os.W_OK | os.X_OK)
            except OSError as e:
                ok, why = False, e.strerror
            else:
                why = "not writable"
            _check(ok, f"profiler_dir {self.profiler_dir!r} cannot hold torch.profiler traces ({why}): "
                       "choose a writable directory")

    def to_dict(self) -> dict:
        from dataclasses import asdict
        return asdict(self)
