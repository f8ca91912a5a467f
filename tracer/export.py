"""Export a trace as Chrome trace-event JSON (opens in ui.perfetto.dev and chrome://tracing).

    one async track per request   "request R" with nested queued / prefill / decode (b/e)
    thread "engine steps"         one X slice per step (its batch in args), schedule / execute /
                                  postprocess nested inside
    thread "kernels"              one X slice per kernel launch (grid, meta in args); with tensor
                                  parallelism one thread per rank ("kernels rank R"), all_reduce
                                  and all_gather among its launches
    thread per other layer        its begin/end spans (startup stages, HTTP handlers, ...); a
                                  worker's per rank ("worker rank R")
    counters                      vllm:num_requests_waiting / _running, vllm:kv_cache_usage_perc
    M events                      process and thread names

Timestamps are microseconds from the start of the trace.
"""
from __future__ import annotations

import json
from pathlib import Path

from engine.hooks import BEGIN, END, SNAPSHOT
from engine.trace_names import (
    ABORTED,
    API,
    BATCH,
    CLI,
    DETOKENIZER,
    ENGINE,
    FINISHED,
    HTTP,
    KERNEL,
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
from tracer.events import Event, json_safe, read_trace

PID = 1
STEPS_TID, KERNELS_TID = 1, 2
LAYER_TIDS = {CLI: 10, HTTP: 11, API: 12, ENGINE: 13, TRACER: 14}  # other layers' spans
RANK_KERNELS_TID, RANK_WORKER_TID = 100, 200  # + rank: tensor-parallel ranks > 0, and workers


def _us(ns: int) -> float:
    return ns / 1000.0


class _Builder:
    def __init__(self) -> None:
        self.out: list[dict] = []
        self.threads: dict[int, str] = {STEPS_TID: "engine steps", KERNELS_TID: "kernels"}

    def x(self, tid: int, name: str, begin_ns: int, end_ns: int, args: dict | None = None, cat: str = ENGINE):
        self.out.append({"ph": "X", "pid": PID, "tid": tid, "name": name, "cat": cat, "ts": _us(begin_ns),
                         "dur": max(0.0, _us(end_ns - begin_ns)), "args": args or {}})

    def async_(self, ph: str, cat: str, aid: str, name: str, ts_ns: int, args: dict | None = None):
        self.out.append({"ph": ph, "pid": PID, "tid": STEPS_TID, "cat": cat, "id": aid, "name": name,
                         "ts": _us(ts_ns), "args": args or {}})

    def counter(self, name: str, ts_ns: int, value: float):
        self.out.append({"ph": "C", "pid": PID, "tid": STEPS_TID, "name": name, "ts": _us(ts_ns),
                         "args": {"value": value}})


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


def to_chrome_trace(header: dict, events: list[Event]) -> dict:
    b = _Builder()
    tracks: dict[str, _RequestTrack] = {}
    open_spans: dict[tuple, Event] = {}  # (layer, name, request_id) -> its BEGIN
    step_begin: dict[int, int] = {}
    step_marks: dict[int, dict] = {}  # step -> ts of its phase boundaries, and its batch
    kernel_end: dict[int, int] = {}  # rank -> where its track's last launch ended
    last_ts = events[-1].ts_ns if events else 0

    for ev in events:
        a = ev.attrs or {}
        rank = a.get("rank") or 0
        key = (ev.layer, ev.name, ev.request_id, rank)
        rid = ev.request_id
        # ---- requests
        if (ev.layer, ev.name) == (ENGINE, QUEUED):
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
        # ---- steps and their phases
        elif (ev.layer, ev.name) == (ENGINE, STEP) and ev.step is not None:
            if ev.kind == BEGIN:
                step_begin[ev.step] = ev.ts_ns
                step_marks[ev.step] = {}
            elif ev.kind == END and ev.step in step_begin:
                _step_slices(b, ev.step, step_begin.pop(ev.step), ev.ts_ns, step_marks.pop(ev.step, {}))
                _counters(b, ev.ts_ns, a.get("stats", {}))
        elif ev.layer == SCHEDULER and ev.name == SCHEDULE and ev.step in step_marks:
            step_marks[ev.step][ev.kind] = ev.ts_ns
            if ev.kind == SNAPSHOT:
                step_marks[ev.step]["snapshot"] = a
                _counters(b, ev.ts_ns, a.get("stats", {}))
        elif ev.layer in (MODEL_RUNNER, SAMPLER) and ev.step in step_marks and not a.get("rank"):
            step_marks[ev.step][ev.name] = (ev.ts_ns, a)  # rank 0's: every rank samples the same
        # ---- kernels: an instant (with duration_ns, emitted when the launch ended) or a span
        elif ev.layer == KERNEL:
            if ev.kind == BEGIN:
                open_spans[key] = ev
                continue
            start = open_spans.pop(key).ts_ns if ev.kind == END and key in open_spans else \
                ev.ts_ns - int(a.get("duration_ns") or 0)
            start = max(start, kernel_end.get(rank, 0))  # one launch after another on this track
            kernel_end[rank] = max(ev.ts_ns, start)
            tid = RANK_KERNELS_TID + rank if rank else KERNELS_TID
            if rank:
                b.threads[KERNELS_TID], b.threads[tid] = "kernels rank 0", f"kernels rank {rank}"
            b.x(tid, ev.name, start, kernel_end[rank], json_safe(dict(a, step=ev.step)), cat=KERNEL)
        # ---- any other layer's spans (startup stages, HTTP handlers, ...)
        elif ev.kind == BEGIN:
            open_spans[key] = ev
        elif ev.kind == END and key in open_spans:
            begin = open_spans.pop(key)
            if ev.layer == WORKER:
                tid, b.threads[RANK_WORKER_TID + rank] = RANK_WORKER_TID + rank, f"worker rank {rank}"
            else:
                tid = LAYER_TIDS.get(ev.layer, 20 + len(LAYER_TIDS))
                b.threads[tid] = f"{ev.layer} spans"
            b.x(tid, ev.name + (f" {rid}" if rid else ""), begin.ts_ns, ev.ts_ns, dict(a), cat=ev.layer)

    for track in tracks.values():  # the trace ended with these requests unfinished
        track.close(last_ts, {"finish_reason": None})
    body = sorted(b.out, key=lambda e: (e["ts"], -e.get("dur", 0)))  # stable: b/e order kept at equal ts
    meta = [{"ph": "M", "pid": PID, "tid": 0, "name": "process_name",
             "args": {"name": f"vllm-trace {header.get('model') or ''}".strip()}}]
    meta += [{"ph": "M", "pid": PID, "tid": tid, "name": "thread_name", "args": {"name": name}}
             for tid, name in sorted(b.threads.items())]
    return {"traceEvents": meta + body, "displayTimeUnit": "ms",
            "otherData": {k: header.get(k) for k in ("model", "wall_clock_start", "version")}}


def _step_slices(b: _Builder, step: int, begin: int, end: int, marks: dict) -> None:
    snap = marks.get("snapshot", {})
    batch = marks.get(BATCH, (None, {}))[1]
    keys = ("scheduled", "num_scheduled_tokens", "total_num_scheduled_tokens", "token_budget", "admitted", "preempted")
    args = {k: snap.get(k) for k in keys}
    args["batch"] = batch
    b.x(STEPS_TID, f"step {step}", begin, end, args)
    sched_end = marks.get(END, marks.get(SNAPSHOT))
    if BEGIN in marks and sched_end is not None:
        b.x(STEPS_TID, SCHEDULE, marks[BEGIN], sched_end, {"waiting_reasons": snap.get("waiting_reasons")})
    if SAMPLED in marks and sched_end is not None:
        sampled_ts, sampled = marks[SAMPLED]
        b.x(STEPS_TID, "execute", sched_end, sampled_ts, {"num_tokens": len(batch.get("input_ids", []))})
        b.x(STEPS_TID, "postprocess", sampled_ts, end, {"token_ids": sampled.get("token_ids")})


def _counters(b: _Builder, ts_ns: int, stats: dict) -> None:
    if "num_waiting" in stats:
        b.counter("vllm:num_requests_waiting", ts_ns, stats["num_waiting"])
        b.counter("vllm:num_requests_running", ts_ns, stats["num_running"])
        b.counter("vllm:kv_cache_usage_perc", ts_ns, round(stats.get("kv_cache_usage", 0.0), 6))


def export_perfetto(trace_path: str | Path, out_path: str | Path) -> dict:
    """Read a recorded trace, write its Chrome trace JSON; returns the JSON object."""
    header, events = read_trace(trace_path)
    chrome = to_chrome_trace(header, events)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(chrome, f)
    return chrome
