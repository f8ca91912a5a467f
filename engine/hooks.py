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
        self.gated = False  # True while any gate is on (a controller adds one only while armed)
        self._listeners: list[Listener] = []
        self._gates: list[Gate] = []
        self._lock = threading.Lock()  # (un)subscribing may happen from any thread, at any time
        # A gate that holds the engine waits inside `with hooks.gate_wait():`. AsyncLLMEngine
        # sets it to release its engine lock, so requests can still be queued meanwhile. Only
        # the wait is wrapped: a gate that lets the engine pass costs no lock traffic.
        self.gate_wait: Callable[[], AbstractContextManager] = nullcontext

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """listener(layer, name, kind, request_id, step, attrs). Returns an unsubscribe function."""
        return self._add("_listeners", listener)

    def add_gate(self, gate: Gate) -> Callable[[], None]:
        """gate(point, info) is called at each control point; to hold the engine there it
        blocks inside ``with hooks.gate_wait():``. Returns a function that removes it."""
        return self._add("_gates", gate)

    def _add(self, attr: str, item: Callable) -> Callable[[], None]:
        # Copy on write: the engine thread may be iterating the old list right now.
        def replace(items: Callable[[list], list]) -> None:
            with self._lock:
                setattr(self, attr, items(getattr(self, attr)))
                self._update()

        replace(lambda xs: [*xs, item])
        return lambda: replace(lambda xs: [x for x in xs if x is not item])

    def _update(self) -> None:
        self.active = bool(self._listeners or self._gates)
        self.gated = bool(self._gates)

    def emit(self, layer: str, name: str, kind: str = INSTANT, request_id: str | None = None,
             step: int | None = None, **attrs: Any) -> None:
        for listener in self._listeners:
            listener(layer, name, kind, request_id, step, attrs)

    def gate(self, point: str, **info: Any) -> None:
        for g in self._gates:
            g(point, info)
