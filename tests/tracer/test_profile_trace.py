"""Profiling and the tracer: in the Perfetto export each profiled step's launches (every op, with
op, flops and bytes in their args) nest under a "step N" slice on the kernels track, and launches
outside the window stay as they were; kernel-level stepping stops before each profiled op; a
profile call made while the step controller holds the engine core waits for the step's end
without blocking the core's other calls."""
from __future__ import annotations

import threading

import pytest
from chrome_check import check_chrome_trace
from tracer_helpers import CoreProcess, start_loop

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
    ran = {int(e["name"].split()[1]) for e in chrome["traceEvents"]  # (async scheduling ends on an empty step)
           if e["ph"] == "X" and e["name"].startswith("step ") and e["args"].get("total_num_scheduled_tokens")}
    assert [int(p["name"].split()[1]) for p in parents] == sorted(ran & set(range(window[0], window[1] + 1)))
    for p in parents:
        step = int(p["name"].split()[1])
        inside = [e for e in track if e["cat"] == "kernel" and e["args"]["step"] == step]
        assert {e["name"] for e in inside} >= {"c_attn", "ln_1", "lm_head", "argmax"}
        assert all(p["ts"] <= e["ts"] and e["ts"] + e["dur"] <= p["ts"] + p["dur"] + 1e-3 for e in inside)
        assert all(e["args"]["profiled"] and e["args"]["op"] and "flops" in e["args"] for e in inside)
    before = [e for e in track if e["cat"] == "kernel" and e["args"]["step"] < window[0]]
    assert before and not any("profiled" in e["args"] for e in before)


def test_k_steps_through_every_profiled_op():
    """Kernel-level stepping (the TUI's k) stops before each profiled op, in the order they run."""
    hooks = Hooks()
    session = TraceSession(hooks, start_paused=True)
    engine = LLM("tiny-gpt2", hooks=hooks, block_size=4).llm_engine
    engine.start_profile()
    engine.add_request("a", "kernels", SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    ctl = session.controller
    loop = start_loop(engine)
    try:
        ctl.wait_until_paused(30)
        stops = []
        while len(stops) < 13:
            ctl.step(1, "kernel")
            stop = ctl.wait_until_paused(30)
            if stop.point == "kernel":
                stops.append((stop.info["name"], stop.info["layer_idx"]))
        ctl.resume()
        loop.join(30)
    finally:
        session.close()
    inputs = [(f"{k}_ref", None) for k in ("prepare_prefill_inputs", "prepare_pos_seq_lens", "gather_block_tables",
                                            "compute_slot_mappings")]
    assert stops == inputs + [("plan_attention", None), ("wte", None), ("wpe", None), ("ln_1", 0), ("c_attn", 0),
                     ("reshape_and_cache_ref", 0), ("cpu_attention_with_kv_cache", 0), ("attn.c_proj", 0), ("ln_2", 0)]


@pytest.mark.slow
def test_profile_while_held_waits_for_the_step_boundary():
    hooks = Hooks()
    session = TraceSession(hooks, start_paused=True, remote_control=True)
    core = CoreProcess(session, block_size=4)
    try:
        core.add_request("a", "kernels", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        ctl = session.controller
        assert ctl.wait_until_paused(30).step == 0  # held before step 0
        answer = {}
        call = threading.Thread(target=lambda: answer.update(core.llm.engine_core.profile(True)))
        call.start()
        call.join(0.5)
        assert call.is_alive()  # not while the engine is held: at the next step boundary
        ctl.step(1, "step")  # the core still takes the controller's calls meanwhile
        call.join(30)
        assert answer["profiling"] is True and answer["step"] == 1  # from the step after the held one
        ctl.resume()
        start_loop(core).join(30)
    finally:
        session.close()
        core.close()
    profiled = {e.step for e in session.bus.read(0)[0] if e.layer == "kernel" and (e.attrs or {}).get("profiled")}
    assert profiled == {1, 2}
