"""Export a trace as Chrome trace-event JSON (opens in ui.perfetto.dev and chrome://tracing).

    one async track per request   "request R" with nested queued / prefill / decode (b/e)
    thread "engine steps"         one X slice per step (its batch in args), schedule / execute /
                                  postprocess nested inside
    thread "kernels"              one X slice per kernel launch (grid, meta in args); with tensor
                                  parallelism one thread per rank ("kernels rank R"), all_reduce
                                  and all_gather among its launches; a profiled step's launches
                                  (every op, with op / flops / bytes in args) nest under a
                                  "step N" slice on that thread
    thread per other layer        its begin/end spans (startup stages, HTTP handlers, ...); a
                                  worker's per rank ("worker rank R")
    thread "kv transfer"          one X slice per kv_transfer event (a KV connector's save, load, send
                                  or receive of a request's blocks: block ids, bytes in args), ending
                                  when it ended and lasting the seconds it took; transfers that overlap
                                  (pulls run on a pool of threads) go on "kv transfer 2", 3, ...
    counters                      vllm:num_requests_waiting / _running, vllm:kv_cache_usage_perc
    M events                      process and thread names

Timestamps are microseconds from the start of the trace.

Several traces (``export_merged``: disaggregated prefill's two instances) become one file with a process
per trace, on one clock: each trace's times are shifted by its wall-clock start's distance from the
earliest one's (the header's ``wall_clock_start_ns``). A request prefilled on one instance and decoded
on another is linked by a flow arrow from the prefill side's KV slice (its send, else its save) to the
decode side's (its receive, else its load): the decode request's kv_transfer_params name the prefill
request (``remote_request_id``) and instance (``remote_engine_id``, each trace's engine config says its
own); requests without them are joined by an equal request id.

A recording is read as a stream and never held: events are converted as they are read, and the
converted ones, which must come out in time order (a step's slice is known only at its end,
after its kernels), are sorted in runs of RUN_EVENTS written to temporary files beside the
output, then merged into it. Memory stays flat whatever the trace's size (measured in
benchmarks/RESULTS.md); ``to_chrome_trace`` is the in-memory form, for an event list at hand.
"""
from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import pickle
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import msgspec

from engine.hooks import BEGIN, END, SNAPSHOT
from engine.trace_names import (
    ABORTED,
    API,
    BATCH,
    CLI,
    CONFIG,
    DETOKENIZER,
    ENGINE,
    EXECUTE_MODEL,
    FINISHED,
    HTTP,
    KERNEL,
    KV_LOAD,
    KV_RECV,
    KV_SAVE,
    KV_SEND,
    KV_TRANSFER,
    MODEL_RUNNER,
    NEW_TOKENS,
    PREEMPTED,
    QUEUED,
    SAMPLED,
    SAMPLER,
    SCHEDULE,
    SCHEDULED,
    SCHEDULER,
    STEP,
    TRACER,
    WORKER,
)
from tracer.events import Event, TraceReader, json_safe

PID = 1
STEPS_TID, KERNELS_TID = 1, 2
STEPS2_TID = 4  # async scheduling: the step scheduled while the one before it is still in flight
FORWARD_TID = 3  # the forward passes (under async scheduling on the executor thread, beside the next schedule)
KV_TID = 30  # a KV connector's transfers (+ 1, 2, ...: more rows while they overlap)
LAYER_TIDS = {CLI: 10, HTTP: 11, API: 12, ENGINE: 13, TRACER: 14}  # other layers' spans
RANK_KERNELS_TID, RANK_WORKER_TID = 100, 200  # + rank: tensor-parallel ranks > 0, and workers
RUN_EVENTS = 50_000  # converted events sorted in memory at once (~20 MB), then spilled to a run file


def _us(ns: int) -> float:
    return ns / 1000.0


class _Builder:
    """Converted events go to ``emit`` (in the order they are known, not in time order). One trace's:
    its process id, and (merged with others) its shift onto the common clock and a prefix that keeps
    its requests' async ids apart from the other traces'."""

    def __init__(self, emit: Callable[[dict], None], pid: int = PID, offset_ns: int = 0, id_prefix: str = "") -> None:
        self.emit, self.pid, self.offset_ns, self.id_prefix = emit, pid, offset_ns, id_prefix
        self.threads: dict[int, str] = {STEPS_TID: "engine steps", KERNELS_TID: "kernels"}
        # for linking instances: this engine's id and role, each request's kv_transfer_params, and each
        # request's first KV slice of each kind
        self.engine_id: str | None = None
        self.kv_role: str | None = None
        self.kv_params: dict[str, dict] = {}
        self.kv_slices: dict[str, dict[str, tuple[int, int, int]]] = {}  # (row, begin_ns, end_ns)
        self._kv_lanes: list[int] = []  # each "kv transfer" row's last end

    def x(self, tid: int, name: str, begin_ns: int, end_ns: int, args: dict | None = None, cat: str = ENGINE):
        self.emit({"ph": "X", "pid": self.pid, "tid": tid, "name": name, "cat": cat,
                   "ts": _us(begin_ns + self.offset_ns), "dur": max(0.0, _us(end_ns - begin_ns)), "args": args or {}})

    def async_(self, ph: str, cat: str, aid: str, name: str, ts_ns: int, args: dict | None = None):
        self.emit({"ph": ph, "pid": self.pid, "tid": STEPS_TID, "cat": cat, "id": self.id_prefix + aid, "name": name,
                   "ts": _us(ts_ns + self.offset_ns), "args": args or {}})

    def counter(self, name: str, ts_ns: int, value: float):
        self.emit({"ph": "C", "pid": self.pid, "tid": STEPS_TID, "name": name, "ts": _us(ts_ns + self.offset_ns),
                   "args": {"value": value}})

    def flow(self, ph: str, fid: int, tid: int, ts_ns: int, args: dict | None = None):
        """One end of a flow arrow ("s" its start, "f" its end), bound to the KV slice open at ts_ns on tid."""
        self.emit({"ph": ph, "pid": self.pid, "tid": tid, "id": fid, "name": "KV blocks", "cat": KV_TRANSFER,
                   "ts": _us(ts_ns + self.offset_ns), **({"bp": "e"} if ph == "f" else {}), "args": args or {}})

    def config(self, a: dict) -> None:
        kv = (a.get("config") or {}).get("kv_transfer_config") or {}
        self.engine_id, self.kv_role = kv.get("engine_id"), kv.get("kv_role")

    def queued(self, rid: str, a: dict) -> None:
        params = ((a.get("params") or {}).get("extra_args") or {}).get("kv_transfer_params")
        if params:
            self.kv_params[rid] = params

    def kv_slice(self, ev: Event, a: dict) -> None:
        """A transfer as a slice ending when it ended (its event's time), lasting the seconds it took, on the
        first "kv transfer" row free by then (transfers overlap: pulls run on a pool of threads)."""
        begin = ev.ts_ns - int((a.get("seconds") or 0) * 1e9)
        lane = next((i for i, end in enumerate(self._kv_lanes) if end <= begin), len(self._kv_lanes))
        if lane == len(self._kv_lanes):
            self._kv_lanes.append(0)
        self._kv_lanes[lane] = ev.ts_ns
        tid = KV_TID + lane
        self.threads[tid] = "kv transfer" + (f" {lane + 1}" if lane else "")
        args = {"request_id": ev.request_id, "step": ev.step, "num_blocks": len(a.get("block_ids") or ()),
                **{k: a.get(k) for k in ("bytes", "seconds", "connector", "block_ids")}}
        self.x(tid, f"{ev.name} {ev.request_id}", begin, ev.ts_ns, json_safe(args), cat=KV_TRANSFER)
        if ev.request_id is not None:
            self.kv_slices.setdefault(ev.request_id, {}).setdefault(ev.name, (tid, begin, ev.ts_ns))


class _RequestTrack:
    """queued -> prefill -> decode (-> queued again after a preemption) for one request."""

    def __init__(self, b: _Builder, rid: str, ts_ns: int):
        self.b, self.rid, self.phase, self.closed = b, rid, None, False
        b.async_("b", "request", rid, f"request {rid}", ts_ns)

    def enter(self, phase: str, ts_ns: int, args: dict | None = None) -> None:
        if self.closed or phase == self.phase:
            return
        if self.phase is not None:
            self.b.async_("e", "request", self.rid, self.phase, ts_ns)
        self.phase = phase
        self.b.async_("b", "request", self.rid, phase, ts_ns, args)

    def close(self, ts_ns: int, args: dict | None = None) -> None:
        if self.closed:
            return
        if self.phase is not None:
            self.b.async_("e", "request", self.rid, self.phase, ts_ns)
        self.b.async_("e", "request", self.rid, f"request {self.rid}", ts_ns, args)
        self.closed = True


def _sort_key(e: dict) -> tuple:
    return e["ts"], -e.get("dur", 0)  # (sorted stably: b/e order kept at equal ts)


def to_chrome_trace(header: dict, events: Iterable[Event]) -> dict:
    """The Chrome trace-event JSON object of the events, built in memory."""
    return to_merged_chrome_trace([("", header, events)])


def to_merged_chrome_trace(traces: list[tuple[str, dict, Iterable[Event]]]) -> dict:
    """The Chrome trace-event JSON object of several (label, header, events), merged, built in memory."""
    out: list[dict] = []
    meta, trailer, _ = _convert_all(traces, out.append)
    return {"traceEvents": meta + sorted(out, key=_sort_key), **trailer}


def _meta(header: dict, b: _Builder, label: str | None = None, index: int = 0) -> list[dict]:
    name = f"vllm-trace {header.get('model') or ''}".strip()
    if label is not None:  # one of several traces: which, and which instance
        role = ", ".join(x for x in (b.kv_role, b.engine_id and f"engine {b.engine_id}") if x)
        name = f"{label}: {name}" + (f" ({role})" if role else "")
    meta = [{"ph": "M", "pid": b.pid, "tid": 0, "name": "process_name", "args": {"name": name}}]
    if label is not None:
        meta.append({"ph": "M", "pid": b.pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": index}})
    return meta + [{"ph": "M", "pid": b.pid, "tid": tid, "name": "thread_name", "args": {"name": thread}}
                   for tid, thread in sorted(b.threads.items())]


def _trailer(header: dict) -> dict:
    return {"displayTimeUnit": "ms", "otherData": {k: header.get(k) for k in ("model", "wall_clock_start", "version")}}


@dataclass
class _Open:
    """What _convert carries from one event to the next: what has begun and not yet ended."""
    tracks: dict[str, _RequestTrack] = field(default_factory=dict)
    spans: dict[tuple, Event] = field(default_factory=dict)  # (layer, name, request_id, rank[, step]) -> its BEGIN
    step_begin: dict[int, int] = field(default_factory=dict)
    step_marks: dict[int, dict] = field(default_factory=dict)  # step -> ts of its phase boundaries, and its batch
    steps_end: dict[int, int] = field(default_factory=dict)  # steps track -> where its last step ended
    kernel_end: dict[int, int] = field(default_factory=dict)  # rank -> where its track's last launch ended
    # step -> rank -> [first start, last end] of its profiled launches
    profiled: dict[int, dict[int, list[int]]] = field(default_factory=dict)


def _convert(b: _Builder, events: Iterable[Event]) -> None:
    o = _Open()
    last_ts = 0
    for ev in events:
        last_ts = ev.ts_ns
        a = ev.attrs or {}
        # each handler takes the event if it is one of its kinds (in this order), else passes it on
        (_request_phase(b, o.tracks, ev, a) or _step_event(b, o, ev, a) or _instance_event(b, ev, a)
         or _kernel_launch(b, o, ev, a) or _layer_span(b, o.spans, ev, a))
    for track in o.tracks.values():  # the trace ended with these requests unfinished
        track.close(last_ts, {"finish_reason": None})


def _span_key(ev: Event, a: dict) -> tuple:
    return ev.layer, ev.name, ev.request_id, a.get("rank") or 0


def _request_phase(b: _Builder, tracks: dict[str, _RequestTrack], ev: Event, a: dict) -> bool:
    """A request's track: queued -> prefill -> decode, closed when it finished or was aborted."""
    rid = ev.request_id
    if (ev.layer, ev.name) == (ENGINE, QUEUED):
        b.queued(rid, a)
        tracks[rid] = _RequestTrack(b, rid, ev.ts_ns)
        tracks[rid].enter("queued", ev.ts_ns, {"num_prompt_tokens": a.get("num_prompt_tokens")})
    elif rid in tracks and (ev.layer, ev.name) == (SCHEDULER, SCHEDULED):
        tracks[rid].enter("prefill", ev.ts_ns)
    elif rid in tracks and (ev.layer, ev.name) == (SCHEDULER, PREEMPTED):
        tracks[rid].enter("queued", ev.ts_ns, {"preempted": a.get("reason")})
    elif rid in tracks and (ev.layer, ev.name) == (DETOKENIZER, NEW_TOKENS):
        tracks[rid].enter("decode", ev.ts_ns)  # its first token ends the prefill
    elif rid in tracks and ev.layer == ENGINE and ev.name in (FINISHED, ABORTED):
        tracks[rid].close(ev.ts_ns, {"finish_reason": a.get("finish_reason", "abort")})
    else:
        return False
    return True


def _step_event(b: _Builder, o: _Open, ev: Event, a: dict) -> bool:
    """A step's begin and end, its phases' boundaries, and the forward pass on the thread that runs it."""
    if (ev.layer, ev.name) == (ENGINE, STEP) and ev.step is not None:
        if ev.kind == BEGIN:
            o.step_begin[ev.step] = ev.ts_ns
            o.step_marks[ev.step] = {}
        elif ev.kind == END and ev.step in o.step_begin:
            _end_step(b, o, ev, a)
    elif ev.layer == SCHEDULER and ev.name == SCHEDULE and ev.step in o.step_marks:
        o.step_marks[ev.step][ev.kind] = ev.ts_ns
        if ev.kind == SNAPSHOT:
            o.step_marks[ev.step]["snapshot"] = a
            _counters(b, ev.ts_ns, a.get("stats", {}))
    elif (ev.layer, ev.name) == (MODEL_RUNNER, EXECUTE_MODEL):  # the forward pass, on the thread that runs it
        key = _span_key(ev, a) + (ev.step,)
        if ev.kind == BEGIN:
            o.spans[key] = ev
        elif key in o.spans:
            b.threads[FORWARD_TID] = f"forward pass ({a.get('thread')})"
            b.x(FORWARD_TID, f"execute_model step {ev.step}", o.spans.pop(key).ts_ns, ev.ts_ns,
                {"step": ev.step}, cat=MODEL_RUNNER)
    elif ev.layer in (MODEL_RUNNER, SAMPLER) and ev.step in o.step_marks and not a.get("rank"):
        o.step_marks[ev.step][ev.name] = (ev.ts_ns, a)  # rank 0's: every rank samples the same
    else:
        return False
    return True


def _end_step(b: _Builder, o: _Open, ev: Event, a: dict) -> None:
    """The step's slices (on the second row if it began before the one before it ended), the parent slice of
    its profiled launches on each kernels track, and the counters."""
    begin = o.step_begin.pop(ev.step)
    # async scheduling: a step that began before the one before it ended goes on the second row
    tid = STEPS_TID if begin >= o.steps_end.get(STEPS_TID, 0) else STEPS2_TID
    o.steps_end[tid] = ev.ts_ns
    if tid == STEPS2_TID:
        b.threads[STEPS2_TID] = "engine steps (second batch in flight)"
    _step_slices(b, ev.step, begin, ev.ts_ns, o.step_marks.pop(ev.step, {}), tid)
    # the parent of the step's ops on each kernels track: around its launches, not the whole step
    # (under async scheduling the next step's launches come before this step's end)
    for r, (first, last) in sorted(o.profiled.pop(ev.step, {}).items()):
        b.x(RANK_KERNELS_TID + r if r else KERNELS_TID, f"step {ev.step}", first, last,
            {"profiled": True}, cat=ENGINE)
    _counters(b, ev.ts_ns, a.get("stats", {}))


def _instance_event(b: _Builder, ev: Event, a: dict) -> bool:
    """A KV connector's transfer, or the engine's config (its id and KV role, for linking instances)."""
    if ev.layer == KV_TRANSFER:
        b.kv_slice(ev, a)
    elif (ev.layer, ev.name) == (ENGINE, CONFIG):
        b.config(a)
    else:
        return False
    return True


def _kernel_launch(b: _Builder, o: _Open, ev: Event, a: dict) -> bool:
    """A kernel: an instant (with duration_ns, emitted when the launch ended) or a span, one launch after
    another on its rank's track."""
    if ev.layer != KERNEL:
        return False
    key, rank = _span_key(ev, a), a.get("rank") or 0
    if ev.kind == BEGIN:
        o.spans[key] = ev
        return True
    start = o.spans.pop(key).ts_ns if ev.kind == END and key in o.spans else \
        ev.ts_ns - int(a.get("duration_ns") or 0)
    start = max(start, o.kernel_end.get(rank, 0))  # one launch after another on this track
    o.kernel_end[rank] = max(ev.ts_ns, start)
    tid = RANK_KERNELS_TID + rank if rank else KERNELS_TID
    if rank:
        b.threads[KERNELS_TID], b.threads[tid] = "kernels rank 0", f"kernels rank {rank}"
    if a.get("profiled") and ev.step is not None:
        span = o.profiled.setdefault(ev.step, {}).setdefault(rank, [start, o.kernel_end[rank]])
        span[1] = o.kernel_end[rank]
    b.x(tid, ev.name, start, o.kernel_end[rank], json_safe(dict(a, step=ev.step)), cat=KERNEL)
    return True


def _layer_span(b: _Builder, spans: dict[tuple, Event], ev: Event, a: dict) -> bool:
    """Any other layer's spans (startup stages, HTTP handlers, ...); a worker's on its rank's row."""
    key, rank, rid = _span_key(ev, a), a.get("rank") or 0, ev.request_id
    if ev.kind == BEGIN:
        spans[key] = ev
    elif ev.kind == END and key in spans:
        begin = spans.pop(key)
        if ev.layer == WORKER:
            tid, b.threads[RANK_WORKER_TID + rank] = RANK_WORKER_TID + rank, f"worker rank {rank}"
        else:
            tid = LAYER_TIDS.get(ev.layer, 20 + len(LAYER_TIDS))
            b.threads[tid] = f"{ev.layer} spans"
        b.x(tid, ev.name + (f" {rid}" if rid else ""), begin.ts_ns, ev.ts_ns, dict(a), cat=ev.layer)
    else:
        return False
    return True


def _step_slices(b: _Builder, step: int, begin: int, end: int, marks: dict, tid: int = STEPS_TID) -> None:
    snap = marks.get("snapshot", {})
    batch = marks.get(BATCH, (None, {}))[1]
    keys = ("scheduled", "num_scheduled_tokens", "total_num_scheduled_tokens", "token_budget", "admitted", "preempted")
    args = {k: snap.get(k) for k in keys}
    args["batch"] = batch
    b.x(tid, f"step {step}", begin, end, args)
    sched_end = marks.get(END, marks.get(SNAPSHOT))
    if BEGIN in marks and sched_end is not None:
        b.x(tid, SCHEDULE, marks[BEGIN], sched_end, {"waiting_reasons": snap.get("waiting_reasons")})
    if SAMPLED in marks and sched_end is not None:
        sampled_ts, sampled = marks[SAMPLED]
        b.x(tid, "execute", sched_end, sampled_ts, {"num_tokens": len(batch.get("input_ids", []))})
        b.x(tid, "postprocess", sampled_ts, end, {"token_ids": sampled.get("token_ids")})


def _counters(b: _Builder, ts_ns: int, stats: dict) -> None:
    if "num_waiting" in stats:
        b.counter("vllm:num_requests_waiting", ts_ns, stats["num_waiting"])
        b.counter("vllm:num_requests_running", ts_ns, stats["num_running"])
        b.counter("vllm:kv_cache_usage_perc", ts_ns, round(stats.get("kv_cache_usage", 0.0), 6))


@dataclass
class ExportResult:
    num_events: int  # trace events written (metadata included)
    truncated: bool  # a recording's last line was torn (its process died mid-write) and was left out
    truncated_paths: list[str] = field(default_factory=list)  # ... which recordings
    num_flows: int = 0  # merged traces: requests linked from one instance to another


def export_perfetto(trace_path: str | Path, out_path: str | Path) -> ExportResult:
    """Read a recorded trace as a stream and write its Chrome trace JSON (see the module
    docstring). The output appears whole or not at all: it is written beside, then renamed.
    Raises TraceFileError (a ValueError) for an unreadable trace, OSError for the output."""
    return export_merged([trace_path], out_path)


def export_merged(trace_paths: Sequence[str | Path], out_path: str | Path) -> ExportResult:
    """export_perfetto of several traces into one file: a process per trace, one clock, flows linking
    each request's prefill on one instance to its decode on another (see the module docstring)."""
    out_path = Path(out_path)
    with contextlib.ExitStack() as stack:
        readers = [stack.enter_context(TraceReader(p)) for p in trace_paths]
        if out_path.is_dir():
            raise IsADirectoryError(f"{out_path} is a directory")
        fd, tmp = tempfile.mkstemp(prefix=f".{out_path.name}.", dir=out_path.parent or ".")
        try:
            with os.fdopen(fd, "wb") as out, tempfile.TemporaryDirectory(dir=out_path.parent or ".",
                                                                          prefix=".export-runs-") as runs_dir:
                runs = _SortedRuns(Path(runs_dir))
                meta, trailer, flows = _convert_all([(str(p), r.header, r) for p, r in zip(trace_paths, readers)],
                                                    runs.add)
                n = _write(out, meta, trailer, runs.merged())
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's file is private: give it a plain file's mode
            os.replace(tmp, out_path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        torn = [str(p) for p, r in zip(trace_paths, readers) if r.truncated]
        return ExportResult(n, bool(torn), torn, flows)


def _convert_all(sources: list[tuple[str, dict, Iterable[Event]]], emit) -> tuple[list[dict], dict, int]:
    """Convert each (label, header, events) into emit: (the metadata events, the trailer, the flows linked)."""
    if len(sources) == 1:
        _, header, events = sources[0]
        b = _Builder(emit)
        _convert(b, events)
        return _meta(header, b), _trailer(header), 0
    walls = [h.get("wall_clock_start_ns") for _, h, _ in sources]
    origin = min(walls) if all(walls) else None  # (without every wall clock: no shift)
    builders = []
    for i, ((_, header, events), wall) in enumerate(zip(sources, walls)):
        b = _Builder(emit, PID + i, wall - origin if origin is not None else 0, f"{i + 1}:")
        _convert(b, events)
        builders.append(b)
    flows = _link(builders)
    meta = [m for i, ((label, header, _), b) in enumerate(zip(sources, builders)) for m in _meta(header, b, label, i)]
    trailer = _trailer(sources[0][1])
    trailer["otherData"]["traces"] = [
        {"pid": b.pid, "trace": label, "model": h.get("model"), "wall_clock_start": h.get("wall_clock_start"),
         "engine_id": b.engine_id, "kv_role": b.kv_role, "shift_us": _us(b.offset_ns)}
        for (label, h, _), b in zip(sources, builders)]
    return meta, trailer, flows


def _link(builders: list[_Builder]) -> int:
    """A flow per request whose KV one instance received or loaded and another sent or saved: the decode
    request's kv_transfer_params name the prefill request and its engine; failing them, the same request id."""
    by_engine = {b.engine_id: b for b in builders if b.engine_id}
    pairs = []
    for d in builders:
        for rid, moves in d.kv_slices.items():
            end = moves.get(KV_RECV) or moves.get(KV_LOAD)
            if end is None:
                continue
            params = d.kv_params.get(rid) or {}
            src_rid = params.get("remote_request_id") or rid
            engine = by_engine.get(params.get("remote_engine_id"))
            for p in [engine] if engine is not None else builders:
                start = p.kv_slices.get(src_rid, {}).get(KV_SEND) or p.kv_slices.get(src_rid, {}).get(KV_SAVE)
                if p is not d and start is not None:
                    pairs.append((p, start, src_rid, d, end, rid))
                    break
    for fid, (p, (s_tid, s_begin, s_end), src_rid, d, (f_tid, f_begin, f_end), rid) in enumerate(pairs, 1):
        args = {"prefill_request_id": src_rid, "decode_request_id": rid}
        at = (s_begin + s_end) // 2 + p.offset_ns  # on the common clock: the arrow never points back in time
        p.flow("s", fid, s_tid, at - p.offset_ns, args)
        d.flow("f", fid, f_tid, min(f_end, max((f_begin + f_end) // 2, at - d.offset_ns)), args)
    return len(pairs)


_encode = msgspec.json.Encoder().encode  # right-sized bytes (orjson's hold a 4 KiB buffer each: 12x the memory)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _dumps(e: dict) -> bytes:
    try:
        return _encode(e)
    except (TypeError, OverflowError, msgspec.EncodeError):  # an int past 64 bits: an event list built in memory
        return _encode(json_safe(e))


def _write(out, meta: list[dict], trailer: dict, body: Iterator[bytes]) -> int:
    n = 0
    out.write(b'{"traceEvents":[')
    for line in itertools.chain(map(_dumps, meta), body):
        if n:
            out.write(b",")
        out.write(line)
        n += 1
    out.write(b"]," + _dumps(trailer)[1:])  # the trailer's keys after the list
    return n


class _SortedRuns:
    """An external sort of the converted events by (ts, -dur), stable: runs of RUN_EVENTS sorted
    in memory, each pickled to a file in batches, then merged lazily."""

    def __init__(self, directory: Path):
        self.directory, self.files = directory, []
        self._buf: list[tuple] = []
        self._n = 0

    def add(self, e: dict) -> None:
        self._buf.append((*_sort_key(e), self._n, _dumps(e)))
        self._n += 1
        if len(self._buf) >= RUN_EVENTS:
            self._spill()

    def _spill(self) -> None:
        self._buf.sort()  # the emission counter breaks ties: the bytes are never compared
        path = self.directory / f"run{len(self.files)}"
        with open(path, "wb") as f:
            for i in range(0, len(self._buf), 1000):
                pickle.dump(self._buf[i:i + 1000], f, protocol=pickle.HIGHEST_PROTOCOL)
        self.files.append(path)
        self._buf = []

    def merged(self) -> Iterator[bytes]:
        self._buf.sort()
        sources = [_read_run(p) for p in self.files] + [iter(self._buf)]
        for item in heapq.merge(*sources):
            yield item[3]


def _read_run(path: Path) -> Iterator[tuple]:
    with open(path, "rb") as f:
        while True:
            try:
                batch = pickle.load(f)
            except EOFError:
                return
            yield from batch
