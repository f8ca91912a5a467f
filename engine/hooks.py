"""The engine's observation points: a tiny hook API the tracer subscribes to.

Engine code guards each trace point, with the call on its own lines (or in a ``_trace_*``
helper), and names layers and events from ``engine.trace_names``::

    if self.hooks.active:
        self.hooks.emit(SCHEDULER, SCHEDULED, request_id=rid, step=s, tokens=n)

so the cost when nobody listens is one attribute check. ``gate`` is where a step controller
may hold the engine (between steps, between schedule and execute, before a kernel launch);
engine code calls it after ``if self.hooks.gated:``, so a running engine
makes no gate calls while nobody could stop it.
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
        self._many: list[Callable[[list[tuple]], None]] = []  # each listener's batch form (emit_many)
        self._gates: list[Gate] = []
        self._lock = threading.Lock()  # (un)subscribing may happen from any thread, at any time
        # A gate that holds the engine waits inside `with hooks.gate_wait():`. BusyLoop
        # sets it to release its engine lock, so requests can still be queued meanwhile. Only
        # the wait is wrapped: a gate that lets the engine pass costs no lock traffic.
        self.gate_wait: Callable[[], AbstractContextManager] = nullcontext

    def subscribe(self, listener: Listener, many: Callable[..., None] | None = None) -> Callable[[], None]:
        """listener(layer, name, kind, request_id, step, attrs) for each event. many(events, at_ns),
        if given, takes emit_many's events in one call (each the same six values, as a tuple);
        without it, listener is called for each of them. Returns an unsubscribe function."""
        return self._add(_listeners=listener,
                         _many=many or (lambda events, at_ns=None: [listener(*e) for e in events]))

    def add_gate(self, gate: Gate) -> Callable[[], None]:
        """gate(point, info) is called at each control point; to hold the engine there it
        blocks inside ``with hooks.gate_wait():``. Returns a function that removes it."""
        return self._add(_gates=gate)

    def _add(self, **items: Callable) -> Callable[[], None]:
        # Copy on write: the engine thread may be iterating the old lists right now.
        def replace(update: Callable[[list, Callable], list]) -> None:
            with self._lock:
                for attr, item in items.items():
                    setattr(self, attr, update(getattr(self, attr), item))
                self._update()

        replace(lambda xs, item: [*xs, item])
        return lambda: replace(lambda xs, item: [x for x in xs if x is not item])

    def _update(self) -> None:
        self.active = bool(self._listeners or self._gates)
        self.gated = bool(self._gates)

    def emit(self, layer: str, name: str, kind: str = INSTANT, /, request_id: str | None = None,
             step: int | None = None, **attrs: Any) -> None:
        # layer, name and kind are positional-only: CPython matches each attribute keyword
        # against every parameter name that may be given by keyword, by value, on every call
        for listener in self._listeners:
            listener(layer, name, kind, request_id, step, attrs)

    def emit_many(self, events: list[tuple], at_ns: list[int] | None = None) -> None:
        """Several events at once, in order, each a tuple (layer, name, kind, request_id, step,
        attrs): a step's new tokens, one event per request, cost one call per listener. at_ns:
        when each happened (time.perf_counter_ns()), for events reported after the fact (a
        step's kernel launches, published once its forward pass is done); default: now."""
        for many in self._many:
            many(events, at_ns)

    def gate(self, point: str, **info: Any) -> None:
        for g in self._gates:
            g(point, info)
