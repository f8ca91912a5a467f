"""The step controller: pause the engine like a debugger pauses a program.

The engine calls ``hooks.gate(point, **info)`` at its control points; the controller blocks
the engine thread there (on a ``threading.Condition``) when it should stop:

    step             before each engine step                          granularity "step"   (step over)
    execute          after schedule, before execute_model (forward)  granularity "phase"  (step into)
    grammar_bitmask  after the forward, before get_grammar_bitmask   granularity "phase"
    sample_tokens    before sample_tokens                            granularity "phase"
    postprocess      after sampling, before update_from_output       granularity "phase"
    kernel           before each kernel launch                       granularity "kernel" (step kernel)
    step_end         after a step's outputs                          only for breakpoints

So ``s`` (step phase) stops at schedule -> execute_model -> grammar bitmask -> sample_tokens ->
update_from_output, the calls of vLLM 0.33's ``EngineCore.step``. A step that schedules nothing
runs no forward: it has no grammar_bitmask or sample_tokens gate.

"step phase" also stops at step boundaries (a phase is either side of one). "step kernel" runs to
the next kernel launch, whatever boundaries lie between (from a hold after the forward pass:
into the next step); only a step that launches no kernel at all stops it at that step's end.
``step_end`` exists so that a breakpoint hit late in a step (a request finishing) stops the
engine in that step, even if it was the last one.
Breakpoints and run-until match *events* (which may come from any thread: a request arriving
over HTTP is not the engine thread), so a match
only marks a hit and the engine stops at its next control point; a kernel-name breakpoint is
also matched at the kernel gate itself, to stop before that launch. Adding requests is never
gated: while the engine is held, new requests still arrive and wait.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from engine.hooks import Hooks
from engine.trace_names import KERNEL, PAUSED, RESUMED, TRACER
from tracer.conditions import Condition

GRANULARITIES = {"step": 0, "phase": 1, "kernel": 2}
POINT_LEVEL = {"step": 0, "execute": 1, "grammar_bitmask": 1, "sample_tokens": 1, "postprocess": 1, "kernel": 2,
               "step_end": 3}  # unknown: 2


@dataclass
class Stop:
    """Where and why the engine is held."""
    point: str
    step: int | None
    reason: str
    info: dict = field(default_factory=dict)


class BaseStepController(ABC):
    """The step controller's API, wherever the engine thread runs: ``StepController`` holds an
    engine in this process; ``RemoteStepController`` (tracer/remote_controller.py) commands one
    in the engine-core process. Shared here: the checks on a command's arguments, the
    breakpoints and run-until as this side knows them, the hold a caller waits for, status()."""

    def __init__(self, hooks: Hooks):
        self.hooks = hooks
        self._cond = threading.Condition()
        self._breakpoints: tuple[Condition, ...] = ()
        self._until: Condition | None = None
        self._held: Stop | None = None
        self._closed = False

    # ---- commands (any thread) -----------------------------------------------------------
    @abstractmethod
    def pause(self, reason: str = "pause") -> None:
        """Stop at the next step boundary."""

    @abstractmethod
    def resume(self) -> None:
        """Run freely: also disarms a pending run-until (and a hit not yet stopped at), which
        would otherwise hold the engine again later. Breakpoints stay."""

    @abstractmethod
    def cancel_run_until(self) -> None:
        """Disarm a pending run-until without releasing a held engine."""

    def step(self, n: int = 1, granularity: str = "step") -> None:
        """Run until n more control points of this granularity have been reached, then stop."""
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {list(GRANULARITIES)}, got {granularity!r}")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self._step(n, granularity)

    @abstractmethod
    def _step(self, n: int, granularity: str) -> None:
        """step(), its arguments checked."""

    @abstractmethod
    def run_until(self, condition: Condition) -> None:
        """Run until an event matches the condition (once), then stop."""

    def add_breakpoint(self, condition: Condition) -> None:
        with self._cond:
            self._breakpoints += (condition,)
        self._breakpoints_changed("add_breakpoint", condition)

    def remove_breakpoint(self, condition: Condition) -> None:
        with self._cond:
            self._breakpoints = tuple(b for b in self._breakpoints if b != condition)
        self._breakpoints_changed("remove_breakpoint", condition)

    def clear_breakpoints(self) -> None:
        with self._cond:
            self._breakpoints = ()
        self._breakpoints_changed("clear_breakpoints")

    @abstractmethod
    def _breakpoints_changed(self, command: str, *conditions: Condition) -> None:
        """Act on the breakpoints just changed by `command` (with its conditions)."""

    @abstractmethod
    def close(self) -> None:
        """Let the engine run freely, for good (the server is stopping). Safe to call twice."""

    # ---- what it holds (any thread) ------------------------------------------------------
    @property
    def breakpoints(self) -> tuple[Condition, ...]:
        return self._breakpoints

    @property
    def held(self) -> Stop | None:
        """Where the engine is held now, or None while it runs."""
        return self._held

    @property
    def closed(self) -> bool:
        """Detached (the server is stopping): the engine runs freely and no command holds it."""
        return self._closed

    def wait_until_paused(self, timeout: float | None = None) -> Stop | None:
        """Block until the engine is held; returns where (None on timeout)."""
        with self._cond:
            self._cond.wait_for(lambda: self._held is not None or self._closed, timeout)
            return self._held

    def status(self) -> dict:
        held = self._held
        return {"paused": held is not None, "point": held and held.point, "step": held and held.step,
                "reason": held and held.reason, "breakpoints": [str(b) for b in self._breakpoints],
                "until": str(self._until) if self._until else None, "pause_requested": self._pause_requested()}

    @abstractmethod
    def _pause_requested(self) -> bool:
        """A pause is asked for and the engine is not held yet."""


class StepController(BaseStepController):
    def __init__(self, hooks: Hooks, start_paused: bool = False):
        super().__init__(hooks)
        self._pause = "start paused" if start_paused else None  # stop at the next step boundary
        self._countdown, self._granularity = 0, "step"  # an active step(n) command
        self._launched = True  # "step kernel": the step under way launched a kernel (or began before the command)
        self._hit: str | None = None  # a matched condition, waiting for the next control point
        self._release_gen = 0  # bumped on every release, so a held gate knows it may go
        self._kernel_gates = False  # seen a kernel gate: kernel conditions are matched there
        self._unsubscribe = None  # events are watched only while a condition is armed (_watch)
        self._remove_gate = None  # the gate is on the engine only while it may stop there (_watch)
        with self._cond:
            self._watch()

    # ---- commands (any thread) -----------------------------------------------------------
    def pause(self, reason: str = "pause") -> None:
        with self._cond:
            self._pause = reason
            self._watch()

    def resume(self) -> None:
        with self._cond:
            self._pause, self._countdown, self._until, self._hit = None, 0, None, None
            self._release()

    def cancel_run_until(self) -> None:
        with self._cond:
            self._until = None
            self._watch()

    def _step(self, n: int, granularity: str) -> None:
        with self._cond:
            self._pause, self._countdown, self._granularity, self._launched = None, n, granularity, True
            self._release()  # (which gates the engine again: the countdown is armed)

    def run_until(self, condition: Condition) -> None:
        with self._cond:
            self._pause, self._countdown, self._until = None, 0, condition
            self._watch()
            self._release()

    def _breakpoints_changed(self, command: str, *conditions: Condition) -> None:
        with self._cond:
            self._watch()

    def hit(self, reason: str, until: Condition | None = None) -> None:
        """A condition matched somewhere the engine's hooks do not see (the API-server process,
        for a controller in the engine-core process): stop at the next control point. until:
        the run-until condition that matched, consumed as if matched here."""
        with self._cond:
            if until is not None and self._until == until:
                self._until = None
            self._hit = reason
            self._watch()

    @property
    def release_gen(self) -> int:
        """Bumped by every release: a hold reported with an older one is over."""
        return self._release_gen

    def _pause_requested(self) -> bool:
        return self._pause is not None

    def close(self) -> None:
        if self._closed:
            return
        with self._cond:
            self._breakpoints, self._until, self._pause, self._countdown, self._hit = (), None, None, 0, None
            self._closed = True
            self._release()

    def _watch(self) -> None:  # holding self._cond
        """Be on the engine's hooks only while needed. The gate, while anything may stop the
        engine (a pause or step command, a pending hit, an armed condition); the event listener,
        while a condition is armed. Running freely, the engine pays for neither: twelve gate
        calls and some forty events a step would each cost one more call that does nothing."""
        gated = not self._closed and bool(self._pause or self._countdown or self._hit or self._until
                                          or self._breakpoints)
        listening = not self._closed and bool(self._breakpoints or self._until)
        if gated and self._remove_gate is None:
            self._remove_gate = self.hooks.add_gate(self._gate)
        elif not gated and self._remove_gate is not None:
            self._remove_gate, remove = None, self._remove_gate
            remove()  # a gate holding the engine right now still waits for its release
        if listening and self._unsubscribe is None:
            self._unsubscribe = self.hooks.subscribe(self._on_event)
        elif not listening and self._unsubscribe is not None:
            self._unsubscribe, unsubscribe = None, self._unsubscribe
            unsubscribe()

    def _release(self) -> None:  # holding self._cond
        self._held = None
        self._release_gen += 1
        self._cond.notify_all()
        self._watch()

    # ---- the engine side -----------------------------------------------------------------
    def _gate(self, point: str, info: dict) -> None:
        # Nothing armed, the usual case while it runs: no lock (twelve gates a step). A command
        # racing this read is seen at the next control point, as it would be with the lock.
        if not (self._pause or self._countdown or self._hit or self._until or self._breakpoints):
            if point == "kernel":
                self._kernel_gates = True
            return
        with self._cond:
            reason = None if self._closed else self._stop_reason(point, info)
            if reason is None:
                return
            self._held = Stop(point, info.get("step"), reason, dict(info))
            gen = self._release_gen
            self._cond.notify_all()
        details = {k: v for k, v in info.items() if k != "step"}  # nested: a kernel's info has a "name"
        if self.hooks.active:
            self.hooks.emit(TRACER, PAUSED, step=info.get("step"), point=point, reason=reason, info=details, gen=gen)
        with self.hooks.gate_wait(), self._cond:  # parked: the engine lock is free meanwhile
            self._cond.wait_for(lambda: self._release_gen != gen or self._closed)
        if self.hooks.active:
            self.hooks.emit(TRACER, RESUMED, step=info.get("step"), point=point)

    def _stop_reason(self, point: str, info: dict) -> str | None:  # holding self._cond
        level = POINT_LEVEL.get(point, 2)
        if point == "kernel":
            self._kernel_gates = True
            reason = self._match((KERNEL, info.get("name", ""), None))
            if reason:
                return reason
        if self._hit is not None:
            reason, self._hit = self._hit, None
            return reason
        if self._pause is not None and level == 0:
            reason, self._pause = self._pause, None
            return reason
        if self._countdown and self._counts(point, level):
            self._countdown -= 1
            if self._countdown == 0:
                return f"step {self._granularity}"
        return None

    def _counts(self, point: str, level: int) -> bool:  # holding self._cond
        """Does the active step command count this control point?"""
        if self._granularity != "kernel":
            return level <= GRANULARITIES[self._granularity]
        if point == "step":
            self._launched = False
        elif point == "kernel":
            self._launched = True
            return True
        return point == "step_end" and not self._launched  # a step with no launch: stop rather than run on

    def _on_event(self, layer: str, name: str, kind: str, request_id, step, attrs) -> None:
        if not (self._breakpoints or self._until) or layer == TRACER:
            return
        if layer == KERNEL and self._kernel_gates:
            return  # already matched before the launch, at its gate
        with self._cond:
            reason = self._match((layer, name, request_id, attrs))
            if reason:
                self._hit = reason
            self._watch()  # a hit needs the gate; a consumed run-until, perhaps no listener

    def _match(self, event: tuple[str, str, str | None, dict | None]) -> str | None:  # holding self._cond
        if self._until is not None and self._until.matches(*event):
            until, self._until = self._until, None  # (callers _watch() once the hit is kept)
            return f"until {until}"
        for bp in self._breakpoints:
            if bp.matches(*event):
                return f"breakpoint {bp}"
        return None
