"""BusyLoop: an EngineCore stepped by a thread of its own (vLLM V1's ``EngineCoreProc.run_busy_loop``).

It runs in the engine-core process (``EngineCoreProc``) and, with ``serve --no-multiprocessing``,
in the API server (``AsyncInprocClient``). The EngineCore is single-threaded; this module
decides who may call it when.

Who may touch the EngineCore
----------------------------
Whoever holds ``_lock`` (the *engine lock*) may call it:

* The engine thread holds the lock while it steps, and releases it only when it is idle
  (waiting for work on ``_cv``) or *parked*: held by a step controller inside a gate.
  ``hooks.gate_wait`` is set to ``_gate_wait``, which releases the lock around the wait.
* Callers never call the core and never wait on the engine lock. ``add_request``
  appends to ``_pending`` (a deque guarded by ``_cv``, which nobody holds for more than a few
  list operations); the request's ``settle`` callback runs once it is in the scheduler's
  waiting queue, or with the core's ValueError, before anything was queued.
* Pending requests are applied by whoever holds the engine lock: the engine thread before
  each step, or, while it is parked, the one ``engine-parked`` helper thread. So a request sent
  while the tracer has paused the engine shows up in ``scheduler.waiting`` (and in snapshots)
  at once. Appending to ``waiting`` mid-step is safe: the gates sit before scheduling,
  between scheduling and execution, and inside model execution, never while the scheduler
  walks its queues; and a new request cannot be part of the step already scheduled.
* Aborts are applied between steps. While parked, only aborts of requests that are not
  running are applied: a running request may belong to the step the gate interrupted, and
  freeing its blocks mid-step would corrupt that step. The rest wait for the step boundary.
* Profiling starts and stops between steps, by the engine thread (``profile`` returns a Future):
  torch.profiler is started and stopped on the thread that runs the model, and with tensor
  parallelism the ranks' answers share the executor's reply queue with the step's.

Why a lock and a helper thread, where V1 has only an input queue that the engine thread
drains between steps: V1's engine thread never stops mid-step, ours does (a gate holds it
inside a step for as long as a learner looks). A queue drained only by the engine thread
would leave a request sent during a pause invisible until the pause ends, and the TUI shows
``waiting`` as it is. So while parked another thread must apply it, and the lock makes that
thread and the engine thread take turns.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from engine.engine.core_types import EngineCoreRequest
from engine.engine.exceptions import EngineClosedError, EngineDeadError
from engine.outputs import EngineStats
from engine.request import RequestStatus

if TYPE_CHECKING:  # the API server imports this module and must not import torch
    from engine.engine.core import EngineCore

log = logging.getLogger(__name__)

# on_step(outputs of one step, stats after it, ids aborted since the last call); engine thread
StepCallback = Callable[[list, EngineStats, list[str]], None]


@dataclass
class PendingAdd:
    request: EngineCoreRequest  # its sampling_params a SamplingParams
    settle: Callable[[BaseException | None], None]  # under the engine lock, once applied (or refused)


class BusyLoop:
    """The busy loop over one EngineCore, in a thread (see the module docstring).

    on_step(outputs, stats, aborted) runs on the engine thread after each step with the outputs
    of requests still live; on_fail(request_ids, exc) when requests are dropped by a failure
    (a step raised) or by stop(). Both run under the engine lock and must not block."""

    def __init__(self, engine: EngineCore, on_step: StepCallback, on_fail: Callable[[list[str], BaseException], None]):
        self.engine = engine
        self.on_step, self.on_fail = on_step, on_fail
        self.stats: EngineStats = engine.stats()  # published by whoever holds the engine lock
        self._lock = threading.Lock()  # the engine lock (see the module docstring)
        self._cv = threading.Condition()  # guards the fields below; wakes the idle loop
        self._pending: deque[PendingAdd] = deque()
        self._aborts: list[tuple[str, RequestStatus, object]] = []
        self._profile: list[tuple[bool, Future]] = []  # start / stop profiling, at the next step boundary
        self._parked = False
        self._stopping = False  # refuse new requests
        self._exit = False  # abort what is left and end the engine thread
        self._idle = threading.Event()  # no requests in the engine and none pending
        self._live: set[str] = set()  # requests whose outputs go out; under the engine lock
        self._aborted: list[str] = []  # aborted since on_step last heard; engine lock
        self._thread: threading.Thread | None = None
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="engine-parked")
        engine.hooks.gate_wait = self._gate_wait

    @property
    def is_running(self) -> bool:
        alive = self._thread is not None and self._thread.is_alive() and not self._stopping
        return alive and self.engine.dead is None

    @property
    def is_parked(self) -> bool:
        """True while a step controller holds the engine thread in a gate."""
        return self._parked

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> BusyLoop:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()
        return self

    def stop(self, drain_timeout: float = 0.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to drain_timeout seconds,
        abort the rest (on_fail with EngineClosedError) and end the engine thread. A controller
        that keeps the engine parked is not waited for beyond the timeout (a daemon thread)."""
        with self._cv:
            self._stopping = True
        if self._thread is not None:
            self._idle.wait(drain_timeout)
            with self._cv:
                self._exit = True
                self._cv.notify()
            self._thread.join(max(drain_timeout, 1.0))
        self._helper.shutdown(wait=False)

    # ---- requests (any thread) ------------------------------------------------------------
    def add_request(self, add: PendingAdd) -> None:
        """Queue a request; add.settle runs once it is in `waiting` (or with why not)."""
        dead = self.engine.dead
        if dead is not None:  # a tensor-parallel worker died: the engine cannot run this
            raise EngineClosedError(f"the engine died: {dead}")
        with self._cv:
            if self._stopping or self._thread is None or not self._thread.is_alive():
                raise EngineClosedError("the engine is not running (shutting down?)")
            self._pending.append(add)
            self._idle.clear()
            self._cv.notify()
            parked = self._parked
        if parked:
            self._helper.submit(self._drain_while_parked)

    def abort(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED,
              stop_reason: object = None) -> None:
        """Stop a request; its blocks are freed before the next step. Unknown ids: no-op.
        status FINISHED_STOPPED finishes it as stopped (a stop string the front end matched)."""
        with self._cv:
            self._aborts.append((request_id, status, stop_reason))
            self._cv.notify()
            parked = self._parked
        if parked:
            self._helper.submit(self._drain_while_parked)

    def profile(self, is_start: bool) -> Future:
        """Start or stop profiling (EngineCore.profile) before the next step, or at once when idle
        (any thread); the Future gets EngineCore.profile's answer. While a step controller holds
        the engine inside a step, it waits for that step's end."""
        fut: Future = Future()
        with self._cv:
            if self._stopping or self._thread is None or not self._thread.is_alive():
                fut.set_exception(EngineClosedError("the engine is not running (shutting down?)"))
                return fut
            self._profile.append((is_start, fut))
            self._cv.notify()
        return fut

    def reset_prefix_cache(self, timeout: float = 2.0) -> bool:
        """Empty the prefix cache (any thread). The engine lock is free only while the engine is
        idle or parked; a busy engine has requests holding blocks, so that is False either way."""
        if not self._lock.acquire(timeout=timeout):
            return False
        try:
            return self.engine.reset_prefix_cache()
        finally:
            self._lock.release()

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
                profile, self._profile = self._profile, []
            for _, fut in profile:
                fut.set_exception(EngineClosedError("the engine stopped"))
            self._idle.set()
            self._lock.release()

    def _wait_for_work(self) -> None:
        """Sleep (engine lock released) until a request, an abort or shutdown arrives."""
        self.stats = self.engine.stats()
        self._lock.release()
        try:
            with self._cv:
                while not (self._pending or self._aborts or self._profile or self._exit):
                    self._idle.set()
                    self._cv.wait()
        finally:
            self._lock.acquire()

    def _step(self) -> None:
        try:
            outputs = self.engine.step_fn().outputs
        except EngineDeadError as e:  # a tensor-parallel worker died: no step can run any more
            log.error("%s; the engine stops", e)
            self._fail_all(e, include_pending=True)
            with self._cv:
                self._stopping = self._exit = True
            return
        except Exception as e:  # e.g. a kernel failure: fail this batch, keep serving
            log.exception("engine step failed; aborting all requests")
            self._fail_all(e)
            return
        self.stats = self.engine.stats()
        live = self._live
        outputs = [out for out in outputs if out.request_id in live]  # not aborted after scheduling
        for out in outputs:
            if out.finished:
                live.discard(out.request_id)
        self._notify(outputs)

    def _notify(self, outputs: list) -> None:
        aborted, self._aborted = self._aborted, []
        try:
            self.on_step(outputs, self.stats, aborted)
        except Exception:  # observers must not take the engine down
            log.exception("step callback failed")

    def _apply_pending(self) -> None:
        """Add pending requests, then apply aborts (in that order, so an abort that overtook
        its own add still wins). Caller holds the engine lock."""
        with self._cv:
            adds, self._pending = self._pending, deque()
            aborts, self._aborts = self._aborts, []
            parked = self._parked
            profile, self._profile = ([], self._profile) if parked else (self._profile, [])
        settled = []
        for add in adds:
            try:
                self.engine.add_request(add.request)
            except Exception as e:  # ValueError for bad input; anything else still goes back
                settled.append((add, e))
                continue
            self._live.add(add.request.request_id)
            settled.append((add, None))
        deferred = []
        for rid, status, stop_reason in aborts:
            req = self.engine.requests.get(rid)
            if parked and req is not None and req.status is RequestStatus.RUNNING:
                deferred.append((rid, status, stop_reason))  # it may be in the interrupted step: wait for its end
                continue
            self._live.discard(rid)
            if req is not None:
                self.engine.abort_requests([rid], status, stop_reason)
                self._aborted.append(rid)
        if deferred:
            with self._cv:
                self._aborts[:0] = deferred
        if adds or aborts:
            self.stats = self.engine.stats()
        for add, exc in settled:  # after the stats: a caller that sees its request queued sees it counted
            add.settle(exc)
        for is_start, fut in profile:  # (never while parked: see the module docstring)
            try:
                fut.set_result(self.engine.profile(is_start))
            except Exception as e:  # the caller gets the error; the engine keeps serving
                fut.set_exception(e)

    def _drain_while_parked(self) -> None:
        # Runs on the helper thread. If the engine left the gate meanwhile, this waits for
        # the next time the lock is free; the engine thread will usually have drained first.
        with self._lock:
            self._apply_pending()
            if self._aborted:
                self._notify([])

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
        """Abort every request in the engine and hand `exc` to its owner; with include_pending,
        refuse the not-yet-added ones too. Caller holds the engine lock."""
        try:
            self.engine.abort_requests(list(self.engine.requests))
        except Exception:
            log.exception("aborting the requests failed")
        live, self._live = list(self._live), set()
        if live:
            self.on_fail(live, exc)
        if include_pending:
            with self._cv:
                pending, self._pending = self._pending, deque()
            for add in pending:
                add.settle(EngineClosedError(f"the engine stopped: {exc}"))
        self.stats = self.engine.stats()

