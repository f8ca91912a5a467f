import json

import pytest
from chrome_check import check_chrome_trace

from engine import LLM, Hooks, SamplingParams
from tracer.cli import main
from tracer.events import read_trace
from tracer.export import to_chrome_trace
from tracer.session import TraceSession


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("export") / "trace.jsonl"
    hooks = Hooks()
    with TraceSession(hooks, trace_file=path, control=False, model="tiny-gpt2"):
        llm = LLM("tiny-gpt2", hooks=hooks, block_size=4, num_kv_blocks=10, max_num_batched_tokens=64)
        llm.generate(["one two three four five", "six seven", "eight nine ten eleven twelve"],
                     SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    return path


def test_perfetto_export_is_structurally_valid(trace):
    chrome = to_chrome_trace(*read_trace(trace))
    assert check_chrome_trace(chrome) == []
    evs = chrome["traceEvents"]
    names = {(e["ph"], e["name"]) for e in evs}
    # one async track per request with its phases, preemption included
    assert {("b", f"request {r}") for r in "012"} <= names
    assert {("b", "queued"), ("b", "prefill"), ("b", "decode")} <= names
    assert any(e["ph"] == "b" and e["name"] == "queued" and e["args"].get("preempted") for e in evs)
    steps = [e for e in evs if e["ph"] == "X" and e["name"].startswith("step ")]
    _, events = read_trace(trace)
    assert len(steps) == sum(e.name == "step" and e.kind == "end" for e in events)
    assert steps[0]["args"]["batch"]["input_ids"] and steps[0]["args"]["scheduled"]
    assert {"schedule", "execute", "postprocess"} <= {e["name"] for e in evs if e["ph"] == "X"}
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"} <= \
        {e["name"] for e in evs if e["ph"] == "C"}
    kernels = [e for e in evs if e["ph"] == "X" and e["cat"] == "kernel"]
    assert kernels and all("grid" in k["args"] and "launch" not in k["args"] for k in kernels)
    # the cpu backend's launches: the step's input kernels, a cache write and one or two attention calls per
    # layer (the C kernel for decodes and short queries, the reference for longer ones: a preempted request's
    # recomputation), and after sampling post_update
    inputs = {"prepare_prefill_inputs_ref", "prepare_pos_seq_lens_ref", "gather_block_tables_ref",
              "compute_slot_mappings_ref", "post_update_ref"}
    names = [k["name"] for k in kernels]
    assert set(names) - {"unified_attention_ref"} == inputs | {"reshape_and_cache_ref", "cpu_attention_with_kv_cache"}
    ran = [s for s in steps if s["args"]["batch"]]  # (async scheduling may add a last, empty step)
    assert len(steps) - len(ran) <= 1
    attention = names.count("cpu_attention_with_kv_cache") + names.count("unified_attention_ref")
    assert len(kernels) - attention == (4 + 5) * len(ran) and 4 * len(ran) <= attention <= 8 * len(ran)
    assert all(k["dur"] > 0 for k in kernels)  # + 5 input launches
    assert {k["args"]["layer_idx"] for k in kernels} == {0, 1, 2, 3, None}  # None: the input launches
    threads = {e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"engine steps", "kernels", "engine spans"} <= threads
    assert any(e["name"] == "process_name" and e["args"]["name"] == "vllm-trace tiny-gpt2" for e in evs)


def test_checker_catches_broken_traces():
    ok = {"ph": "b", "name": "request 1", "ts": 1.0, "pid": 1, "tid": 1, "cat": "request", "id": "1"}
    assert check_chrome_trace({"traceEvents": [ok]}) == [
        "async track ('async', 1, 'request', '1'): never closed ['request 1']"
    ]
    wrong_e = dict(ok, ph="e", name="prefill", ts=2.0)
    assert "does not close" in check_chrome_trace({"traceEvents": [ok, wrong_e]})[0]
    back = dict(ok, ph="e", ts=0.5)
    assert "goes back" in check_chrome_trace({"traceEvents": [ok, back]})[0]
    x = {"ph": "X", "name": "a", "ts": 0, "dur": 10, "pid": 1, "tid": 1}
    assert "overlaps" in check_chrome_trace({"traceEvents": [x, dict(x, ts=5)]})[0]
    assert "missing" in check_chrome_trace({"traceEvents": [{"ph": "X", "name": "a", "ts": 0}]})[0]


def test_export_command(trace, tmp_path, capsys):
    out = tmp_path / "out.json"
    assert main(["export", str(trace), "--format", "perfetto", "-o", str(out)]) == 0
    assert check_chrome_trace(json.loads(out.read_text())) == []
    assert "ui.perfetto.dev" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "missing.jsonl"), "-o", str(out)]) == 2


def test_the_streamed_export_equals_the_in_memory_one(trace, tmp_path, monkeypatch):
    """export_perfetto sorts in runs spilled to disk and merged: the same JSON, in the same order."""
    from tracer import export

    monkeypatch.setattr(export, "RUN_EVENTS", 7)  # many runs, and ties (equal ts) across them
    out = tmp_path / "out.json"
    result = export.export_perfetto(trace, out)
    chrome = json.loads(out.read_text())
    assert chrome == to_chrome_trace(*read_trace(trace))
    assert result.num_events == len(chrome["traceEvents"]) and not result.truncated
    assert not [p for p in tmp_path.iterdir() if p.name != "out.json"], "temporary files left behind"


def test_the_trace_tools_errors_are_one_true_line(trace, tmp_path, capsys):
    def error(*argv: str) -> str:
        assert main(list(argv)) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "Traceback" not in err, err
        return err

    assert error("export", str(trace), "-o", "/nonexistent/dir/x.json") == (
        "vllm-trace export: error: cannot write /nonexistent/dir/x.json: no such directory /nonexistent/dir")
    assert error("export", str(trace), "-o", str(tmp_path)) == f"vllm-trace export: error: cannot write {tmp_path}: " \
                                                              "it is a directory"
    assert error("export", str(tmp_path), "-o", str(tmp_path / "x.json")) == (
        f"vllm-trace export: error: {tmp_path} is a directory, not a trace file")
    assert error("replay", str(tmp_path)) == f"vllm-trace replay: error: {tmp_path} is a directory, not a trace file"
    missing = tmp_path / "missing.jsonl"
    assert error("export", str(missing), "-o", str(tmp_path / "x.json")) == (
        f"vllm-trace export: error: no such trace file: {missing}")
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 64)
    for cmd in (["export", str(binary), "-o", str(tmp_path / "x.json")], ["replay", str(binary)]):
        assert error(*cmd).endswith(f"error: {binary}: not a vllm-trace file (the first line must be its header)")
    assert not (tmp_path / "x.json").exists()


def test_a_truncated_trace_says_so(trace, tmp_path, capsys):
    data = trace.read_bytes()
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(data[:len(data) - 40])  # the recording process died mid-line
    assert main(["export", str(cut), "-o", str(tmp_path / "x.json")]) == 0
    err = capsys.readouterr().err
    assert f"warning: {cut} is truncated" in err and "ui.perfetto.dev" in err
    assert main(["export", str(trace), "-o", str(tmp_path / "y.json")]) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.slow
def test_export_and_replay_of_a_big_trace_hold_no_whole_file(trace, tmp_path):
    """Both used to hold every event: ~9x the file in RSS for export, ~20x for replay."""
    from benchmarks.big_trace import REPLAY_MOVES, inflate, peak_rss_mib, run_measured

    big = tmp_path / "big.jsonl"
    _, size = inflate(trace, big, 40 * 2 ** 20)
    rss, proc = peak_rss_mib("export", str(big), "-o", str(tmp_path / "big.json"))
    assert proc.returncode == 0, proc.stderr
    assert rss < 120, f"export of a {size / 2 ** 20:.0f} MiB trace peaked at {rss:.0f} MiB"
    rss, proc = run_measured(REPLAY_MOVES, str(big))  # the TUI's moves: a step, the end, back, home
    assert proc.returncode == 0, proc.stderr
    assert rss < 150, f"replay of a {size / 2 ** 20:.0f} MiB trace peaked at {rss:.0f} MiB"
