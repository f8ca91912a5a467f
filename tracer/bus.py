"""The event bus: a bounded ring buffer between the engine (publisher) and its viewers.

Publishing never waits for a reader: it takes a short lock, stores the event and moves on.
Readers pull with their own cursor; one that falls more than ``capacity`` events behind
does not slow the engine, it is told exactly how many events it missed.

The ring holds each event as its trace-file line (JSON, encoded as it is published), not as
Python objects: the garbage collector has nothing to walk in it (at 64 running requests, the
collector walking the events kept as objects was half of what tracing cost the engine
thread, measured), the recorder writes lines as they are, and every reader sees exactly what
a replay of the file sees. Readers that want events decode them (``read``, ``pull``).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from engine.hooks import INSTANT, Hooks
from tracer.events import Event, decode_line, encode_event

DEFAULT_CAPACITY = 1 << 16
NOBODY = 1 << 62  # the wake-up seq while no reader waits: never reached


@dataclass
class Pulled:
    events: list[Event] = field(default_factory=list)
    missed: int = 0  # events that were overwritten before this reader got them


class EventBus:
    def __init__(self, capacity: int = DEFAULT_CAPACITY, clock: Callable[[], int] = time.perf_counter_ns,
                 start_ns: int | None = None):
        """start_ns: a clock() reading to count ts_ns from (default: now); earlier lets a
        program trace what it did before the bus existed (see publish's at_ns)."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.clock = clock
        now = clock()
        self.start_ns = now if start_ns is None else min(start_ns, now)  # ts_ns of an event counts from here
        self.wall_clock_start_ns = time.time_ns() - (now - self.start_ns)
        self._ring: list[bytes | None] = [None] * capacity  # each event's trace-file line
        self._next_seq = 0
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # Readers blocked in wait(), as the seq each waits for: publish notifies only when it
        # reaches the lowest (a writer can ask to sleep until many events are pending).
        self._waiting_for: list[int] = []
        self._wake_seq = NOBODY
        self.closed = False
        self._wake_gen = 0

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def publish(self, layer: str, name: str, kind: str = INSTANT, request_id: str | None = None,
                step: int | None = None, attrs: dict | None = None, at_ns: int | None = None) -> None:
        """at_ns: when it happened, as a clock() reading, for an event published late (startup
        work timed before the bus existed). Publish such events in time order, before later ones."""
        ts = (self.clock() if at_ns is None else at_ns) - self.start_ns
        lock = self._lock  # acquire/release, not `with`: in Python 3.11 `with` makes two bound methods
        lock.acquire()
        try:
            seq = self._next_seq
            self._ring[seq % self.capacity] = encode_event(seq, ts, layer, name, kind, request_id, step, attrs)
            self._next_seq = seq + 1
        finally:
            lock.release()
        if seq >= self._wake_seq:  # set under the lock, so a reader that is about to wait is seen
            with self._cond:
                self._cond.notify_all()

    def publish_many(self, events: list[tuple], at_ns: list[int] | None = None) -> None:
        """publish() for each (layer, name, kind, request_id, step, attrs), under one lock: they
        happened together (a step's new tokens: one clock reading), or at the clock() readings
        in at_ns (a step's kernel launches, reported once its forward pass is done)."""
        start = self.start_ns
        now = self.clock() - start
        lock = self._lock
        lock.acquire()
        try:
            seq, ring, cap = self._next_seq, self._ring, self.capacity
            if at_ns is None:
                for layer, name, kind, request_id, step, attrs in events:
                    ring[seq % cap] = encode_event(seq, now, layer, name, kind, request_id, step, attrs)
                    seq += 1
            else:
                for (layer, name, kind, request_id, step, attrs), at in zip(events, at_ns):
                    ring[seq % cap] = encode_event(seq, at - start, layer, name, kind, request_id, step, attrs)
                    seq += 1
            self._next_seq = seq
        finally:
            lock.release()
        if seq > self._wake_seq:
            with self._cond:
                self._cond.notify_all()

    def attach(self, hooks: Hooks) -> Callable[[], None]:
        """Publish everything the engine emits on these hooks. Returns a detach function."""
        return hooks.subscribe(self.publish, self.publish_many)

    def subscribe(self, from_start: bool = False) -> "Subscription":
        """A reader starting at the next event (or at the oldest one still held)."""
        with self._cond:
            start = max(0, self._next_seq - self.capacity) if from_start else self._next_seq
        return Subscription(self, start)

    def read(self, cursor: int, max_events: int | None = None) -> tuple[list[Event], int, int]:
        """(events from seq `cursor` on, how many before them were lost, the next cursor)."""
        lines, missed, end = self.read_lines(cursor, max_events)
        return [decode_line(x) for x in lines], missed, end  # decoded outside the lock

    def read_lines(self, cursor: int, max_events: int | None = None) -> tuple[list[bytes], int, int]:
        """read(), as the events' trace-file lines."""
        with self._cond:
            oldest = max(0, self._next_seq - self.capacity)
            missed = max(0, oldest - cursor)
            cursor = max(cursor, oldest)
            end = self._next_seq if max_events is None else min(self._next_seq, cursor + max_events)
            ring, cap = self._ring, self.capacity
            return [ring[i % cap] for i in range(cursor, end)], missed, end

    def wait(self, cursor: int, timeout: float | None = None, min_pending: int = 1,
             stop: threading.Event | None = None) -> bool:
        """Block until there are at least `min_pending` events from seq `cursor` on (True; a
        writer that takes events in batches asks for many, so publishing rarely wakes it), or
        until timeout, close, wake_readers() or `stop` (False unless some event is there). A
        `stop` set before wake_readers() is seen even by a reader that had not started waiting."""
        target = cursor + max(1, min_pending) - 1  # the seq whose publication wakes this reader
        with self._cond:
            gen = self._wake_gen
            self._waiting_for.append(target)
            self._wake_seq = min(self._waiting_for)
            try:
                self._cond.wait_for(lambda: self._next_seq > target or self.closed or self._wake_gen != gen
                                    or (stop is not None and stop.is_set()), timeout)
            finally:
                self._waiting_for.remove(target)
                self._wake_seq = min(self._waiting_for, default=NOBODY)
            return self._next_seq > cursor

    def wake_readers(self) -> None:
        """Make every wait() return now (a reader that is shutting down uses this)."""
        with self._cond:
            self._wake_gen += 1
            self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiting reader; what is buffered can still be read."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class Subscription:
    """One reader's cursor into the bus."""

    def __init__(self, bus: EventBus, cursor: int):
        self.bus = bus
        self.cursor = cursor
        self.missed = 0  # total over this reader's life

    def pull(self, max_events: int | None = None, timeout: float | None = 0) -> Pulled:
        """The events since the last pull. With a timeout, wait up to that long for at least one."""
        if timeout != 0 and self.bus.next_seq <= self.cursor:
            self.bus.wait(self.cursor, timeout)
        events, missed, self.cursor = self.bus.read(self.cursor, max_events)
        self.missed += missed
        return Pulled(events, missed)

    def pull_lines(self, max_events: int | None = None) -> tuple[list[bytes], int]:
        """pull(), as the events' trace-file lines: (lines, how many were missed before them)."""
        lines, missed, self.cursor = self.bus.read_lines(self.cursor, max_events)
        self.missed += missed
        return lines, missed

    @property
    def pending(self) -> int:
        return self.bus.next_seq - self.cursor
