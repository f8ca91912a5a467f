"""The event bus: a bounded ring buffer between the engine (publisher) and its viewers.

Publishing never waits for a reader: it takes a short lock, stores the event and moves on.
Readers pull with their own cursor; one that falls more than ``capacity`` events behind
does not slow the engine, it is told exactly how many events it missed.

The ring holds each event as its trace-file line (JSON, encoded as it is published), not as
Python objects: the garbage collector has nothing to walk in it (at 64 running requests, the
collector walking the events kept as objects was half of what tracing cost the engine
thread, measured), the recorder writes lines as they are, and every reader sees exactly what
a replay of the file sees. Readers that want events decode them (``read``, ``pull``).

The lines are copied into one preallocated byte ring rather than kept as ``bytes`` objects.
Tens of thousands of live lines scattered through the heap kept glibc from reusing the
memory the model's larger tensors had freed: each prefill then wrote its activations to
fresh pages (measured: ~2,500 page faults a generate of the 32-request benchmark, ~80 with
this ring; untraced engines in the same process paid for it as well). So the ring is bounded
twice: ``capacity`` events and ``capacity_bytes`` bytes of lines; whichever fills first
decides which events a slow reader misses, and it is told how many either way.
"""
from __future__ import annotations

import threading
import time
from array import array
from dataclasses import dataclass, field
from typing import Callable

from engine.hooks import INSTANT, Hooks
from tracer.events import Event, decode_lines, encode_event

DEFAULT_CAPACITY = 1 << 16  # events
BYTES_PER_EVENT = 512  # capacity_bytes defaults to this many bytes an event (lines average 150-500)
NOBODY = 1 << 62  # the wake-up seq while no reader waits: never reached


@dataclass
class Pulled:
    events: list[Event] = field(default_factory=list)
    missed: int = 0  # events that were overwritten before this reader got them


class EventBus:
    """A bounded ring of trace events (their JSON lines) between publishers and any number of
    readers (see the module docstring). publish and publish_many never wait for a reader; they
    give each event the next seq and its ts_ns. Each reader pulls from its own cursor (subscribe,
    read, wait) and is told how many events it missed when the ring overwrote them. attach(hooks)
    makes the bus the sink of an engine's Hooks."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, clock: Callable[[], int] = time.perf_counter_ns,
                 start_ns: int | None = None, capacity_bytes: int | None = None):
        """capacity: events held; capacity_bytes: bytes of their lines held (default capacity x
        BYTES_PER_EVENT; a single larger line grows it). start_ns: a clock() reading to count
        ts_ns from (default: now); earlier lets a program trace what it did before the bus
        existed (see publish's at_ns)."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if capacity_bytes is not None and capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        self.capacity = capacity
        self.capacity_bytes = capacity_bytes or capacity * BYTES_PER_EVENT
        self.clock = clock
        now = clock()
        self.start_ns = now if start_ns is None else min(start_ns, now)  # ts_ns of an event counts from here
        self.wall_clock_start_ns = time.time_ns() - (now - self.start_ns)
        # The lines form one stream of bytes, stored circularly in _buf: event seq's line starts
        # at stream offset _at[seq % capacity] and ends where the next one starts (or at
        # _written). A line is held while its start is within the last capacity_bytes written.
        self._buf = bytearray(self.capacity_bytes)
        self._at = array("q", [0]) * capacity
        self._written = 0
        self._floor = 0  # no event before this seq is held (the ring was regrown past them)
        self._next_seq = 0
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # Readers blocked in wait(), as (seq, stream offset) targets: publish notifies only when
        # it reaches the lowest of either (a writer can ask to sleep until many are pending).
        self._waiting_for: list[tuple[int, int]] = []
        self._wake_seq = self._wake_bytes = NOBODY
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
            self._store(seq, encode_event(seq, ts, layer, name, kind, request_id, step, attrs))
            self._next_seq = seq + 1
        finally:
            lock.release()
        if (
            seq >= self._wake_seq or self._written >= self._wake_bytes
        ):  # set under the lock, so a reader about to wait is seen
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
            seq, store = self._next_seq, self._store
            if at_ns is None:
                for layer, name, kind, request_id, step, attrs in events:
                    store(seq, encode_event(seq, now, layer, name, kind, request_id, step, attrs))
                    seq += 1
            else:
                for (layer, name, kind, request_id, step, attrs), at in zip(events, at_ns):
                    store(seq, encode_event(seq, at - start, layer, name, kind, request_id, step, attrs))
                    seq += 1
            self._next_seq = seq
        finally:
            lock.release()
        if seq > self._wake_seq or self._written >= self._wake_bytes:
            with self._cond:
                self._cond.notify_all()

    def _store(self, seq: int, line: bytes) -> None:
        """Copy event seq's line into the ring (under the lock; the line object is freed at once)."""
        w, size, n = self._written, self.capacity_bytes, len(line)
        if n > size:
            self._regrow(seq, n)
            size = self.capacity_bytes
        pos = w % size
        end = pos + n
        if end <= size:
            self._buf[pos:end] = line
        else:  # the line wraps round the end of the buffer
            view = memoryview(line)
            self._buf[pos:] = view[:size - pos]
            self._buf[:end - size] = view[size - pos:]
        self._at[seq % self.capacity] = w
        self._written = w + n

    def _regrow(self, seq: int, n: int) -> None:
        # One line longer than the whole ring (a snapshot of thousands of requests): a larger
        # buffer, in which nothing older is held (readers are told what they missed).
        self.capacity_bytes = 1 << (2 * n - 1).bit_length()
        self._buf = bytearray(self.capacity_bytes)
        self._floor = seq

    def _oldest(self) -> int:
        """The oldest seq still held (== next_seq when none is); under the lock."""
        nxt, cap, at = self._next_seq, self.capacity, self._at
        lo = max(self._floor, nxt - cap, 0)
        limit = self._written - self.capacity_bytes
        if lo >= nxt or at[lo % cap] >= limit:
            return lo
        hi = nxt  # at[] rises with seq: the first held line, by bisection
        while lo < hi:
            mid = (lo + hi) // 2
            if at[mid % cap] >= limit:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _offset(self, seq: int) -> int:
        """Where event seq's line starts in the stream of lines (next_seq: where the next will)."""
        return self._at[seq % self.capacity] if seq < self._next_seq else self._written

    def _copy(self, start: int, stop: int) -> bytes:
        """Stream offsets [start, stop) out of the ring, which may hold them in two pieces."""
        size, view = self.capacity_bytes, memoryview(self._buf)
        pos, n = start % size, stop - start
        if pos + n <= size:
            return view[pos:pos + n].tobytes()
        return view[pos:].tobytes() + view[:pos + n - size].tobytes()

    def _span(self, cursor: int, max_events: int | None) -> tuple[int, int, int]:
        """(the first seq still held from cursor on, how many before it were lost, the end)."""
        oldest = self._oldest()
        missed = max(0, oldest - cursor)
        cursor = max(cursor, oldest)
        end = self._next_seq if max_events is None else min(self._next_seq, cursor + max_events)
        return cursor, missed, max(cursor, end)

    def attach(self, hooks: Hooks) -> Callable[[], None]:
        """Publish everything the engine emits on these hooks. Returns a detach function."""
        return hooks.subscribe(self.publish, self.publish_many)

    def subscribe(self, from_start: bool = False) -> "Subscription":
        """A reader starting at the next event (or at the oldest one still held)."""
        with self._cond:
            start = self._oldest() if from_start else self._next_seq
        return Subscription(self, start)

    def read(self, cursor: int, max_events: int | None = None) -> tuple[list[Event], int, int]:
        """(events from seq `cursor` on, how many before them were lost, the next cursor)."""
        data, _, missed, end = self.read_bytes(cursor, max_events)
        return decode_lines(data), missed, end  # decoded outside the lock

    def read_lines(self, cursor: int, max_events: int | None = None) -> tuple[list[bytes], int, int]:
        """read(), as the events' trace-file lines."""
        with self._cond:
            cursor, missed, end = self._span(cursor, max_events)
            offset, copy = self._offset, self._copy
            return [copy(offset(i), offset(i + 1)) for i in range(cursor, end)], missed, end

    def read_bytes(self, cursor: int, max_events: int | None = None) -> tuple[bytes, int, int, int]:
        """read_lines(), joined: (the lines from seq `cursor` on as one bytes object, how many
        events it holds, how many before them were lost, the next cursor). The ring keeps the
        lines as one stream, so this is one or two copies, whatever the number of events (what
        the recorder writes)."""
        with self._cond:
            cursor, missed, end = self._span(cursor, max_events)
            return self._copy(self._offset(cursor), self._offset(end)), end - cursor, missed, end

    def wait(self, cursor: int, timeout: float | None = None, min_pending: int = 1,
             stop: threading.Event | None = None, min_bytes: int | None = None) -> bool:
        """Block until there are at least `min_pending` events from seq `cursor` on, or (if
        given) `min_bytes` bytes of their lines (True; a writer that takes events in batches asks
        for many, so publishing rarely wakes it), or until timeout, close, wake_readers() or
        `stop` (False unless some event is there). A `stop` set before wake_readers() is seen
        even by a reader that had not started waiting."""
        with self._cond:
            target = cursor + max(1, min_pending) - 1  # the seq whose publication wakes this reader
            if min_bytes is None:
                byte_target = NOBODY
            else:  # from where event `cursor` starts in the stream (lost: as far back as is held)
                start = self._offset(cursor) if cursor >= self._oldest() else self._written - self.capacity_bytes
                byte_target = start + max(1, min_bytes)
            gen = self._wake_gen
            entry = (target, byte_target)
            self._waiting_for.append(entry)
            self._set_wake_targets()
            try:
                self._cond.wait_for(lambda: self._next_seq > target or self._written >= byte_target or self.closed
                                    or self._wake_gen != gen or (stop is not None and stop.is_set()), timeout)
            finally:
                self._waiting_for.remove(entry)
                self._set_wake_targets()
            return self._next_seq > cursor

    def _set_wake_targets(self) -> None:
        self._wake_seq = min((t for t, _ in self._waiting_for), default=NOBODY)
        self._wake_bytes = min((b for _, b in self._waiting_for), default=NOBODY)

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

    def pull_bytes(self, max_events: int | None = None) -> tuple[bytes, int, int]:
        """pull(), as the events' trace-file lines joined: (bytes, how many events, how many
        were missed before them). What the recorder writes."""
        data, count, missed, self.cursor = self.bus.read_bytes(self.cursor, max_events)
        self.missed += missed
        return data, count, missed

    @property
    def pending(self) -> int:
        return self.bus.next_seq - self.cursor
