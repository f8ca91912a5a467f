import enum
import json
from dataclasses import dataclass

import pytest
import torch

from tracer.events import EVENT_KEYS, LAYERS, Event, encode_lines, json_safe, make_header, read_trace


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
    assert h["version"] == 1 and h["model"] == "tiny-gpt2" and h["engine_config"]["cache"]["block_size"] == 4
    assert isinstance(h["wall_clock_start_ns"], int)
    assert [e.name for e in events] == ["QUEUED"]
    p.write_text(lines[0] + "\nnot json\n" + lines[1] + "\n")
    with pytest.raises(ValueError, match=":2"):
        read_trace(p)
    p.write_text(lines[1] + "\n")
    with pytest.raises(ValueError, match="header"):
        read_trace(p)


def test_a_batch_with_one_non_json_attribute_is_still_encoded_whole():
    """The recorder encodes a batch in one call; one event with a tensor, a set or an int key
    sends the batch through json_safe, event by event, and every line is still there."""
    plain = Event(0, 1, "engine", "step", "begin", None, 0, None)
    odd = Event(1, 2, "sampler", "sampled", "instant", None, 0,
                {"t": torch.tensor([1, 2]), "s": {3}, "k": {4: "x"}, "shape": (2, 3)})
    tail = Event(2, 3, "engine", "step", "end", None, 0, {"num_outputs": 1})
    lines = encode_lines([plain, odd, tail]).decode().splitlines()
    assert [json.loads(x) for x in lines] == [
        {"seq": 0, "ts_ns": 1, "layer": "engine", "name": "step", "kind": "begin", "request_id": None, "step": 0,
         "attrs": None},
        {"seq": 1, "ts_ns": 2, "layer": "sampler", "name": "sampled", "kind": "instant", "request_id": None,
         "step": 0, "attrs": {"t": [1, 2], "s": [3], "k": {"4": "x"}, "shape": [2, 3]}},
        {"seq": 2, "ts_ns": 3, "layer": "engine", "name": "step", "kind": "end", "request_id": None, "step": 0,
         "attrs": {"num_outputs": 1}},
    ]
    assert list(json.loads(lines[0])) == list(EVENT_KEYS)  # the keys, in the schema's order
    assert plain.to_json_line() == (lines[0] + "\n").encode()
