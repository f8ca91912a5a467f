"""A profiled window in the Perfetto export: each profiled step's launches (every op, with op,
flops and bytes in their args) nest under a "step N" slice on the kernels track; launches outside
the window stay as they were, with no parent."""
from __future__ import annotations

from chrome_check import check_chrome_trace

from engine import LLM, Hooks, SamplingParams
from tracer.events import read_trace
from tracer.export import KERNELS_TID, to_chrome_trace
from tracer.session import TraceSession


def test_profiled_ops_nest_under_their_step(tmp_path):
    path = tmp_path / "trace.jsonl"
    hooks = Hooks()
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    with TraceSession(hooks, trace_file=path, control=False, model="tiny-gpt2"):
        llm = LLM("tiny-gpt2", hooks=hooks)
        llm.generate(["one two"], params, use_tqdm=False)
        window = llm.start_profile()["step"], None
        llm.generate(["three four"], params, use_tqdm=False)
        window = window[0], llm.stop_profile()["step"]
    chrome = to_chrome_trace(*read_trace(path))
    assert check_chrome_trace(chrome) == []  # slices nest per thread
    track = sorted((e for e in chrome["traceEvents"] if e["ph"] == "X" and e["tid"] == KERNELS_TID),
                   key=lambda e: (e["ts"], -e["dur"]))
    parents = [e for e in track if e["name"].startswith("step ")]
    assert [int(p["name"].split()[1]) for p in parents] == list(range(window[0], window[1] + 1))
    for p in parents:
        step = int(p["name"].split()[1])
        inside = [e for e in track if e["cat"] == "kernel" and e["args"]["step"] == step]
        assert {e["name"] for e in inside} >= {"c_attn", "ln_1", "lm_head", "argmax"}
        assert all(p["ts"] <= e["ts"] and e["ts"] + e["dur"] <= p["ts"] + p["dur"] + 1e-3 for e in inside)
        assert all(e["args"]["profiled"] and e["args"]["op"] and "flops" in e["args"] for e in inside)
    before = [e for e in track if e["cat"] == "kernel" and e["args"]["step"] < window[0]]
    assert before and not any("profiled" in e["args"] for e in before)
