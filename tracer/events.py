"""The one event model of the tracer, and its JSON-lines form.

Every layer, from the HTTP server down to a kernel launch, produces the same ``Event``. A trace
file is one header line (schema version, model, engine config, wall-clock start) followed by
one event per line with exactly the keys in ``EVENT_KEYS``.

``ts_ns`` is ``time.perf_counter_ns()`` minus the trace's start (so 0 is the start of the
trace); the header's ``wall_clock_start_ns`` turns it into wall-clock time.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import msgspec
import orjson

from engine.hooks import BEGIN, COUNTER, END, INSTANT, SNAPSHOT

# The modules a request passes through, outermost first (defined once, in engine.trace_names, and
# re-exported here; "ipc" is the process boundary, "tracer" the tracer's own voice).
from engine.trace_names import LAYERS, SCHEDULE, SCHEDULER

SCHEMA = "vllm-trace"
SCHEMA_VERSION = 2
# Version 1 recorded the step's total as the schedule snapshot's (and end event's)
# ``num_scheduled_tokens``; from version 2 that key is vLLM V1's dict (request id -> tokens) and the
# total is ``total_num_scheduled_tokens``. read_trace upgrades version-1 events as it reads them.
READABLE_VERSIONS = (1, SCHEMA_VERSION)

KINDS = (INSTANT, BEGIN, END, COUNTER, SNAPSHOT)
EVENT_KEYS = ("seq", "ts_ns", "layer", "name", "kind", "request_id", "step", "attrs")


@dataclass(slots=True)
class Event:
    seq: int
    ts_ns: int
    layer: str
    name: str
    kind: str = INSTANT
    request_id: str | None = None
    step: int | None = None
    attrs: dict | None = None

    def to_dict(self) -> dict:
        return {
            "seq": self.seq,
            "ts_ns": self.ts_ns,
            "layer": self.layer,
            "name": self.name,
            "kind": self.kind,
            "request_id": self.request_id,
            "step": self.step,
            "attrs": json_safe(self.attrs) if self.attrs else None,
        }

    def to_json(self) -> str:
        return self.to_json_line()[:-1].decode()

    def to_json_line(self) -> bytes:
        """The event's line in a trace file (UTF-8, newline-terminated)."""
        return encode_event(self.seq, self.ts_ns, self.layer, self.name, self.kind, self.request_id, self.step,
                            self.attrs)

    @classmethod
    def from_dict(cls, d: dict) -> "Event":
        if set(d) != set(EVENT_KEYS):
            raise ValueError(f"an event has exactly the keys {EVENT_KEYS}, got {sorted(d)}")
        return cls(d["seq"], d["ts_ns"], d["layer"], d["name"], d["kind"], d["request_id"], d["step"], d["attrs"])

    def get(self, key: str, default: Any = None) -> Any:
        return self.attrs.get(key, default) if self.attrs else default


def encode_event(seq: int, ts_ns: int, layer: str, name: str, kind: str, request_id: str | None,
                 step: int | None, attrs: dict | None) -> bytes:
    """An event's line in a trace file (UTF-8, newline-terminated), with exactly EVENT_KEYS.
    Engine attributes are almost always plain JSON data already and go straight to orjson;
    the rest (a tensor, a set, a non-string key) is converted with json_safe first."""
    d = {"seq": seq, "ts_ns": ts_ns, "layer": layer, "name": name, "kind": kind, "request_id": request_id,
         "step": step, "attrs": attrs or None}
    try:
        return orjson.dumps(d, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:  # orjson.JSONEncodeError: a tensor, an int past 64 bits, a lone surrogate ...
        d["attrs"] = json_safe(attrs)
        d["request_id"] = json_safe(request_id)
        return orjson.dumps(d, option=orjson.OPT_APPEND_NEWLINE)


def _event(d: dict) -> Event:
    return Event(d["seq"], d["ts_ns"], d["layer"], d["name"], d["kind"], d["request_id"], d["step"], d["attrs"])


def decode_line(line: bytes | str) -> Event:
    """The event of one trace line (as encode_event wrote it)."""
    return _event(orjson.loads(line))


_decode_events = msgspec.json.Decoder(list[Event])


def decode_lines(data: bytes) -> list[Event]:
    """The events of consecutive trace lines (each newline-terminated, as encode_event wrote them),
    parsed as one JSON array straight into Events by msgspec. The TUI decodes every event of 64
    streams (decoding was its largest single cost): one repetition of benchmarks.tui_terminal,
    7,837 events, 3.0 MB, takes 20 ms this way against 35 ms with orjson into dicts, then Events,
    and 3.3 µs an event with decode_line one line at a time (measured). A line whose fields have
    other types than Event's (a request id that is a number) is read as decode_line reads it. A raw
    newline byte only ends a line: inside a string JSON writes it as the two characters \\n."""
    if not data:
        return []
    array = b"[" + data[:-1].replace(b"\n", b",") + b"]"
    try:
        return _decode_events.decode(array)
    except msgspec.ValidationError:
        return [_event(d) for d in orjson.loads(array)]


INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 64 - 1  # what orjson writes as a number
_SURROGATE = re.compile("[\ud800-\udfff]")


def json_safe(x: Any) -> Any:
    """Plain JSON data from what engine code passes as attributes: tensors and numpy arrays
    become lists, tuples and sets lists, dataclasses dicts, enums their value, dict keys strings;
    NaN and infinities (not JSON) become strings. It never raises, whatever a client sent: an
    integer past 64 bits becomes its decimal string, a lone surrogate U+FFFD."""
    if x is None or isinstance(x, bool):
        return x
    if isinstance(x, int):
        return x if INT64_MIN <= x <= INT64_MAX else str(x)
    if isinstance(x, str):
        return _valid_text(x)
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if isinstance(x, dict):
        return {_valid_text(str(k)): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        return [json_safe(v) for v in (sorted(x, key=repr) if isinstance(x, (set, frozenset)) else x)]
    if isinstance(x, enum.Enum):
        return json_safe(x.value)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: json_safe(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if hasattr(x, "tolist"):  # torch tensors, numpy arrays and scalars
        return json_safe(x.tolist())
    if isinstance(x, (Path, bytes)):
        return str(x) if isinstance(x, Path) else x.decode("utf-8", "replace")
    if hasattr(x, "__dict__"):
        return {k: json_safe(v) for k, v in vars(x).items() if not k.startswith("_")}
    return _valid_text(repr(x))


def _valid_text(s: str) -> str:
    """`s` as valid Unicode (UTF-8 cannot hold a lone surrogate: each becomes U+FFFD)."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", s)


def make_header(model: str | None = None, engine_config: dict | None = None, *, start_perf_ns: int,
                wall_clock_start_ns: int | None = None, **extra: Any) -> dict:
    wall = time.time_ns() if wall_clock_start_ns is None else wall_clock_start_ns
    return {"schema": SCHEMA, "version": SCHEMA_VERSION, "model": model, "engine_config": json_safe(engine_config),
            "wall_clock_start_ns": wall,
            "wall_clock_start": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(wall / 1e9)) + "Z",
            "perf_counter_start_ns": start_perf_ns, "layers": list(LAYERS), **json_safe(extra)}


def is_header(d: dict) -> bool:
    return d.get("schema") == SCHEMA


class TraceFileError(ValueError):
    """A path that is not a readable trace file, said in one line that names it."""


class TraceReader:
    """A trace file read as a stream: the header when opened, then the events one line at a time
    as you iterate (a recording of a long run is gigabytes: nothing here holds the file).

    ``truncated`` becomes True when the last line turns out torn (the recording process died
    mid-write): that line is skipped. A bad line anywhere else is a TraceFileError naming the
    file and line. ``lines()`` also gives each event's byte offset, for an index of the file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.truncated = False
        try:
            self._file = open(self.path, "rb")
        except FileNotFoundError:
            raise TraceFileError(f"no such trace file: {path}") from None
        except IsADirectoryError:
            raise TraceFileError(f"{path} is a directory, not a trace file") from None
        except OSError as e:
            raise TraceFileError(f"cannot read trace file {path}: {e.strerror or e}") from None
        try:
            self.header = self._read_header()
        except BaseException:
            self._file.close()
            raise
        self.version = self.header["version"]
        self._events_at = self._file.tell()

    def _read_header(self) -> dict:
        not_trace = TraceFileError(f"{self.path}: not a vllm-trace file (the first line must be its header)")
        try:
            header = orjson.loads(self._file.readline(1 << 20))
        except orjson.JSONDecodeError:  # binary, or text of another kind
            raise not_trace from None
        if not isinstance(header, dict) or not is_header(header):
            raise not_trace
        version = header.get("version")
        if version not in READABLE_VERSIONS:
            readable = ", ".join(map(str, READABLE_VERSIONS))
            raise TraceFileError(f"{self.path}: trace schema version {version}, this tracer reads {readable}")
        return header

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "TraceReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def lines(self) -> Iterator[tuple[int, Event]]:
        """(byte offset of its line, event) for every event, in file order."""
        f = self._file
        f.seek(self._events_at)
        lineno, offset = 1, self._events_at
        upgrade = self.version == 1
        for line in f:
            lineno += 1
            at, offset = offset, offset + len(line)
            if not line.strip():
                continue
            try:
                ev = self.decode(line)
            except TraceFileError:
                if not line.endswith(b"\n"):  # only the file's last line can lack one
                    self.truncated = True
                    return
                raise TraceFileError(f"{self.path}:{lineno}: not a trace event line") from None
            yield at, _upgrade_v1(ev) if upgrade else ev

    def __iter__(self) -> Iterator[Event]:
        return (ev for _, ev in self.lines())

    def decode(self, line: bytes) -> Event:
        """The event of one of this file's lines."""
        try:
            d = orjson.loads(line)
            if not isinstance(d, dict):
                raise ValueError("not an object")
            return Event.from_dict(d)
        except ValueError:  # orjson's JSONDecodeError is one
            raise TraceFileError(f"{self.path}: not a trace event line") from None

    def read_at(self, offset: int, count: int) -> list[Event]:
        """`count` events from the line at byte `offset` on (random access, for an index)."""
        f = self._file
        f.seek(offset)
        out: list[Event] = []
        upgrade = self.version == 1
        while len(out) < count:
            line = f.readline()
            if not line:
                break
            if not line.strip():
                continue
            try:
                ev = self.decode(line)
            except TraceFileError:
                if not line.endswith(b"\n"):  # the torn last line
                    break
                raise
            out.append(_upgrade_v1(ev) if upgrade else ev)
        return out


def read_trace(path: str | Path) -> tuple[dict, list[Event]]:
    """(header, events) of a trace file, all in memory (a small one; TraceReader streams)."""
    with TraceReader(path) as reader:
        return reader.header, list(reader)


def _upgrade_v1(e: Event) -> Event:
    """A version-1 event in version 2's form: the schedule's total moves to its V1 name."""
    total = (e.attrs or {}).get("num_scheduled_tokens")
    if e.layer != SCHEDULER or e.name != SCHEDULE or not isinstance(total, int):
        return e
    attrs = {k: v for k, v in e.attrs.items() if k != "num_scheduled_tokens"}
    attrs["total_num_scheduled_tokens"] = total
    if "scheduled" in attrs:  # the snapshot: its per-request counts are in its scheduled list
        attrs["num_scheduled_tokens"] = {s["request_id"]: s["num_tokens"] for s in attrs["scheduled"]}
    return dataclasses.replace(e, attrs=attrs)
