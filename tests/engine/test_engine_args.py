"""Each engine setting's default is written once, in its config dataclass (engine/config.py):
EngineArgs (the CLI flags and LLM's keywords) must carry the same defaults, and --help says them."""
import argparse
from dataclasses import MISSING, fields

from engine.arg_utils import EngineArgs
from engine.config import EngineConfig

# EngineArgs' names where vLLM's flag differs from the config field's name
RENAMED = {"scheduling_policy": "policy", "speculative_config": "speculative"}


def _config_defaults() -> dict[str, object]:
    """Every config field's default, by name: EngineConfig's own and those of its nested configs."""
    out = {}
    for f in fields(EngineConfig):
        if f.default_factory is not MISSING:
            out.update({g.name: g.default for g in fields(f.default_factory())})
        else:
            out[f.name] = f.default
    return out


def test_every_engine_args_default_is_its_config_fields_default():
    config = _config_defaults()
    for f in fields(EngineArgs):
        name = RENAMED.get(f.name, f.name)
        assert name in config, f"EngineArgs.{f.name} has no config field"
        assert f.default == config[name], f"EngineArgs.{f.name} = {f.default!r}, its config field {config[name]!r}"


def test_default_engine_args_make_the_default_config(monkeypatch):
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    assert EngineArgs().create_engine_config() == EngineConfig()


def test_help_shows_the_config_defaults():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(), model=True)
    args = parser.parse_args([])
    assert EngineArgs.from_cli_args(args) == EngineArgs()
    text = " ".join(parser.format_help().split())
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "gpu_memory_utilization", "seed",
                 "tensor_parallel_size", "distributed_timeout_s"):
        assert f"(default: {getattr(EngineArgs, name)})" in text, name
