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

A recording of a long run is gigabytes, so ``Replay.load`` holds none of its events: it reads
the file once and keeps an index (each event line's byte offset, 8 bytes an event, and where
each step ends), then reads the events a move needs from the file. What it does hold is
bounded: at most MAX_CHECKPOINTS states (beyond that every other one is dropped and the
spacing doubles), each keeping the latest MAX_FINISHED finished requests as the live view does
(``max_finished``; None keeps them all, for a small trace a test inspects whole).
"""
from __future__ import annotations

import bisect
import itertools
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Iterator

from engine.hooks import END
from engine.trace_names import ENGINE, STEP
from tracer.events import Event, TraceReader
from tracer.state import MAX_FINISHED, TraceState, fold

MAX_CHECKPOINTS = 64
READ_BATCH = 4096  # events read from the file at a time while folding forward


class IndexedEvents(Sequence):
    """A trace file's events by position, read from the file when asked: ``events[i]``,
    ``events[a:b]`` (a list) and ``iter_range(a, b)`` (a stream) never hold more than they return."""

    def __init__(self, path: str | Path, offsets: array):
        self.path, self.offsets = Path(path), offsets

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, stride = i.indices(len(self))
            if stride != 1:
                return list(itertools.islice(self.iter_range(start, stop), 0, None, stride))
            return list(self.iter_range(start, stop))
        n = len(self)
        if not -n <= i < n:
            raise IndexError("event index out of range")
        return self._read(i % n, 1)[0]

    def __iter__(self) -> Iterator[Event]:
        return self.iter_range(0, len(self))

    def iter_range(self, start: int, stop: int) -> Iterator[Event]:
        for at in range(start, stop, READ_BATCH):
            yield from self._read(at, min(READ_BATCH, stop - at))

    def _read(self, start: int, count: int) -> list[Event]:
        if count <= 0:
            return []
        with TraceReader(self.path) as reader:  # opened per read: a replay holds no file open
            return reader.read_at(self.offsets[start], count)


class Replay:
    truncated = False  # (a loaded file) its torn last line was left out: the recording process died mid-write

    def __init__(self, header: dict, events: Sequence[Event], checkpoint_every: int = 16,
                 max_finished: int | None = MAX_FINISHED, step_end: dict[int, int] | None = None):
        self.header = header
        self.events = events
        self.checkpoint_every = max(1, checkpoint_every)
        self.max_finished = max_finished
        if step_end is None:  # the index just past each step's END (a step cut off by the end of the trace ends there)
            step_end = {}
            for i, ev in enumerate(events):
                _index_step(step_end, i, ev, len(events))
        self._step_end = step_end
        self.steps: list[int] = sorted(self._step_end)
        self._ends = [self._step_end[k] for k in self.steps]  # ascending: steps run in order
        self._checkpoints: dict[int, TraceState] = {0: self._new_state()}  # event index -> state there
        self._set_checkpoint_grid()
        self.position = 0
        self.state = self._new_state()

    @classmethod
    def load(cls, path: str | Path, checkpoint_every: int = 16, max_finished: int | None = MAX_FINISHED) -> Replay:
        """Index the file (one pass; raises TraceFileError for what is not a trace file)."""
        offsets, step_end = array("q"), {}
        with TraceReader(path) as reader:
            for i, (at, ev) in enumerate(reader.lines()):
                offsets.append(at)
                _index_step(step_end, i, ev, None)
            header, truncated = reader.header, reader.truncated
        n = len(offsets)
        step_end = {k: n if v is None else v for k, v in step_end.items()}
        replay = cls(header, IndexedEvents(path, offsets), checkpoint_every, max_finished, step_end)
        replay.truncated = truncated
        return replay

    def _new_state(self) -> TraceState:
        return TraceState(max_finished=self.max_finished)

    def _set_checkpoint_grid(self) -> None:
        self._checkpoint_at = {self._step_end[k] for k in self.steps[::self.checkpoint_every]}

    @property
    def step(self) -> int | None:
        """The step whose end the position is at (async scheduling: the next one may be in flight)."""
        return self.state.done_step if self.state.done_step is not None else self.state.step

    def seek(self, index: int) -> TraceState:
        """The state after the first `index` events."""
        index = max(0, min(index, len(self.events)))
        if index < self.position:
            start = max(i for i in self._checkpoints if i <= index)
            self.state, self.position = self._checkpoints[start].clone(), start
        if self.position < index:
            for ev in _range(self.events, self.position, index):
                fold(self.state, ev)
                self.position += 1
                if self.position in self._checkpoint_at and self.position not in self._checkpoints:
                    self._checkpoints[self.position] = self.state.clone()
                    if len(self._checkpoints) > MAX_CHECKPOINTS:
                        self._thin_checkpoints()
        return self.state

    def _thin_checkpoints(self) -> None:
        """Every other checkpoint goes: twice the spacing, half the states held."""
        self.checkpoint_every *= 2
        self._set_checkpoint_grid()
        self._checkpoints = {i: s for i, s in self._checkpoints.items() if i == 0 or i in self._checkpoint_at}

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


def _index_step(step_end: dict, i: int, ev: Event, n: int | None) -> None:
    """Note where step ev.step ends: just past its END and the events stamped with its step that
    follow it at once (the front end's NEW_TOKENS), or (n: the trace's length, None if not known
    yet) at the end of the trace for a step that began and never ended."""
    if ev.layer == ENGINE and ev.name == STEP and ev.step is not None:
        step_end[ev.step] = i + 1 if ev.kind == END else n
    elif ev.step is not None and step_end.get(ev.step) == i:
        step_end[ev.step] = i + 1  # right after its END: still the step's


def _range(events: Sequence[Event], start: int, stop: int) -> Iterator[Event]:
    if isinstance(events, IndexedEvents):
        return events.iter_range(start, stop)
    return itertools.islice(events, start, stop)
