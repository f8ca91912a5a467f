"""benchmarks/serving.py's variants and table, without a client run: `ours-async` is our server with async
scheduling on (off by default on a CPU), `ours-no-trace` without its tracer, and the ratio column divides by
the reference server's median."""
import json

import pytest

from benchmarks.parity.servers import command
from benchmarks.serving import EXTRA_ARGS, VARIANTS, checkpoint_dir, num_prompts, table
from benchmarks.workload import gpt2_shaped_config
from engine import builtin_model


def test_the_async_variant_serves_with_async_scheduling_on():
    kind, env = VARIANTS["ours-async"]
    cmd = command(kind, "/bin", "tiny-gpt2", 8000, "chat.jinja", EXTRA_ARGS["ours-async"])
    assert cmd[0].endswith("vllm-trace") and "--async-scheduling" in cmd and not env
    assert "--async-scheduling" not in command(*VARIANTS["ours"][:1], "/bin", "tiny-gpt2", 8000, "chat.jinja")


def test_the_no_trace_variant_serves_without_a_tracer():
    kind, env = VARIANTS["ours-no-trace"]
    cmd = command(kind, "/bin", "tiny-gpt2", 8000, "chat.jinja", EXTRA_ARGS["ours-no-trace"])
    assert cmd[0].endswith("vllm-trace") and "--no-trace" in cmd and not env
    assert "--no-trace" not in command(*VARIANTS["ours"][:1], "/bin", "tiny-gpt2", 8000, "chat.jinja")


def test_the_ratio_column_divides_by_the_reference():
    def row(tps):
        return {"output_throughput": tps, "mean_ttft_ms": 10.0, "mean_tpot_ms": 2.0, "completed": 128,
                "cpu_ms_per_token": {"API server": 1.0}}

    results = {"ours": {64: [row(110.0), row(120.0), row(130.0)]}, "ours-async": {64: [row(100.0)] * 3}}
    lines = table(results, "ours-async").splitlines()
    assert "÷ ours-async" in lines[0]
    assert lines[2].startswith("| 64 | ours | 120 | 110 / 120 / 130 | 1.20 |")
    assert lines[3].startswith("| 64 | ours-async | 100 |") and "| 1.00 |" in lines[3]


def test_a_run_sends_its_prompts_per_stream_and_sixteen_at_least():
    assert [num_prompts(c) for c in (1, 8, 32, 64)] == [16, 16, 64, 128]  # two waves (the default)
    assert [num_prompts(c, 8) for c in (1, 8, 32, 64)] == [16, 64, 256, 512]


def test_the_gpt2_shaped_checkpoint_reads_every_token_its_tokenizer_writes():
    """Served text goes through the checkpoint's tokenizer (tiny-gpt2's): its vocabulary must cover it."""
    tokenizer = json.loads((builtin_model.builtin_path() / "tokenizer.json").read_text())
    ids = list(tokenizer["model"]["vocab"].values()) + [t["id"] for t in tokenizer.get("added_tokens", [])]
    config = gpt2_shaped_config()
    assert max(ids) < config.vocab_size and (config.n_layer, config.n_embd) == (12, 768)


def test_a_model_that_is_no_checkpoint_is_refused_in_one_line_before_any_server_starts(tmp_path):
    with pytest.raises(SystemExit) as e:
        checkpoint_dir(str(tmp_path / "nowhere"))
    assert "no checkpoint there" in str(e.value) and "\n" not in str(e.value)
    tiny = str(builtin_model.builtin_path())
    assert checkpoint_dir(tiny) == tiny
