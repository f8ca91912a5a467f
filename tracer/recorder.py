"""`--trace-file PATH`: record the event stream as JSON lines.

The bus holds each event as its line already (encoded as it was published), in one stream of
bytes, so the writer copies a batch out and writes it. A background thread drains the bus every
``poll_interval``, or as soon as a quarter of the ring (events or bytes) is pending (so the engine thread
never touches the disk), and flushes at least every ``flush_interval``: with both at most
half a second, an event reaches the OS within a second, so a crash loses at most the last
one. Lines are written whole; ``close()`` drains what is left, so the file is complete after
Ctrl-C. If the writer ever falls a whole ring behind, the loss is written into the trace as
a ``tracer events_lost`` event rather than silently skipped.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from engine.trace_names import EVENTS_LOST, TRACER
from tracer.bus import EventBus
from tracer.events import Event, decode_line, make_header


class Recorder:
    def __init__(self, bus: EventBus, path: str | Path, model: str | None = None,
                 engine_config: dict | None = None, flush_interval: float = 0.5, poll_interval: float = 0.5,
                 from_start: bool = True):
        self.bus = bus
        self.path = Path(path)
        self.flush_interval = flush_interval
        self.poll_interval = poll_interval
        self.num_written = 0
        self.num_lost = 0
        self._sub = bus.subscribe(from_start=from_start)
        self._file = open(self.path, "wb")  # lines are encoded as UTF-8 by orjson
        header = make_header(model, engine_config, start_perf_ns=bus.start_ns,
                             wall_clock_start_ns=bus.wall_clock_start_ns)
        self._file.write(json.dumps(header).encode() + b"\n")
        self._file.flush()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one writer at a time: the thread, or close()
        self.thread = threading.Thread(target=self._run, name="trace-recorder", daemon=True)  # the writer
        self.thread.start()

    def _run(self) -> None:
        # Sleep on the bus until a quarter of the ring is pending or poll_interval has passed,
        # then take everything. Rarely: each time the writer holds the interpreter lock the
        # engine thread may wait for it (polling every 50 ms cost the engine 5 % more than every
        # second, measured), and a reader woken by every publish would cost more still. The
        # quarter-ring wake-up keeps a burst (64 arrivals and their prefill, a fast decode
        # phase after an idle start-up) from lapping the writer however long it slept.
        last_flush = time.monotonic()
        wake_at, wake_bytes = max(1, self.bus.capacity // 4), max(1, self.bus.capacity_bytes // 4)
        while not self._stop.is_set():
            self.bus.wait(self._sub.cursor, self.poll_interval, min_pending=wake_at, stop=self._stop,
                          min_bytes=wake_bytes)
            while self._drain():
                pass
            if time.monotonic() - last_flush >= self.flush_interval:
                with self._lock:
                    if not self._file.closed:
                        self._file.flush()
                last_flush = time.monotonic()

    def _drain(self) -> int:
        """Write up to one batch of pending events; returns how many."""
        data, count, missed = self._sub.pull_bytes(max_events=4096)  # already encoded, one stream
        with self._lock:
            if self._file.closed:
                return 0
            if missed:
                self.num_lost += missed
                ts = decode_line(data[:data.index(b"\n") + 1]).ts_ns if count else 0
                self._file.write(Event(-1, ts, TRACER, EVENTS_LOST, attrs={"count": missed}).to_json_line())
            if count:
                self._file.write(data)
                self.num_written += count
        return count

    def flush(self) -> None:
        """Write everything published so far, and flush it to the OS."""
        while self._drain():
            pass
        with self._lock:
            if not self._file.closed:
                self._file.flush()

    def close(self) -> None:
        """Stop the thread, write what is left, close the file. Safe to call twice."""
        if self._file.closed:
            return
        self._stop.set()
        self.bus.wake_readers()  # out of its wait on the bus (which also checks _stop, so no race)
        self.thread.join(timeout=5)
        self.flush()
        with self._lock:
            os.fsync(self._file.fileno())
            self._file.close()

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
