"""The step controller across the process boundary.

The gates that hold the engine run where the engine thread runs: in the engine-core process.
There, ``install_in_core`` (called by EngineCoreProc at startup) puts a ``StepController`` on
the core's hooks and offers it as the utility call "control". Here, in the API-server process,
``RemoteStepController`` has StepController's public API (pause, resume, step, run_until,
breakpoints, held, status, wait_until_paused, close) and forwards each command:

* Commands are utility calls that wait for the core's answer, so an error (a bad
  granularity) is raised here and the order of commands is kept.
* ``held`` mirrors the core's ``tracer paused`` / ``resumed`` events, which reach this process's
  hooks like every core event. Each hold carries the core's release generation; a command that
  releases the engine answers with the new one, and a hold reported with an older generation
  is over (however the answer and the events interleave on the way).
* Conditions that name this process's layers (http, api, tokenizer, detokenizer, cli) are
  matched here, on this process's events, and the core is told of the hit; all others are
  matched in the core, before its next control point, as in one process.
"""
from __future__ import annotations

import threading

from engine.hooks import Hooks
from engine.trace_names import FRONTEND_LAYERS, PAUSED, RESUMED, TRACER
from tracer.conditions import Condition
from tracer.controller import GRANULARITIES, StepController, Stop

CORE_INSTALL = "tracer.remote_controller:install_in_core"


def _wire(cond: Condition) -> list:
    return [cond.layer, cond.name, list(cond.names), cond.request_id, cond.label]


def _unwire(fields: list) -> Condition:
    layer, name, names, request_id, label = fields
    return Condition(layer, name, tuple(names), request_id, label)


def install_in_core(hooks: Hooks, core, options: dict) -> dict:
    """In the engine-core process: the StepController on the core's hooks, as utility "control"."""
    if not options.get("control"):
        return {}
    controller = StepController(hooks, bool(options.get("start_paused")))

    def control(method: str, *args) -> dict:
        if method in ("run_until", "add_breakpoint", "remove_breakpoint"):
            getattr(controller, method)(_unwire(args[0]))
        elif method == "hit":
            controller.hit(args[0], _unwire(args[1]) if args[1] else None)
        elif method in ("pause", "resume", "step", "cancel_run_until", "clear_breakpoints", "close"):
            getattr(controller, method)(*args)
        elif method != "status":
            raise ValueError(f"unknown control command {method!r}")
        return {"status": controller.status(), "gen": controller.release_gen}

    return {"control": control}


class RemoteStepController:
    """StepController's public API for a controller in the engine-core process (see the module
    docstring). Commands given before bind() (the TUI during startup) are sent at bind()."""

    def __init__(self, hooks: Hooks, start_paused: bool = False):
        self.hooks = hooks
        self.start_paused = start_paused  # passed to the core's controller at its start
        self._client = None
        self._backlog: list[tuple] = []
        self._cond = threading.Condition()
        self._held: Stop | None = None
        self._held_gen = -1
        self._min_gen = 0  # holds reported with an older release generation are over
        self._breakpoints: tuple[Condition, ...] = ()
        self._until: Condition | None = None
        self._status: dict = {"until": None, "pause_requested": start_paused}
        self._closed = False
        self._unsubscribe = hooks.subscribe(self._on_event)

    def bind(self, client) -> None:
        """Connect to the core (an MPClient whose core installed CORE_INSTALL)."""
        self._client = client
        backlog, self._backlog = self._backlog, []
        for method, args in backlog:
            self._call(method, *args)

    # ---- commands (any thread) -------------------------------------------------------------
    def pause(self, reason: str = "pause") -> None:
        """Stop at the next step boundary."""
        self._call("pause", reason)

    def resume(self) -> None:
        """Run freely: also disarms a pending run-until (as StepController.resume). Breakpoints stay."""
        self._until = None
        self._call("resume")

    def cancel_run_until(self) -> None:
        """Disarm a pending run-until without releasing a held engine."""
        self._until = None
        self._call("cancel_run_until")

    def step(self, n: int = 1, granularity: str = "step") -> None:
        """Run until n more control points of this granularity have been reached, then stop."""
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {list(GRANULARITIES)}, got {granularity!r}")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self._call("step", n, granularity)

    def run_until(self, condition: Condition) -> None:
        """Run until an event matches the condition (once), then stop."""
        self._until = condition
        self._call("run_until", _wire(condition))

    def add_breakpoint(self, condition: Condition) -> None:
        self._breakpoints += (condition,)
        self._call("add_breakpoint", _wire(condition))

    def remove_breakpoint(self, condition: Condition) -> None:
        self._breakpoints = tuple(b for b in self._breakpoints if b != condition)
        self._call("remove_breakpoint", _wire(condition))

    def clear_breakpoints(self) -> None:
        self._breakpoints = ()
        self._call("clear_breakpoints")

    @property
    def breakpoints(self) -> tuple[Condition, ...]:
        return self._breakpoints

    @property
    def held(self) -> Stop | None:
        """Where the engine is held now, or None while it runs (as last reported by the core)."""
        return self._held

    def wait_until_paused(self, timeout: float | None = None) -> Stop | None:
        """Block until the engine is held; returns where (None on timeout)."""
        with self._cond:
            self._cond.wait_for(lambda: self._held is not None or self._closed, timeout)
            return self._held

    def status(self) -> dict:
        held = self._held
        return {"paused": held is not None, "point": held and held.point, "step": held and held.step,
                "reason": held and held.reason, "breakpoints": [str(b) for b in self._breakpoints],
                "until": str(self._until) if self._until else None,
                "pause_requested": bool(self._status.get("pause_requested")) and held is None}

    @property
    def closed(self) -> bool:
        """Detached (the server is stopping): the engine runs freely and no command holds it."""
        return self._closed

    def close(self) -> None:
        """Let the engine run freely and stop mirroring it. Safe to call twice."""
        if self._closed:
            return
        self._breakpoints, self._until = (), None
        try:
            if self._client is not None and self._client.dead is None:
                self._call("close")
        except Exception:  # the core is gone or going: it runs freely anyway
            pass
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._unsubscribe()

    # ---- plumbing ----------------------------------------------------------------------------
    def _call(self, method: str, *args) -> None:
        if self._client is None:
            self._backlog.append((method, args))
            if method == "pause":
                self._status["pause_requested"] = True
            return
        answer = self._client.call("control", method, *args)
        with self._cond:
            self._status = answer["status"]
            if self._status.get("until") is None:
                self._until = None
            self._min_gen = max(self._min_gen, answer["gen"])
            if self._held is not None and self._held_gen < self._min_gen:
                self._held = None
            self._cond.notify_all()

    def _on_event(self, layer: str, name: str, kind: str, request_id, step, attrs) -> None:
        if layer == TRACER:
            if name == PAUSED and attrs.get("gen", 0) >= self._min_gen:
                with self._cond:
                    self._held = Stop(attrs.get("point"), step, attrs.get("reason"), dict(attrs.get("info") or {}))
                    self._held_gen = attrs.get("gen", 0)
                    if str(self._held.reason).startswith("until "):
                        self._until = None
                    self._cond.notify_all()
            elif name == RESUMED:
                with self._cond:
                    self._held = None
                    self._cond.notify_all()
            return
        if layer not in FRONTEND_LAYERS or not (self._breakpoints or self._until) or self._client is None:
            return
        until = self._until
        if until is not None and until.matches(layer, name, request_id):
            self._until = None
            self._client.call("control", "hit", f"until {until}", _wire(until), wait=False)
            return
        for bp in self._breakpoints:
            if bp.matches(layer, name, request_id):
                self._client.call("control", "hit", f"breakpoint {bp}", None, wait=False)
                return
