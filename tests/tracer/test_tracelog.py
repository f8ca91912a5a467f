import io

import pytest

from tracer.bus import EventBus
from tracer.events import Event
from tracer.tracelog import TraceLog, format_event


def test_format_event_reads_like_the_seed_traces():
    ev = Event(5, 0, "scheduler", "PREEMPTED", "instant", "7", 12, {"reason": "no free blocks for 3"})
    assert format_event(ev) == "[TRACE] scheduler PREEMPTED step=12 request=7 reason='no free blocks for 3'"
    ev = Event(6, 0, "model_runner", "batch", "instant", None, 2, {"input_ids": list(range(10)), "seq_lens": [5]})
    assert format_event(ev) == "[TRACE] model_runner batch step=2 input_ids=[0,1,2,3,4,5,6,7,…+2] seq_lens=[5]"
    ev = Event(7, 0, "engine", "model_load", "end", None, None, {"seconds": 0.0312345, "bytes": 3567104})
    assert format_event(ev) == "[TRACE] engine model_load (end) seconds=0.03123 bytes=3567104"
    snap = Event(8, 0, "scheduler", "schedule", "snapshot", None, 1, {"running": [{}, {}], "token_budget": 64})
    assert format_event(snap) == "[TRACE] scheduler schedule (snapshot) step=1 running=<2> token_budget=64"


def test_trace_log_prints_only_the_chosen_layers():
    bus, out = EventBus(), io.StringIO()
    log = TraceLog(bus, out, layers=["scheduler"])
    bus.publish("engine", "QUEUED", request_id="1")
    bus.publish("scheduler", "SCHEDULED", request_id="1", step=0)
    log.close()
    assert out.getvalue() == "[TRACE] scheduler SCHEDULED step=0 request=1\n"


def test_unknown_layer_is_rejected():
    with pytest.raises(ValueError, match="unknown layer"):
        TraceLog(EventBus(), io.StringIO(), layers=["gpu"])
