"""The fold of profiling (profiler start / stop, each step's wall time) and the profiled-step helpers
(tracer/roofline.py) on synthetic profiled traces."""
from __future__ import annotations

from tests.tui.profiled_events import ROOF, profiled_events, step_ops
from tracer.replay import Replay
from tracer.roofline import by_kind, by_name, chart_range, profiled_ops, profiled_steps, trace_dtype
from tracer.state import TraceState, fold


def test_profiling_is_on_between_start_and_stop_and_each_step_has_its_wall_time():
    events = profiled_events(decode_steps=1)
    s = TraceState()
    seen = []
    for ev in events:
        fold(s, ev)
        if ev.layer == "engine" and ev.name == "step" and ev.kind == "end":
            seen.append((ev.step, s.profiling, len([k for k in s.kernels if k.get("profiled")])))
            begin = next(e for e in events if e.step == ev.step and e.name == "step" and e.kind == "begin")
            assert s.step_ns == ev.ts_ns - begin.ts_ns
    assert seen == [(0, True, 40), (1, True, 40), (2, False, 0)]
    d = TraceState.from_dict(s.to_dict())  # what attach gets from /trace/state
    assert d.profiling is False and d.step_ns == s.step_ns
    replay = Replay({"model": "tiny-gpt2"}, events)
    assert replay.goto(1).profiling and not replay.goto(2).profiling


def test_profiled_ops_sorted_by_time_and_summed_per_kind_and_name():
    steps = profiled_steps(profiled_events())
    assert sorted(steps) == [0, 1, 2] and all(len(v) == 40 for v in steps.values())
    ops = profiled_ops(steps[1])
    assert [o.duration_ns for o in ops] == sorted((o.duration_ns for o in ops), reverse=True)
    kinds = by_kind(ops)
    expected = {}
    for name, kind, layer, flops, nbytes in step_ops(1, 41):
        f, b = expected.get(kind, (0, 0))
        expected[kind] = (f + flops, b + nbytes)
    assert {k: (p.flops, p.bytes) for k, p in kinds.items()} == expected
    assert list(kinds)[:2] == ["matmul", "attention"]  # the chart's order
    names = by_name(ops)
    assert names["c_fc"].flops == 4 * 2 * 1 * 128 * 512  # four layers summed
    assert trace_dtype(steps[1]) == "float32"
    x0, x1, y0, y1 = chart_range(kinds, ROOF)
    assert x0 <= min(p.intensity for p in kinds.values() if p.flops and p.bytes) and x1 >= ROOF.ridge
    assert y1 >= ROOF.peak_flops and x1 / x0 >= 100
