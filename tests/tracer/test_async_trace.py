"""A recorded trace of an async-scheduling run (the default): step N+1's schedule begins while step
N's forward pass, on the executor thread, is still running; the Perfetto export draws those forward
passes on a track of their own, beside the engine steps."""
from chrome_check import check_chrome_trace
from tracer_helpers import traced_run

from engine.hooks import BEGIN, END
from engine.trace_names import EXECUTE_MODEL, MODEL_RUNNER, SCHEDULE, SCHEDULER
from tracer.events import read_trace
from tracer.export import FORWARD_TID, to_chrome_trace


def test_the_next_step_is_scheduled_during_the_forward_pass(tmp_path):
    path = tmp_path / "async.jsonl"
    traced_run(path, max_tokens=12, async_scheduling=True)
    header, events = read_trace(path)
    schedule_begin = {e.step: e.ts_ns for e in events if (e.layer, e.name, e.kind) == (SCHEDULER, SCHEDULE, BEGIN)}
    forward = {e.step: e.ts_ns for e in events if (e.layer, e.name, e.kind) == (MODEL_RUNNER, EXECUTE_MODEL, END)}
    overlapped = [s for s in schedule_begin if s - 1 in forward and schedule_begin[s] < forward[s - 1]]
    assert len(overlapped) >= 5, (schedule_begin, forward)

    assert check_chrome_trace(to_chrome_trace(header, events)) == []  # every slice inside its parent, per thread
    chrome = to_chrome_trace(header, events)["traceEvents"]
    names = {e["args"]["name"] for e in chrome if e.get("ph") == "M" and e.get("tid") == FORWARD_TID}
    assert names == {"forward pass (executor)"}
    spans = [e for e in chrome if e.get("tid") == FORWARD_TID and e.get("ph") == "X"]
    assert {e["args"]["step"] for e in spans} == set(forward)
