import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.hooks import Hooks
from tracer.bus import EventBus


def test_attach_publishes_hook_events_with_increasing_seq():
    hooks, bus = Hooks(), EventBus()
    sub = bus.subscribe()
    detach = bus.attach(hooks)
    assert hooks.active
    hooks.emit("engine", "QUEUED", request_id="1", step=0, num_prompt_tokens=3)
    hooks.emit("engine", "step", "begin", step=0)
    detach()
    assert not hooks.active
    hooks.emit("engine", "not seen")
    got = sub.pull()
    assert [e.seq for e in got.events] == [0, 1] and got.missed == 0
    assert got.events[0].attrs == {"num_prompt_tokens": 3} and got.events[1].attrs is None
    assert got.events[0].ts_ns <= got.events[1].ts_ns


def test_emit_many_reaches_batch_and_plain_listeners_in_order():
    hooks, bus = Hooks(), EventBus(capacity=4)
    sub = bus.subscribe()
    bus.attach(hooks)  # the bus takes a batch in one call
    plain = []
    unsubscribe = hooks.subscribe(lambda *e: plain.append(e))  # no batch form: called per event
    hooks.emit("engine", "step", "begin", step=3)
    batch = [("detokenizer", "NEW_TOKENS", "instant", str(i), 3, {"token_ids": [i], "text": "x"}) for i in range(3)]
    hooks.emit_many(batch)
    got = sub.pull()
    assert [(e.seq, e.request_id) for e in got.events] == [(0, None), (1, "0"), (2, "1"), (3, "2")]
    assert got.events[2].attrs == {"token_ids": [1], "text": "x"} and got.events[2].step == 3
    assert got.events[1].ts_ns == got.events[3].ts_ns >= got.events[0].ts_ns  # published together
    assert plain[1:] == batch
    hooks.emit_many(batch[:2])  # past the ring's end (4): slots are reused, seqs go on
    assert [e.seq for e in sub.pull().events] == [4, 5]
    unsubscribe()
    hooks.emit_many(batch)
    assert len(plain) == 6 and bus.next_seq == 9


def test_emit_many_with_the_time_each_event_happened():
    clock = iter(range(1000, 10**6, 1000)).__next__
    hooks, bus = Hooks(), EventBus(clock=clock)  # starts at 1000
    bus.attach(hooks)
    plain = []
    hooks.subscribe(lambda *e: plain.append(e))
    hooks.emit_many([("kernel", "a", "instant", None, 0, {"grid": [1]}), ("kernel", "b", "instant", None, 0, None)],
                    [1200, 1700])  # before the publishing clock reading (2000)
    events, _, _ = bus.read(0)
    assert [(e.name, e.ts_ns, e.seq) for e in events] == [("a", 200, 0), ("b", 700, 1)]
    assert [e[1] for e in plain] == ["a", "b"]  # a listener without a batch form still gets each


def test_slow_reader_is_told_how_many_it_missed():
    bus = EventBus(capacity=8)
    sub = bus.subscribe()
    for i in range(20):
        bus.publish("engine", f"e{i}")  # never blocks, though nobody reads
    got = sub.pull()
    assert got.missed == 12
    assert [e.name for e in got.events] == [f"e{i}" for i in range(12, 20)]
    assert sub.pull().events == []


@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(1, 16), ops=st.lists(st.one_of(st.integers(1, 20), st.none()), max_size=30))
def test_every_event_is_either_delivered_in_order_or_counted_missed(capacity, ops):
    bus = EventBus(capacity=capacity)
    sub = bus.subscribe()
    seen, missed, published = [], 0, 0
    for op in ops:
        if op is None:
            got = sub.pull(max_events=capacity)
            seen += [e.seq for e in got.events]
            missed += got.missed
        else:
            for _ in range(op):
                bus.publish("engine", "x")
                published += 1
    got = sub.pull()
    seen += [e.seq for e in got.events]
    missed += got.missed
    assert seen == sorted(seen) and len(set(seen)) == len(seen)
    assert len(seen) + missed == published


def test_concurrent_publishers_get_unique_contiguous_seqs():
    bus = EventBus()
    sub = bus.subscribe()
    start = threading.Barrier(4)

    def publish():
        start.wait()
        for _ in range(500):
            bus.publish("http", "x")

    threads = [threading.Thread(target=publish) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seqs = [e.seq for e in sub.pull().events]
    assert seqs == list(range(2000))


def test_reader_waits_for_the_next_event():
    bus = EventBus()
    sub = bus.subscribe()
    t = threading.Thread(target=lambda: bus.publish("engine", "late"))
    t.start()
    got = sub.pull(timeout=10)  # returns when the event is published, not after the timeout
    t.join()
    got.events += sub.pull().events
    assert [e.name for e in got.events] == ["late"]
    assert sub.pull(timeout=0.01).events == []  # a timeout with nothing to read


def test_a_batch_reader_is_woken_only_once_enough_events_are_pending():
    bus = EventBus()
    woke = []
    t = threading.Thread(target=lambda: woke.append(bus.wait(0, timeout=30, min_pending=3)))
    t.start()
    bus.publish("engine", "a")
    bus.publish_many([("engine", "b", "instant", None, None, None)])
    t.join(timeout=0.2)
    assert t.is_alive() and not woke  # two pending: it sleeps on
    bus.publish("engine", "c")  # the third wakes it, long before its timeout
    t.join(timeout=30)
    assert woke == [True] and bus._wake_seq > bus.next_seq  # nobody waits: publishing notifies no one


def test_wake_readers_interrupts_a_wait():
    bus = EventBus()
    sub = bus.subscribe()
    waiting = threading.Event()
    result = []

    def reader():
        waiting.set()
        result.append(sub.pull(timeout=30))

    t = threading.Thread(target=reader)
    t.start()
    waiting.wait()
    while t.is_alive():
        bus.wake_readers()  # repeated: the reader may not be inside wait() yet
        t.join(0.05)
    assert result[0].events == []


def test_the_ring_is_bounded_in_bytes_too_and_lines_that_wrap_come_back_whole():
    bus = EventBus(capacity=1000, capacity_bytes=1000)
    sub = bus.subscribe()
    for i in range(40):
        bus.publish("engine", f"e{i}", attrs={"pad": "x" * (i % 7 * 10)})  # lines of ~100-160 bytes
    got = sub.pull()
    assert got.missed > 0 and got.missed + len(got.events) == 40  # far fewer than 1000 events fit
    assert [e.name for e in got.events] == [f"e{i}" for i in range(got.missed, 40)]
    assert all(e.attrs == {"pad": "x" * (int(e.name[1:]) % 7 * 10)} for e in got.events)  # decoded intact
    lines, _, _ = bus.read_lines(got.missed)
    assert sum(map(len, lines)) <= 1000  # what is held fits the buffer


def test_a_line_longer_than_the_ring_grows_it():
    bus = EventBus(capacity=16, capacity_bytes=256)
    sub = bus.subscribe()
    bus.publish("engine", "small")
    bus.publish("scheduler", "schedule", "snapshot", attrs={"rows": ["r" * 50] * 20})  # ~1.1 kB
    bus.publish("engine", "after")
    got = sub.pull()
    assert got.missed == 1 and [e.name for e in got.events] == ["schedule", "after"]
    assert got.events[0].attrs == {"rows": ["r" * 50] * 20} and bus.capacity_bytes >= 2048


@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(1, 12), capacity_bytes=st.integers(1, 2000),
       ops=st.lists(st.one_of(st.integers(0, 300), st.none()), max_size=40))
def test_with_a_byte_bound_every_event_is_delivered_intact_in_order_or_counted_missed(capacity, capacity_bytes, ops):
    bus = EventBus(capacity=capacity, capacity_bytes=capacity_bytes)
    sub = bus.subscribe()
    seen, missed, published = [], 0, []
    for op in ops:
        lines, n_missed, end = bus.read_lines(0)  # the stream as one copy: the same lines, joined
        assert bus.read_bytes(0) == (b"".join(lines), len(lines), n_missed, end)
        if op is None:
            got = sub.pull(max_events=capacity)
            seen += got.events
            missed += got.missed
        else:
            published.append("y" * op)
            bus.publish("engine", "x", attrs={"pad": published[-1]})
    got = sub.pull()
    seen += got.events
    missed += got.missed
    assert [e.seq for e in seen] == sorted({e.seq for e in seen})
    assert all(e.attrs == {"pad": published[e.seq]} for e in seen)
    assert len(seen) + missed == len(published)


def test_a_batch_reader_is_woken_once_enough_bytes_are_pending():
    bus = EventBus(capacity=1000)
    woke = []
    t = threading.Thread(target=lambda: woke.append(bus.wait(0, timeout=30, min_pending=1000, min_bytes=500)))
    t.start()
    bus.publish("engine", "a")  # ~120 bytes: it sleeps on
    t.join(timeout=0.2)
    assert t.is_alive() and not woke
    bus.publish("engine", "b", attrs={"pad": "z" * 500})  # past 500 bytes: woken, far short of 1000 events
    t.join(timeout=30)
    assert woke == [True] and bus._wake_bytes > 10**9  # nobody waits


def test_read_bytes_is_read_lines_joined_with_losses_counted():
    bus = EventBus(capacity=8, capacity_bytes=600)
    for i in range(12):
        bus.publish("engine", f"e{i}", attrs={"i": i, "pad": "p" * (i * 5)})
    lines, missed, end = bus.read_lines(0)
    data, count, missed2, end2 = bus.read_bytes(0)
    assert data == b"".join(lines) and (count, missed2, end2) == (len(lines), missed, end) and missed > 0
    data, count, _, end = bus.read_bytes(end - 2, max_events=1)
    assert count == 1 and data == lines[-2] and end == bus.next_seq - 1
    assert bus.read_bytes(bus.next_seq) == (b"", 0, 0, bus.next_seq)


def test_a_ring_of_no_room_is_refused():
    import pytest
    for kwargs in ({"capacity": 0}, {"capacity": 4, "capacity_bytes": 0}, {"capacity": 4, "capacity_bytes": -1}):
        with pytest.raises(ValueError, match="must be >= 1"):
            EventBus(**kwargs)
