"""msgpack encoding of the core's messages (msgspec), the trace-event shipper, and the send
that both ends of a PUSH socket to another process use (``send_while_alive``).

Trace events cross the process boundary as plain tuples inside ``EngineCoreOutputs``; their
attrs are almost always plain data already. What msgpack cannot say (a torch.Size, a dtype, a
set, an enum) is converted by ``_enc_hook``, as the tracer's ``json_safe`` does for the file.
"""
from __future__ import annotations

import enum
import os
import subprocess
import time
from collections import deque
from itertools import repeat
from typing import Any

import msgspec
import zmq

from engine.engine.core_types import EngineCoreOutputs
from engine.hooks import Hooks


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (set, frozenset, tuple)) or type(obj).__name__ == "Size":
        return list(obj)
    if hasattr(obj, "tolist"):  # a tensor or an array
        return obj.tolist()
    return str(obj)  # a dtype, a path, ...


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def outputs_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineCoreOutputs)


SEND_POLL_MS = 50  # a send that finds no room (the peer busy, or gone) checks the process this often


def send_while_alive(sock: zmq.Socket, frames, proc: subprocess.Popen | None, copy: bool = True) -> int | None:
    """Send frames on a PUSH socket whose peer is the process proc; returns None once sent, or
    proc's exit code if it died first. A plain send would block for ever once the peer is gone
    (a PUSH socket with no peer never has room), on whatever thread, holding whatever lock.
    Without a process (not started yet) it waits for room as a plain send does."""
    while True:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK, copy=copy)
            return None
        except zmq.Again:
            code = proc.poll() if proc is not None else None
            if code is not None:
                return code
            sock.poll(SEND_POLL_MS, zmq.POLLOUT)


class EventShipper:
    """Collects the core's trace events for the front end: (layer, name, kind, request_id, step,
    attrs + pid, perf_counter_ns). Subscribed only while the front end traces, so an untraced
    core pays nothing (hooks.active stays False). Any thread may emit; ``take`` hands over what
    was collected so far, in order (a deque: appends and pops need no lock)."""

    def __init__(self, hooks: Hooks):
        self.pid = os.getpid()
        self._events: deque[tuple] = deque()
        self._unsubscribe = hooks.subscribe(self._on_event, self._on_many)

    def _on_event(self, layer, name, kind, request_id, step, attrs) -> None:
        attrs.setdefault("pid", self.pid)  # a fresh dict: emit() built it from keywords
        self._events.append((layer, name, kind, request_id, step, attrs, time.perf_counter_ns()))

    def _on_many(self, events: list[tuple], at_ns: list[int] | None = None) -> None:
        # Every emit_many in a core or worker process passes each event a dict of its own, so the pid
        # goes into it rather than into a copy (0.4 us of the engine's thread an event, measured; a step's
        # launches come this way); a worker's events, re-emitted by the core, keep the worker's pid
        append, pid = self._events.append, self.pid
        for (layer, name, kind, request_id, step, attrs), at in zip(events, at_ns or repeat(time.perf_counter_ns())):
            if not attrs:
                attrs = {"pid": pid}
            elif "pid" not in attrs:
                attrs["pid"] = pid
            append((layer, name, kind, request_id, step, attrs, at))

    def take(self) -> list[tuple]:
        popleft = self._events.popleft
        return [popleft() for _ in range(len(self._events))]

    def __len__(self) -> int:
        return len(self._events)

    def close(self) -> None:
        self._unsubscribe()
