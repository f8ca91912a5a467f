"""AsyncLLMEngine: the engine loop in a background thread, served to asyncio.

Who may touch the LLMEngine
---------------------------
``LLMEngine`` is single-threaded. Whoever holds ``_lock`` (the *engine lock*) may call it:

* The engine thread holds the lock while it steps, and releases it only when it is idle
  (waiting for work on ``_cv``) or *parked*: held by a step controller inside a gate.
  ``hooks.gate_wait`` is set to ``_gate_wait``, which releases the lock around the wait.
* The asyncio thread never calls engine methods and never waits on the engine lock, so the
  HTTP event loop never blocks on model work. ``add_request`` appends to ``_pending`` (a deque
  guarded by ``_cv``, which nobody holds for more than a few list operations) and awaits a
  future that resolves once the request is in the scheduler's waiting queue, or fails with
  the engine's ValueError, before anything was queued.
* Pending requests are applied by whoever holds the engine lock: the engine thread before
  each step, or, while it is parked, the one ``engine-parked`` helper thread. So a request sent
  while the tracer has paused the engine shows up in ``scheduler.waiting`` (and in snapshots)
  at once, and a bad one gets its 400 at once. Appending to ``waiting`` mid-step is safe: the
  engine's gates sit before scheduling, between scheduling and execution, and inside model
  execution, never while the scheduler walks its queues; and a new request cannot be part of
  the step already scheduled.
* Aborts are applied between steps. While parked, only aborts of requests that are not
  running are applied: a running request may belong to the step the gate interrupted, and
  freeing its blocks mid-step would corrupt that step. The rest wait for the step boundary.

Outputs go back per request through asyncio queues, with one ``call_soon_threadsafe`` per step.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from engine.config import EngineConfig
from engine.hooks import Hooks
from engine.llm_engine import LLMEngine
from engine.outputs import EngineStats, RequestOutput
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# listener(outputs of one step, stats after it, ids aborted since the last call); engine thread
StepListener = Callable[[list[RequestOutput], EngineStats, list[str]], None]


class EngineClosedError(RuntimeError):
    """The engine is shutting down (or has stopped) and takes no new requests."""


@dataclass
class _Add:
    request_id: str
    prompt: object
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    accepted: asyncio.Future


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, exc: BaseException | None) -> None:
    def settle() -> None:
        if not fut.done():  # the caller may have given up (cancelled) meanwhile
            fut.set_exception(exc) if exc is not None else fut.set_result(None)
    _call_soon(loop, settle)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that event loop is closed: nobody is listening any more
        pass


class RequestStream:
    """One request's outputs, as an async iterator. Ends after the finished output.

    Iterating stops the request (abort) if the iteration is cancelled or fails first; a
    consumer that just stops iterating should call ``abort()`` (a no-op once finished).
    """

    def __init__(self, engine: AsyncLLMEngine, request_id: str, queue: asyncio.Queue):
        self.engine, self.request_id, self._queue = engine, request_id, queue
        self.finished = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self.finished = True  # the engine already dropped it
                    raise item
                self.finished = item.finished
                yield item
        finally:
            self.abort()

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, drain_timeout: float = 5.0):
        self.engine = engine
        self.drain_timeout = drain_timeout  # shutdown(): how long in-flight requests may finish
        self.step_listeners: list[StepListener] = []
        self.stats: EngineStats = engine.stats()  # published by whoever holds the engine lock
        self._lock = threading.Lock()  # the engine lock (see the module docstring)
        self._cv = threading.Condition()  # guards the fields below; wakes the idle loop
        self._pending: deque[_Add] = deque()
        self._aborts: list[str] = []
        self._parked = False
        self._stopping = False  # refuse new requests
        self._exit = False  # abort what is left and end the engine thread
        self._idle = threading.Event()  # no requests in the engine and none pending
        self._streams: dict[str, _Add] = {}  # live requests; under the engine lock
        self._aborted: list[str] = []  # aborted since the listeners last heard; engine lock
        self._thread: threading.Thread | None = None
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="engine-parked")
        engine.hooks.gate_wait = self._gate_wait

    @classmethod
    def from_config(cls, config: EngineConfig, hooks: Hooks | None = None, **kwargs) -> AsyncLLMEngine:
        return cls(LLMEngine(config, hooks), **kwargs)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def hooks(self) -> Hooks:
        return self.engine.hooks

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def is_parked(self) -> bool:
        """True while a step controller holds the engine thread in a gate."""
        return self._parked

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> AsyncLLMEngine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()
        return self

    async def shutdown(self, drain_timeout: float | None = None) -> None:
        """Stop taking requests, let in-flight ones finish for up to drain_timeout seconds,
        abort the rest and stop the engine thread."""
        await asyncio.get_running_loop().run_in_executor(None, self.stop, drain_timeout)

    def stop(self, drain_timeout: float | None = None) -> None:
        """Blocking shutdown(). A controller that keeps the engine parked is not waited for
        beyond the timeout (the engine thread is a daemon)."""
        timeout = self.drain_timeout if drain_timeout is None else drain_timeout
        with self._cv:
            self._stopping = True  # refuse new requests from now on
        if self._thread is not None:
            self._idle.wait(timeout)
            with self._cv:
                self._exit = True
                self._cv.notify()  # wake the idle loop so it sees _exit
            self._thread.join(timeout)
        self._helper.shutdown(wait=False)

    # ---- requests (asyncio thread) --------------------------------------------------------
    async def add_request(self, request_id: str, prompt, params: SamplingParams) -> RequestStream:
        """Queue a request; returns once the engine has it (in `waiting`). Raises the
        engine's ValueError (bad prompt, too long, bad params) with nothing queued."""
        loop = asyncio.get_running_loop()
        add = _Add(request_id, prompt, params, loop, asyncio.Queue(), loop.create_future())
        with self._cv:
            if self._stopping or self._thread is None or not self._thread.is_alive():
                raise EngineClosedError("the engine is not running (shutting down?)")
            self._pending.append(add)
            self._idle.clear()
            self._cv.notify()
            parked = self._parked
        if parked:
            self._helper.submit(self._drain_while_parked)
        try:
            await add.accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # it may have been added meanwhile
            raise
        return RequestStream(self, request_id, add.queue)

    async def generate(self, prompt, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs (cumulative) of one request until it finishes. Aborts it if the consumer
        goes away (cancellation, e.g. a client disconnect)."""
        stream = await self.add_request(request_id, prompt, params)
        async for out in stream:
            yield out

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed before the next step. Unknown ids: no-op."""
        with self._cv:
            self._aborts.append(request_id)
            self._cv.notify()
            parked = self._parked
        if parked:
            self._helper.submit(self._drain_while_parked)

    # ---- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        self._lock.acquire()
        try:
            while True:
                self._apply_pending()
                with self._cv:
                    exit_now = self._exit
                if exit_now:
                    self._fail_all(EngineClosedError("the server shut down before this request finished"),
                                   include_pending=True)
                    return
                if self.engine.has_unfinished_requests():
                    self._step()
                elif self._aborted:
                    self._notify([])
                else:
                    self._wait_for_work()
        except BaseException as e:  # a bug in the loop itself: fail loudly, not silently hang
            log.exception("engine loop died")
            self._fail_all(e, include_pending=True)
            raise
        finally:
            with self._cv:
                self._stopping = self._exit = True
            self._idle.set()
            self._lock.release()

    def _wait_for_work(self) -> None:
        """Sleep (engine lock released) until a request, an abort or shutdown arrives."""
        self.stats = self.engine.stats()
        self._lock.release()
        try:
            with self._cv:
                while not (self._pending or self._aborts or self._exit):
                    self._idle.set()
                    self._cv.wait()
        finally:
            self._lock.acquire()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # e.g. a kernel failure: fail this batch, keep serving
            log.exception("engine step failed; aborting all requests")
            self._fail_all(e)
            return
        self.stats = self.engine.stats()
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            add = self._streams.get(out.request_id)
            if add is None:
                continue  # aborted after it was scheduled
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(add.loop, []).append((add.queue, out))
        for loop, batch in by_loop.items():
            _call_soon(loop, _deliver, batch)
        self._notify(outputs)

    def _notify(self, outputs: list[RequestOutput]) -> None:
        aborted, self._aborted = self._aborted, []
        for listener in self.step_listeners:
            try:
                listener(outputs, self.stats, aborted)
            except Exception:  # observers must not take the engine down
                log.exception("step listener failed")

    def _apply_pending(self) -> None:
        """Add pending requests, then apply aborts (in that order, so an abort that overtook
        its own add still wins). Caller holds the engine lock."""
        with self._cv:
            adds, self._pending = self._pending, deque()
            aborts, self._aborts = self._aborts, []
            parked = self._parked
        settled = []
        for add in adds:
            try:
                self.engine.add_request(add.request_id, add.prompt, add.params)
            except Exception as e:  # ValueError for bad input; anything else still goes back
                settled.append((add, e))
                continue
            self._streams[add.request_id] = add
            settled.append((add, None))
        deferred = []
        for rid in aborts:
            req = self.engine.requests.get(rid)
            if parked and req is not None and req.status is RequestStatus.RUNNING:
                deferred.append(rid)  # it may be in the interrupted step: wait for its end
                continue
            self._streams.pop(rid, None)
            if req is not None:
                self.engine.abort_request(rid)
                self._aborted.append(rid)
        if deferred:
            with self._cv:
                self._aborts[:0] = deferred
        if adds or aborts:
            self.stats = self.engine.stats()
        for add, exc in settled:  # after the stats: a caller that sees its request queued sees it counted
            _resolve(add.loop, add.accepted, exc)

    def _drain_while_parked(self) -> None:
        # Runs on the helper thread. If the engine left the gate meanwhile, this waits for
        # the next time the lock is free; the engine thread will usually have drained first.
        with self._lock:
            self._apply_pending()

    @contextmanager
    def _gate_wait(self):
        if threading.current_thread() is not self._thread:
            yield  # the engine is being driven directly, not by this loop
            return
        with self._cv:
            self._parked = True
            drain = bool(self._pending or self._aborts)
        self.stats = self.engine.stats()
        self._lock.release()
        if drain:  # arrived after the last drain: apply them now, not after the pause
            self._helper.submit(self._drain_while_parked)
        try:
            yield
        finally:
            self._lock.acquire()
            with self._cv:
                self._parked = False

    def _fail_all(self, exc: BaseException, include_pending: bool = False) -> None:
        """Abort every request in the engine and hand `exc` to its stream; with
        include_pending, refuse the not-yet-added ones too. Caller holds the engine lock."""
        for rid in list(self.engine.requests):
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("abort of %s failed", rid)
        streams, self._streams = self._streams, {}
        for add in streams.values():
            _call_soon(add.loop, add.queue.put_nowait, exc)
        if include_pending:
            with self._cv:
                pending, self._pending = self._pending, deque()
            for add in pending:
                _resolve(add.loop, add.accepted, EngineClosedError(f"the engine stopped: {exc}"))
        self.stats = self.engine.stats()


def _deliver(batch: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, out in batch:
        queue.put_nowait(out)
