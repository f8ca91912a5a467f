"""The engine's observation points: a tiny hook API the tracer subscribes to.

Engine code writes one line per trace point::

    if self.hooks.active: self.hooks.emit("scheduler", "SCHEDULED", request_id=rid, step=s, tokens=n)

so the cost when nobody listens is one attribute check. ``gate`` is where a step controller
may hold the engine (between steps, between schedule and execute, before a kernel launch).
The engine knows nothing of who listens.
"""
from __future__ import annotations

import threading
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable

# kinds of event
INSTANT, BEGIN, END, COUNTER, SNAPSHOT = "instant", "begin", "end", "counter", "snapshot"

Listener = Callable[[str, str, str, "str | None", "int | None", dict], None]
Gate = Callable[[str, dict], None]


class Hooks:
    def __init__(self) -> None:
        self.active = False  # True while anyone listens or gates
        self._listeners: list[Listener] = []
        self._gates: list[Gate] = []
        self._lock = threading.Lock()  # (un)subscribing may happen from any thread, at any time
        # A gate that holds the engine waits inside `with hooks.gate_wait():`. AsyncLLMEngine
        # sets it to release its engine lock, so requests can still be queued meanwhile. Only
        # the wait is wrapped: a gate that lets the engine pass costs no lock traffic.
        self.gate_wait: Callable[[], AbstractContextManager] = nullcontext

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """listener(layer, name, kind, request_id, step, attrs). Returns an unsubscribe function."""
        # copy on write: the engine thread may be iterating the old list right now
        with self._lock:
            self._listeners = [*self._listeners, listener]
            self._update()

        def unsubscribe() -> None:
            with self._lock:
                self._listeners = [x for x in self._listeners if x is not listener]
                self._update()
        return unsubscribe

    def add_gate(self, gate: Gate) -> Callable[[], None]:
        """gate(point, info) is called at each control point; to hold the engine there it
        blocks inside ``with hooks.gate_wait():``."""
        with self._lock:
            self._gates = [*self._gates, gate]
            self._update()

        def remove() -> None:
            with self._lock:
                self._gates = [x for x in self._gates if x is not gate]
                self._update()
        return remove

    def _update(self) -> None:
        self.active = bool(self._listeners or self._gates)

    def emit(self, layer: str, name: str, kind: str = INSTANT, request_id: str | None = None,
             step: int | None = None, **attrs: Any) -> None:
        for listener in self._listeners:
            listener(layer, name, kind, request_id, step, attrs)

    def gate(self, point: str, **info: Any) -> None:
        for g in self._gates:
            g(point, info)
