"""EngineArgs: every engine setting once, with its default and its help (vLLM's ``engine/arg_utils.py``).

    EngineArgs.add_cli_args(parser)   the flags of `serve`, `generate`, `bench` and `lesson` (vLLM's names)
    EngineArgs.from_cli_args(args)    back from the parsed flags
    LLM(model, **kwargs)              the same names as keyword arguments
    create_engine_config()            the validated configs (a bad value: ConfigError, one line)

A field's flag is its name with dashes (``--max-num-seqs``); ``flag`` in its metadata overrides
that where vLLM's flag differs from the keyword (``--distributed-timeout``).
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field, fields

from engine.config import (
    ALL2ALL_BACKENDS,
    ATTENTION_BACKENDS,
    DEFAULT_CPU_KV_CACHE_MEMORY,
    DTYPES,
    EXECUTOR_BACKENDS,
    SCHEDULING_POLICIES,
    CacheConfig,
    ConfigError,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

ENGINE_GROUP = ("engine", "model, KV cache and scheduler (vLLM's flag names)")
SPEC_GROUP = ("speculative decoding", "propose tokens cheaply, verify them in one pass of the model "
              "(see lessons/ on speculative decoding)")
PROFILE_GROUP = ("profiling", "POST /start_profile and /stop_profile, or LLM.start_profile() / stop_profile(): "
                 "every op of the forward pass a kernel launch, with its FLOPs and bytes")
KV_GROUP = ("KV transfer", "move KV caches between instances: disaggregated prefill and decode "
            "(vllm-trace proxy), a shared-storage KV cache")
TP_GROUP = ("tensor parallelism", "split every layer over N worker processes (gloo on the CPU, NCCL on CUDA); "
            "see lessons/18_tensor_parallelism.py")


def _json_object(value, name: str = "speculative_config") -> dict:
    """A dict, or JSON text of one (the CLI's --speculative-config, --kv-transfer-config)."""
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{name} must be a JSON object: {e}") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"{name} must be a JSON object, got {value!r}")
    return parsed


def _json_arg(text: str, name: str = "speculative_config") -> dict:
    try:
        return _json_object(text, name)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _kv_json_arg(text: str) -> dict:
    return _json_arg(text, "kv_transfer_config")


def _arg(default, help: str, group: tuple[str, str] = ENGINE_GROUP, **cli) -> object:
    return field(default=default, metadata={"help": help, "group": group, "cli": cli})


@dataclass
class EngineArgs:
    model: str = _arg(ModelConfig.model, "a built-in model name, a local checkpoint directory or a Hugging Face id",
                      positional=True)
    block_size: int = _arg(CacheConfig.block_size, "tokens per KV-cache block (a power of two)")
    num_kv_blocks: int | None = _arg(CacheConfig.num_kv_blocks,
                                     "exact number of KV-cache blocks (overrides --kv-cache-memory)")
    kv_cache_memory: int | None = _arg(CacheConfig.kv_cache_memory, "bytes for the KV cache (default on a CPU: "
                                       f"{DEFAULT_CPU_KV_CACHE_MEMORY >> 20} MiB)")
    gpu_memory_utilization: float = _arg(CacheConfig.gpu_memory_utilization,
                                         "CUDA: fraction of device memory the process may use")
    max_num_seqs: int = _arg(SchedulerConfig.max_num_seqs, "most requests running at once")
    max_num_batched_tokens: int = _arg(SchedulerConfig.max_num_batched_tokens, "token budget of one step")
    max_model_len: int | None = _arg(ModelConfig.max_model_len, "context length limit (default: the model's)")
    enable_prefix_caching: bool = _arg(CacheConfig.enable_prefix_caching, "reuse KV blocks of shared prompt prefixes")
    enable_chunked_prefill: bool = _arg(SchedulerConfig.enable_chunked_prefill, "split long prompts across steps")
    scheduling_policy: str = _arg(SchedulerConfig.policy, "fcfs: first come, first served; priority: each "
                                  "request's priority (lower first, ties by arrival), and preemption takes the "
                                  "lowest priority", choices=SCHEDULING_POLICIES)
    async_scheduling: bool | None = _arg(SchedulerConfig.async_scheduling, "schedule step N+1 while step N's "
                                         "forward pass runs (two batches in flight; default: on with CUDA, off "
                                         "on a CPU, as vLLM)")
    attention_backend: str | None = _arg(EngineConfig.attention_backend, "kernels: triton (ours), torch (their "
                                         "PyTorch references) or cpu (C kernels for decode attention and "
                                         "sampling; default: triton on CUDA, cpu on a CPU, torch there without "
                                         "a C compiler or for a 16-bit dtype)", choices=ATTENTION_BACKENDS)
    dtype: str | None = _arg(ModelConfig.dtype, "weights and KV cache (default: float32 on CPU; on CUDA float16, "
                             "or bfloat16 for a bfloat16 checkpoint)", choices=DTYPES)
    device: str | None = _arg(ModelConfig.device, "cpu or cuda (default: cuda if available)")
    seed: int = _arg(ModelConfig.seed, "engine seed for unseeded sampling")
    tensor_parallel_size: int = _arg(ParallelConfig.tensor_parallel_size,
                                     "ranks, one worker process each; must divide the model's attention heads "
                                     "(1: no workers, the model runs in the engine core)", TP_GROUP,
                                     aliases=("-tp",), metavar="N")
    cpu_threads: int | None = _arg(ParallelConfig.cpu_threads,
                                   "CPU: torch threads of the engine core (of each rank under tensor "
                                   "parallelism). Default: serving keeps one core per rank for the API server, as "
                                   "vLLM's CPU build does (VLLM_CPU_NUM_OF_RESERVED_CPU); "
                                   "VLLM_CPU_OMP_THREADS_BIND=auto|0-3|4-7 also pins each rank to its cores; "
                                   "the offline LLM uses every core; OMP_NUM_THREADS also sets it",
                                   metavar="N")
    distributed_executor_backend: str | None = _arg(ParallelConfig.distributed_executor_backend,
                                                    "uni: the model runs in the engine core (one rank); mp: in "
                                                    "worker processes, one per rank, so scheduling and the forward "
                                                    "pass use separate cores (default: uni for one rank, mp for more)",
                                                    TP_GROUP, choices=EXECUTOR_BACKENDS)
    distributed_init_method: str | None = _arg(ParallelConfig.distributed_init_method,
                                               "where the ranks meet: tcp://HOST:PORT, or env:// with "
                                               "MASTER_ADDR and MASTER_PORT set (default: a free loopback port)",
                                               TP_GROUP, metavar="URL")
    speculative_config: dict | None = _arg(EngineConfig.speculative,
                                           "speculative decoding, as JSON: e.g. '{\"method\": \"ngram\", "
                                           "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4, "
                                           "\"prompt_lookup_min\": 3}' or '{\"method\": \"draft_model\", \"model\": "
                                           "\"tiny-gpt2-draft\", \"num_speculative_tokens\": 3}' (default: off)",
                                           SPEC_GROUP,
                                           type=_json_arg, metavar="JSON")
    enable_expert_parallel: bool = _arg(ParallelConfig.enable_expert_parallel,
                                        "mixtures of experts: each rank holds E/N whole experts (instead of 1/N "
                                        "of every expert), tokens exchanged by --all2all-backend", TP_GROUP)
    all2all_backend: str = _arg(ParallelConfig.all2all_backend, "how expert parallelism exchanges tokens",
                                TP_GROUP, choices=ALL2ALL_BACKENDS)
    distributed_timeout_s: float = _arg(ParallelConfig.distributed_timeout_s,
                                        "seconds a collective waits for a missing rank before the step "
                                        "fails (torch's own timeout is 30 minutes)", TP_GROUP,
                                        flag="--distributed-timeout", metavar="S")
    profiler_dir: str | None = _arg(EngineConfig.profiler_dir,
                                    "also capture the profiled window with torch.profiler, one Chrome-trace "
                                    "JSON file per rank in DIR (Perfetto opens them; default: "
                                    "$VLLM_TORCH_PROFILER_DIR, else none)", PROFILE_GROUP, metavar="DIR")
    kv_offloading_size: float | None = _arg(CacheConfig.kv_offloading_size,
                                            "GiB of host memory behind the KV cache: blocks the device evicts are "
                                            "loaded back from there on a prefix hit (OffloadingConnector)",
                                            KV_GROUP, metavar="GiB")
    kv_transfer_config: dict | None = _arg(EngineConfig.kv_transfer_config,
                                           "a KV connector, as JSON with vLLM's keys: e.g. '{\"kv_connector\": "
                                           "\"ExampleConnector\", \"kv_role\": \"kv_both\", "
                                           "\"kv_connector_extra_config\": {\"shared_storage_path\": \"/tmp/kv\"}}' "
                                           "(default: off)", KV_GROUP, type=_kv_json_arg, metavar="JSON")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, model: bool = False) -> argparse.ArgumentParser:
        """Add a flag per field (model too, as a positional argument, if `model`)."""
        groups: dict[tuple[str, str], argparse._ArgumentGroup] = {}
        for f in fields(EngineArgs):
            cli = dict(f.metadata["cli"])
            if cli.pop("positional", False):
                if model:
                    parser.add_argument(f.name, nargs="?", default=f.default, help=f.metadata["help"] +
                                        f" (default: {f.default})")
                continue
            group = groups.get(f.metadata["group"]) or groups.setdefault(
                f.metadata["group"], parser.add_argument_group(*f.metadata["group"]))
            flag, aliases = cli.pop("flag", "--" + f.name.replace("_", "-")), cli.pop("aliases", ())
            help = f.metadata["help"]
            if f.type in ("bool", "bool | None"):  # None: the help says what decides
                default = "" if f.default is None else f" (default: {'on' if f.default else 'off'})"
                group.add_argument(flag, *aliases, dest=f.name, action=argparse.BooleanOptionalAction,
                                   default=f.default, help=help + default)
            else:
                if "(default" not in help and f.default is not None:
                    help += f" (default: {f.default})"
                kind = cli.pop("type", None) or _TYPES[f.type]
                group.add_argument(flag, *aliases, dest=f.name, type=kind, default=f.default, help=help, **cli)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def create_engine_config(self) -> EngineConfig:
        """The validated EngineConfig (a bad value raises ConfigError naming it)."""
        return EngineConfig(
            model=ModelConfig(model=self.model, dtype=self.dtype, device=self.device, max_model_len=self.max_model_len,
                              seed=self.seed),
            cache=CacheConfig(block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
                              kv_cache_memory=self.kv_cache_memory, gpu_memory_utilization=self.gpu_memory_utilization,
                              enable_prefix_caching=self.enable_prefix_caching,
                              kv_offloading_size=self.kv_offloading_size),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=self.max_num_batched_tokens,
                                      enable_chunked_prefill=self.enable_chunked_prefill,
                                      policy=self.scheduling_policy, async_scheduling=self.async_scheduling),
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                    distributed_executor_backend=self.distributed_executor_backend,
                                    distributed_init_method=self.distributed_init_method,
                                    distributed_timeout_s=self.distributed_timeout_s,
                                    cpu_threads=self.cpu_threads, enable_expert_parallel=self.enable_expert_parallel,
                                    all2all_backend=self.all2all_backend),
            attention_backend=self.attention_backend,
            speculative=SpeculativeConfig.from_dict(_json_object(self.speculative_config))
            if self.speculative_config else None,
            profiler_dir=self.profiler_dir or os.environ.get("VLLM_TORCH_PROFILER_DIR") or None,
            kv_transfer_config=self._kv_transfer(),
        )

    def _kv_transfer(self) -> KVTransferConfig | None:
        """--kv-transfer-config, or with --kv-offloading-size the OffloadingConnector (vLLM's)."""
        if self.kv_offloading_size is not None:
            if self.kv_transfer_config:
                raise ConfigError("set kv_offloading_size or kv_transfer_config, not both")
            return KVTransferConfig("OffloadingConnector", "kv_both",
                                    {"cpu_bytes": int(self.kv_offloading_size * 2 ** 30)})
        if self.kv_transfer_config:
            return KVTransferConfig.from_dict(_json_object(self.kv_transfer_config, "kv_transfer_config"))
        return None


_TYPES = {"int": int, "int | None": int, "float": float, "float | None": float, "str": str, "str | None": str}


def engine_config(model: str = EngineArgs.model, **kwargs) -> EngineConfig:
    """The EngineConfig for LLM's keyword arguments (validated: a bad value raises ConfigError)."""
    unknown = set(kwargs) - {f.name for f in fields(EngineArgs)}
    if unknown:
        raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
    return EngineArgs(model=model, **kwargs).create_engine_config()
