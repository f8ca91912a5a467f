"""The step controller across the process boundary.

The gates that hold the engine run where the engine thread runs: in the engine-core process.
There, ``install_in_core`` (called by EngineCoreProc at startup) puts a ``StepController`` on
the core's hooks and offers it as the utility call "control". Here, in the API-server process,
``RemoteStepController`` is a ``BaseStepController`` as StepController is (pause, resume, step,
run_until, breakpoints, held, status, wait_until_paused, close) and forwards each command:

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

from engine.hooks import Hooks
from engine.trace_names import FRONTEND_LAYERS, PAUSED, RESUMED, TRACER
from tracer.conditions import Condition
from tracer.controller import BaseStepController, StepController, Stop

CORE_INSTALL = "tracer.remote_controller:install_in_core"


def _wire(cond: Condition) -> list:
    return [cond.layer, cond.name, list(cond.names), cond.request_id, cond.label,
            list(cond.expert) if cond.expert else None]


def _unwire(fields: list) -> Condition:
    layer, name, names, request_id, label, expert = fields
    return Condition(layer, name, tuple(names), request_id, label, tuple(expert) if expert else None)


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


class RemoteStepController(BaseStepController):
    """The step controller for an engine in the engine-core process (see the module docstring).
    Commands given before bind() (the TUI during startup) are sent at bind()."""

    def __init__(self, hooks: Hooks, start_paused: bool = False):
        super().__init__(hooks)
        self.start_paused = start_paused  # passed to the core's controller at its start
        self._client = None
        self._backlog: list[tuple] = []
        self._held_gen = -1
        self._min_gen = 0  # holds reported with an older release generation are over
        self._status: dict = {"until": None, "pause_requested": start_paused}
        self._unsubscribe = hooks.subscribe(self._on_event)

    def bind(self, client) -> None:
        """Connect to the core (an MPClient whose core installed CORE_INSTALL)."""
        self._client = client
        backlog, self._backlog = self._backlog, []
        for method, args in backlog:
            self._call(method, *args)

    # ---- commands (any thread) -------------------------------------------------------------
    def pause(self, reason: str = "pause") -> None:
        self._call("pause", reason)

    def resume(self) -> None:
        self._until = None
        self._call("resume")

    def cancel_run_until(self) -> None:
        self._until = None
        self._call("cancel_run_until")

    def _step(self, n: int, granularity: str) -> None:
        self._call("step", n, granularity)

    def run_until(self, condition: Condition) -> None:
        self._until = condition
        self._call("run_until", _wire(condition))

    def _breakpoints_changed(self, command: str, *conditions: Condition) -> None:
        self._call(command, *map(_wire, conditions))

    def _pause_requested(self) -> bool:  # (as the core last reported it)
        return bool(self._status.get("pause_requested")) and self._held is None

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
        if until is not None and until.matches(layer, name, request_id, attrs):
            self._until = None
            self._client.call("control", "hit", f"until {until}", _wire(until), wait=False)
            return
        for bp in self._breakpoints:
            if bp.matches(layer, name, request_id, attrs):
                self._client.call("control", "hit", f"breakpoint {bp}", None, wait=False)
                return
