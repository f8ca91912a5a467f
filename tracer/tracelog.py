"""Plain-text trace: one readable ``[TRACE] layer name key=value ...`` line per event.

Used by ``vllm-trace serve --no-tui --trace-log``: a background thread prints what the bus
carries, filtered by layer, so printing never slows the engine thread.
"""
from __future__ import annotations

import sys
import threading
from typing import Iterable, TextIO

from engine.hooks import INSTANT
from tracer.bus import EventBus
from tracer.events import LAYERS, Event

POLL_INTERVAL = 0.05  # seconds
MAX_ITEMS = 8  # longer lists are shown as their first items and a count
MAX_CHARS = 60
BULKY = {"config", "waiting", "running", "scheduled", "pieces", "params"}  # summarised, not printed whole


def format_value(v) -> str:
    if isinstance(v, str):
        s = v if len(v) <= MAX_CHARS else v[:MAX_CHARS] + "…"
        return repr(s) if (not s or any(c.isspace() or c in "='\"" for c in s)) else s
    if isinstance(v, (list, tuple)):
        items = ",".join(format_value(x) for x in v[:MAX_ITEMS])
        return f"[{items}" + (f",…+{len(v) - MAX_ITEMS}]" if len(v) > MAX_ITEMS else "]")
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{format_value(x)}" for k, x in list(v.items())[:MAX_ITEMS]) + \
            (",…}" if len(v) > MAX_ITEMS else "}")
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def format_event(ev: Event) -> str:
    """'[TRACE] scheduler PREEMPTED step=12 request=7 reason='no free blocks for 3''"""
    parts = ["[TRACE]", ev.layer, ev.name]
    if ev.kind != INSTANT:
        parts.append(f"({ev.kind})")
    if ev.step is not None:
        parts.append(f"step={ev.step}")
    if ev.request_id is not None:
        parts.append(f"request={ev.request_id}")
    for k, v in (ev.attrs or {}).items():
        if k in BULKY and isinstance(v, (list, dict)):
            parts.append(f"{k}=<{len(v)}>")
        else:
            parts.append(f"{k}={format_value(v)}")
    return " ".join(parts)


def check_layers(layers: Iterable[str] | None) -> frozenset[str] | None:
    if layers is None:
        return None
    layers = frozenset(layers)
    unknown = layers - set(LAYERS)
    if unknown:
        raise ValueError(f"unknown layer(s) {', '.join(sorted(unknown))}; layers are {', '.join(LAYERS)}")
    return layers


class TraceLog:
    """Print the bus's events as [TRACE] lines until close()."""

    def __init__(self, bus: EventBus, stream: TextIO | None = None, layers: Iterable[str] | None = None,
                 from_start: bool = True):
        self.bus = bus
        self.stream = stream or sys.stderr
        self.layers = check_layers(layers)
        self._sub = bus.subscribe(from_start=from_start)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trace-log", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(POLL_INTERVAL):  # polled, not woken per event (see recorder)
            while self._print(self._sub.pull(max_events=1024)):
                pass

    def _print(self, pulled) -> int:
        if pulled.missed:
            print(f"[TRACE] tracer events_lost count={pulled.missed}", file=self.stream)
        lines = [format_event(ev) for ev in pulled.events if self.layers is None or ev.layer in self.layers]
        if lines:
            self.stream.write("\n".join(lines) + "\n")
            self.stream.flush()
        return len(pulled.events)

    def close(self) -> None:
        """Print what is left and stop."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        while self._sub.pending:
            self._print(self._sub.pull())


def start_trace_log(bus: EventBus, stream: TextIO | None = None, layers: Iterable[str] | None = None) -> TraceLog:
    """What `--trace-log [--trace-layers ...]` calls: print every (or the chosen layers') event."""
    return TraceLog(bus, stream, layers)
