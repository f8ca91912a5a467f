import enum
import json
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tracer.bus import EventBus
from tracer.events import (
    EVENT_KEYS,
    LAYERS,
    SCHEMA_VERSION,
    Event,
    decode_line,
    decode_lines,
    encode_event,
    json_safe,
    make_header,
    read_trace,
)


class Color(enum.Enum):
    RED = "red"


@dataclass
class Point:
    x: int
    y: tuple


def test_layers_cover_the_request_path():
    for layer in ("cli", "http", "api", "tokenizer", "engine", "scheduler", "block_manager", "model_runner",
                  "kernel", "sampler", "detokenizer"):
        assert layer in LAYERS


def test_json_safe_converts_engine_values():
    attrs = {"t": torch.tensor([[1, 2], [3, 4]]), "tup": (1, (2, 3)), "dc": Point(1, (2,)), "e": Color.RED,
             "s": {3, 1}, "nan": float("nan"), 5: "int key", "f": torch.tensor(0.5)}
    out = json_safe(attrs)
    assert out == {"t": [[1, 2], [3, 4]], "tup": [1, [2, 3]], "dc": {"x": 1, "y": [2]}, "e": "red", "s": [1, 3],
                   "nan": "nan", "5": "int key", "f": 0.5}
    json.dumps(out, allow_nan=False)


def test_event_line_has_exactly_the_schema_keys():
    ev = Event(3, 1234, "kernel", "unified_attention", "instant", None, 7, {"grid": (4, 2), "dtype": torch.float16})
    d = json.loads(ev.to_json())
    assert tuple(d) == EVENT_KEYS
    assert d["attrs"] == {"grid": [4, 2], "dtype": "torch.float16"}
    assert Event.from_dict(d).attrs["grid"] == [4, 2]
    assert json.loads(Event(0, 0, "engine", "x").to_json())["attrs"] is None
    with pytest.raises(ValueError):
        Event.from_dict({**d, "extra": 1})


def test_read_trace_skips_torn_last_line_only(tmp_path):
    header = make_header("tiny-gpt2", {"cache": {"block_size": 4}}, start_perf_ns=0)
    lines = [json.dumps(header), Event(0, 1, "engine", "QUEUED", request_id="0").to_json()]
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n" + '{"seq": 1, "ts_')  # the process died mid-line
    h, events = read_trace(p)
    assert h["version"] == SCHEMA_VERSION and h["model"] == "tiny-gpt2"
    assert h["engine_config"]["cache"]["block_size"] == 4
    assert isinstance(h["wall_clock_start_ns"], int)
    assert [e.name for e in events] == ["QUEUED"]
    p.write_text(lines[0] + "\nnot json\n" + lines[1] + "\n")
    with pytest.raises(ValueError, match=":2"):
        read_trace(p)
    p.write_text(lines[1] + "\n")
    with pytest.raises(ValueError, match="header"):
        read_trace(p)


def test_the_bus_holds_each_event_as_its_trace_line():
    """Events are encoded as they are published; one with a tensor, a set or an int key goes
    through json_safe. Readers get what a replay of the file would give them."""
    bus = EventBus(clock=iter(range(10, 10**6, 10)).__next__)  # starts at 10
    bus.publish("engine", "step", "begin", step=0)
    bus.publish(
        "sampler", "sampled", step=0, attrs={"t": torch.tensor([1, 2]), "s": {3}, "k": {4: "x"}, "shape": (2, 3)}
    )
    bus.publish("engine", "step", "end", step=0, attrs={})
    lines, missed, end = bus.read_lines(0)
    assert (missed, end) == (0, 3) and all(isinstance(x, bytes) and x.endswith(b"\n") for x in lines)
    assert [json.loads(x) for x in lines] == [
        {"seq": 0, "ts_ns": 10, "layer": "engine", "name": "step", "kind": "begin", "request_id": None, "step": 0,
         "attrs": None},
        {"seq": 1, "ts_ns": 20, "layer": "sampler", "name": "sampled", "kind": "instant", "request_id": None,
         "step": 0, "attrs": {"t": [1, 2], "s": [3], "k": {"4": "x"}, "shape": [2, 3]}},
        {"seq": 2, "ts_ns": 30, "layer": "engine", "name": "step", "kind": "end", "request_id": None, "step": 0,
         "attrs": None},
    ]
    assert list(json.loads(lines[0])) == list(EVENT_KEYS)  # the keys, in the schema's order
    events, _, _ = bus.read(0)
    assert events[1] == Event(1, 20, "sampler", "sampled", "instant", None, 0,
                              {"t": [1, 2], "s": [3], "k": {"4": "x"}, "shape": [2, 3]})
    assert [e.to_json_line() for e in events] == lines and decode_line(lines[2]) == events[2]


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.text(), st.one_of(st.none(), st.text(min_size=1), st.integers(0, 99)),
                          st.dictionaries(st.text(), st.one_of(st.text(), st.integers(-2 ** 63, 2 ** 63 - 1),
                                                               st.floats(allow_nan=False, allow_infinity=False),
                                                               st.lists(st.integers(0, 50000)), st.none(),
                                                               st.dictionaries(st.text(), st.booleans())))),
                max_size=20))
def test_decode_lines_reads_joined_lines_as_decode_line_reads_each(items):
    """Text with newlines, quotes and any Unicode inside: the bus decodes a run of lines at once
    (msgspec, typed), as decode_line (orjson) reads each; a request id that is a number too."""
    lines = [encode_event(i, 10 ** 12 + i, "api", name, "instant", rid, i, attrs) for i, (name, rid, attrs) in
             enumerate(items)]
    assert decode_lines(b"".join(lines)) == [decode_line(x) for x in lines]
