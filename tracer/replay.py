"""Replay a recorded trace, forward and backward (time travel).

The state at a position is, by definition, ``fold`` applied to the events before it, so
going back can never disagree with going forward. To make going back cheap, the state is
copied every ``checkpoint_every`` steps; ``goto`` restores the nearest checkpoint at or
before the target and folds forward from there.

"At step k" means after the last event of step k: its ``engine step END`` and the events
stamped with step k that follow it at once (the front end's NEW_TOKENS: it detokenizes after
the core finished the step). The step's schedule snapshot, batch, kernel launches, sampled
tokens and the text so far are all in view.
``seek(index)`` gives the finer positions (between phases, between kernels).
"""
from __future__ import annotations

import bisect
from pathlib import Path

from engine.hooks import END
from engine.trace_names import ENGINE, STEP
from tracer.events import Event, read_trace
from tracer.state import TraceState, fold


class Replay:
    def __init__(self, header: dict, events: list[Event], checkpoint_every: int = 16):
        self.header = header
        self.events = events
        self.checkpoint_every = max(1, checkpoint_every)
        # the index just past each step's END (a step cut off by the end of the trace ends there)
        self._step_end: dict[int, int] = {}
        for i, ev in enumerate(events):
            if ev.layer == ENGINE and ev.name == STEP and ev.step is not None:
                end = i + 1
                while ev.kind == END and end < len(events) and events[end].step == ev.step:
                    end += 1  # the step's NEW_TOKENS, from the front end
                self._step_end[ev.step] = end if ev.kind == END else len(events)
        self.steps: list[int] = sorted(self._step_end)
        self._ends = [self._step_end[k] for k in self.steps]  # ascending: steps run in order
        self._checkpoints: dict[int, TraceState] = {0: TraceState()}  # event index -> state there
        self._checkpoint_at = {self._step_end[k] for k in self.steps[::self.checkpoint_every]}
        self.position = 0
        self.state = TraceState()

    @classmethod
    def load(cls, path: str | Path, checkpoint_every: int = 16) -> "Replay":
        header, events = read_trace(path)
        return cls(header, events, checkpoint_every)

    @property
    def step(self) -> int | None:
        return self.state.step

    def seek(self, index: int) -> TraceState:
        """The state after the first `index` events."""
        index = max(0, min(index, len(self.events)))
        if index < self.position:
            start = max(i for i in self._checkpoints if i <= index)
            self.state, self.position = self._checkpoints[start].clone(), start
        while self.position < index:
            fold(self.state, self.events[self.position])
            self.position += 1
            if self.position in self._checkpoint_at and self.position not in self._checkpoints:
                self._checkpoints[self.position] = self.state.clone()
        return self.state

    def goto(self, step: int) -> TraceState:
        """The state at the end of engine step `step`."""
        if step not in self._step_end:
            raise KeyError(f"step {step} is not in this trace (it has steps {self.steps[:1]}..{self.steps[-1:]})")
        return self.seek(self._step_end[step])

    def next(self) -> TraceState:
        """The next step after the current position (stays at the last step)."""
        if not self.steps:
            return self.state
        i = bisect.bisect_right(self._ends, self.position)
        return self.seek(self._ends[min(i, len(self._ends) - 1)])

    def prev(self) -> TraceState:
        """The step before the current position (or the start of the trace)."""
        i = bisect.bisect_left(self._ends, self.position) - 1
        return self.seek(self._ends[i] if i >= 0 else 0)

    def events_of_step(self, step: int) -> list[Event]:
        return [ev for ev in self.events if ev.step == step]

    def final(self) -> TraceState:
        return self.seek(len(self.events))
