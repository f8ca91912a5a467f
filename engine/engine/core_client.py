"""How a front end reaches its EngineCore (vLLM V1's ``v1/engine/core_client.py``).

    EngineCoreClient.make_client(multiprocess, asyncio_mode)
      InprocClient    the EngineCore in this process, stepped by the caller (LLM's default: lessons
                      read its objects, ``llm.llm_engine.engine_core.engine_core.scheduler``)
      SyncMPClient    the core in its own process, for LLMEngine (``LLM(..., multiprocess=True)``)
      AsyncMPClient   the core in its own process, for AsyncLLM (``serve``)
      AsyncInprocClient  the EngineCore in this process, stepped by a BusyLoop thread, for AsyncLLM
                      (``serve --no-multiprocessing``, and the tests and lessons that read engine objects)

V1 has no AsyncInprocClient (its make_client raises NotImplementedError for asyncio without
multiprocessing). Ours exists so that one AsyncLLM, with one set of books, serves both modes:
it hands AsyncLLM the messages the core process would send, and the same BusyLoop steps the core.

``MPClient``, the base of both multiprocess clients, starts an ``EngineCoreProc`` (a fresh
interpreter, ``python -m engine.engine.core_proc``, as multiprocessing's 'spawn' would, but
without re-running the caller's ``__main__``: a lesson or a script needs no
``if __name__ == "__main__"`` guard), binds the two ZMQ sockets it connects to (ipc:// files
in a private temporary directory), and then runs two threads of its own:

    output IO      recv + decode EngineCoreOutputs; republish their trace events, trace the
                   message (``ipc`` layer), hand it to on_message
    death monitor  waits on the process; on an unplanned exit, on_dead("engine core died: signal 9")

Sends (ADD, ABORT, UTILITY) come from any thread, under one lock (ZMQ sockets are not
thread-safe). ``call`` is a utility call that waits for its answer (which the core sends
after every trace event emitted before it, so what the caller sees next is consistent).

Start it from a thread that lives as long as the client (the main thread): on Linux the
core's PR_SET_PDEATHSIG fires when the *thread* that started it ends.
"""
from __future__ import annotations

import itertools
import logging
import os
import pickle
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import msgspec
import zmq

from engine.config import EngineConfig
from engine.engine.core_types import (
    EngineCoreAbort,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityCall,
)
from engine.engine.exceptions import EngineDeadError
from engine.engine.input_processor import wire_params
from engine.hooks import Hooks
from engine.serial_utils import encoder, outputs_decoder, send_while_alive
from engine.trace_names import IPC, IPC_RECV, IPC_SEND, PAUSED, RESUMED, TRACER
from engine.utils import child_pythonpath

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 600.0  # model load and kernel warm-up happen before the handshake (a big model on CPU)
CALL_TIMEOUT_S = 10.0
PROFILE_TIMEOUT_S = 300.0  # stopping writes torch.profiler's trace files, which can take a while
POLL_MS = 100




def spawn_core_process() -> subprocess.Popen:
    """Start ``python -m engine.engine.core_proc``. It imports torch and the engine at once, then waits on
    stdin for its arguments (MPClient.launch sends them), so a caller that spawns it first
    overlaps the two processes' imports (serve: ready ~2.5 s sooner on 2 cores). Its own process
    group: a Ctrl-C at the terminal reaches the front end only, which stops the core in order."""
    return subprocess.Popen([sys.executable, "-m", "engine.engine.core_proc"], stdin=subprocess.PIPE,
                            env=os.environ | {"PYTHONPATH": child_pythonpath()}, process_group=0)


class EngineStartupError(RuntimeError):
    """The engine core failed to start: its own error, its death, or a handshake timeout."""


def death_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"engine core died: signal {-exitcode}"
    return f"engine core died: exit code {exitcode}"


class EngineCoreClient:
    """What every client offers: add_request, abort_requests, a utility call, shutdown."""

    @staticmethod
    def make_client(multiprocess: bool, asyncio_mode: bool, config: EngineConfig, hooks: Hooks,
                    **kwargs) -> EngineCoreClient:
        if asyncio_mode:
            return (AsyncMPClient if multiprocess else AsyncInprocClient)(config, hooks, **kwargs)
        return SyncMPClient(config, hooks, **kwargs) if multiprocess else InprocClient(config, hooks)

    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    def abort_requests(self, request_ids: list[str], finish_reason: str = "abort",
                       stop_reason: str | None = None) -> None:
        raise NotImplementedError

    def call(self, method: str, *args: Any) -> Any:
        raise NotImplementedError

    def profile(self, is_start: bool = True) -> dict:
        """Start or stop profiling in the engine core (EngineCore.profile); its answer."""
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


class InprocClient(EngineCoreClient):
    """The EngineCore in this process, stepped by the caller: get_output() is one step."""

    def __init__(self, config: EngineConfig, hooks: Hooks):
        from engine.engine.core import EngineCore  # torch: never imported by the API server

        self.engine_core = EngineCore(config, hooks)

    def get_output(self) -> EngineCoreOutputs:
        outputs = self.engine_core.step_fn()
        outputs.stats, outputs.step = vars(self.engine_core.stats()), True  # as a core process sends them
        return outputs

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str], finish_reason: str = "abort",
                       stop_reason: str | None = None) -> None:
        from engine.request import RequestStatus

        status = RequestStatus.FINISHED_STOPPED if finish_reason == "stop" else RequestStatus.FINISHED_ABORTED
        self.engine_core.abort_requests(request_ids, status, stop_reason)

    def call(self, method: str, *args: Any) -> Any:
        if method == "stats":
            return vars(self.engine_core.stats())
        return getattr(self.engine_core, method)(*args)

    def profile(self, is_start: bool = True) -> dict:
        return self.engine_core.profile(is_start)

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class AsyncInprocClient(EngineCoreClient):
    """The EngineCore in this process, stepped by a BusyLoop on a thread of its own: AsyncLLM's core
    under ``serve --no-multiprocessing`` (V1 refuses asyncio without multiprocessing; see the module
    docstring). It speaks AsyncMPClient's language, so AsyncLLM has one set of books for both:
    every callback of the loop becomes the EngineCoreOutputs message the core process would send
    (an accepted or refused add, a step's outputs and stats, failed requests), handed to
    on_message unencoded, on the thread that made it (the engine thread, under the engine lock).
    Utility calls run on the caller's thread, as the core process's input thread runs them.

    engine_core: an EngineCore built already (an LLM's: lessons and tests serve it); None builds
    one in wait_ready(), warmed up, and shutdown() then stops it too."""

    pid = None  # no process of its own

    def __init__(self, config: EngineConfig, hooks: Hooks, on_message: Callable[[EngineCoreOutputs, int], None],
                 on_dead: Callable[[str], None], engine_core=None):
        self.config, self.hooks = config, hooks
        self.on_message, self.on_dead = on_message, on_dead
        self.engine_core = engine_core
        self._owns_core = engine_core is None
        self.busy_loop = None  # engine.engine.busy_loop.BusyLoop, from wait_ready() on
        self.ready: dict | None = None
        self._dead: str | None = None
        self._closing = False
        self._shutdown_lock = threading.Lock()  # a drain's stop and a forced second stop may overlap

    @property
    def parked(self) -> bool:
        return self.busy_loop is not None and self.busy_loop.is_parked

    @property
    def dead(self) -> str | None:
        """Why the engine died (a tensor-parallel worker, or the loop itself), or None."""
        loop = self.busy_loop
        if self._dead is None and loop is not None and not self._closing and not loop.is_running:
            return f"engine died: {self.engine_core.dead or 'the engine loop stopped'}"
        return self._dead

    def launch(self) -> None:
        """Nothing to start: wait_ready() builds the core on the calling thread."""

    def wait_ready(self, timeout: float = HANDSHAKE_TIMEOUT_S) -> dict:
        """Build the core (unless given one) and start its loop; the handshake's answer."""
        from engine.engine.busy_loop import BusyLoop
        from engine.engine.core_proc import handshake

        if self.ready is None:
            if self.engine_core is None:
                self.engine_core = _build_core(self.config, self.hooks)
            self.engine_core.on_dead = self._core_died
            self.busy_loop = BusyLoop(self.engine_core, self._on_step, self._on_fail).start()
            self.ready = handshake(self.engine_core, pid=None)
        return self.ready

    def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stop the loop (it aborts what it still holds: on_message hears which) and the core we built.
        Safe twice, and from two threads at once."""
        self._closing = True
        with self._shutdown_lock:
            if self.busy_loop is not None:
                self.busy_loop.stop(drain_timeout)
            if self._owns_core and self.engine_core is not None:
                self.engine_core.shutdown()

    # ---- requests (any thread) ----------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue it; on_message hears accepted or rejected. EngineClosedError (a RuntimeError): stopped."""
        from engine.engine.busy_loop import PendingAdd

        rid = request.request_id

        def settle(exc: BaseException | None) -> None:  # under the engine lock, once it is in `waiting`
            if exc is None:
                self.on_message(EngineCoreOutputs(accepted=[rid], stats=vars(self.busy_loop.stats)), 0)
            else:
                self.on_message(EngineCoreOutputs(rejected=[(rid, str(exc))]), 0)

        self.busy_loop.add_request(PendingAdd(request, settle))

    def abort_requests(self, request_ids: list[str], finish_reason: str = "abort",
                       stop_reason: str | None = None) -> None:
        from engine.request import RequestStatus

        status = RequestStatus.FINISHED_STOPPED if finish_reason == "stop" else RequestStatus.FINISHED_ABORTED
        for rid in request_ids:
            self.busy_loop.abort(rid, status, stop_reason)

    def call(self, method: str, *args: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        """A utility call, as the core process answers it (its error raised as RuntimeError)."""
        loop, core = self.busy_loop, self.engine_core
        if method == "profile":  # applied by the engine thread between steps
            return loop.profile(bool(args[0]) if args else True).result(timeout)
        utilities = {"stats": lambda: vars(loop.stats), "snapshot": self._snapshot, "ping": os.getpid,
                     "trace": lambda on: on,  # the core's events are this process's already
                     "reset_prefix_cache": loop.reset_prefix_cache,
                     "held_attention_on_triton": core.held_attention_on_triton}
        try:
            return utilities[method](*args)
        except RuntimeError:
            raise
        except Exception as e:  # as across the process boundary: one line, the type named
            raise RuntimeError(f"{type(e).__name__}: {e}") from e

    def start_call(self, method: str, *args: Any) -> Future:
        """call(), its answer on a Future (done at once: nothing here can hang)."""
        fut: Future = Future()
        try:
            fut.set_result(self.call(method, *args))
        except Exception as e:
            fut.set_exception(e)
        return fut

    def profile(self, is_start: bool = True) -> dict:
        return self.call("profile", is_start, timeout=PROFILE_TIMEOUT_S)

    def _snapshot(self) -> dict:
        with self.busy_loop._lock:  # free while the engine is idle or parked; else after this step
            return self.engine_core.snapshot()

    # ---- the engine thread's callbacks (under the engine lock) --------------------------------
    def _on_step(self, outputs: list, stats, aborted: list[str]) -> None:
        self.on_message(EngineCoreOutputs(outputs=outputs, aborted=aborted, stats=vars(stats), step=True), 0)

    def _on_fail(self, request_ids: list[str], exc: BaseException) -> None:
        dead = str(exc) if isinstance(exc, EngineDeadError) else None  # the front end fails them as dead
        self.on_message(EngineCoreOutputs(failed=request_ids, error=str(exc), fatal=dead), 0)

    def _core_died(self, reason: str) -> None:
        """A tensor-parallel worker died (the executor's monitor thread): the engine cannot run."""
        if self._dead is None and not self._closing:
            self._dead = f"engine died: {reason}"
            self.on_dead(self._dead)


def _build_core(config: EngineConfig, hooks: Hooks):
    """The EngineCore, warmed up, its startup heap frozen (what the core process builds)."""
    from engine.engine.core import EngineCore  # torch: imported only where a core runs
    from engine.gc_utils import freeze_gc_heap

    core = EngineCore(config, hooks)
    core.warm_up()
    freeze_gc_heap()
    return core


class MPClient(EngineCoreClient):
    """An engine core in another process (see the module docstring).

    on_message(msg, nbytes) runs on the output IO thread for every message after the
    handshake, and for the trace events the core ships during startup; on_dead(reason) once
    if the process exits while the client is not shutting it down. Trace events the core
    ships are republished on `hooks` before on_message sees their message."""

    def __init__(self, config: EngineConfig, hooks: Hooks, on_message: Callable[[EngineCoreOutputs, int], None],
                 on_dead: Callable[[str], None], options: dict | None = None, proc: subprocess.Popen | None = None):
        self.config, self.hooks, self.options = config, hooks, dict(options or {})
        self.parked = False  # the core's step controller holds its engine (from its trace events)
        self._spawned = proc  # from spawn_core_process(), started early; None: launch() starts one
        self.on_message, self.on_dead = on_message, on_dead
        self.ready: dict | None = None  # the handshake: num_blocks, block_size, max_model_len, pid, ...
        self.proc: subprocess.Popen | None = None
        self._dir = tempfile.mkdtemp(prefix="vllm-trace-")
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._output = self._ctx.socket(zmq.PULL)
        self._input.bind(f"ipc://{self._dir}/input")
        self._output.bind(f"ipc://{self._dir}/output")
        self._send_lock = threading.Lock()
        self._encode = encoder().encode
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count(1)
        self._ready = threading.Event()
        self._startup_error: str | None = None
        self._closing = False  # no more sends, the output thread ends
        self._shutdown_lock, self._shut_down = threading.Lock(), False
        self._dead: str | None = None
        self._fatal: str | None = None  # why the core said it exits (a worker died), before it did
        self._threads: list[threading.Thread] = []
        self.bad_frames = 0  # frames on the output socket that did not decode (skipped)
        self._bad_frame_logged = -1.0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def dead(self) -> str | None:
        """Why the core died, or None while it lives (or was shut down on purpose)."""
        return self._dead

    # ---- lifecycle ----------------------------------------------------------------------------
    def launch(self) -> None:
        """Start the process and the IO threads; returns at once (see wait_ready)."""
        args = (self.config, f"ipc://{self._dir}/input", f"ipc://{self._dir}/output", os.getpid(), self.options)
        self.proc = self._spawned if self._spawned is not None else spawn_core_process()
        self.proc.stdin.write(pickle.dumps(args))
        self.proc.stdin.close()
        for target, name in ((self._output_loop, "core-output-io"), (self._monitor, "core-monitor")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def wait_ready(self, timeout: float = HANDSHAKE_TIMEOUT_S) -> dict:
        """Block until the handshake; raises EngineStartupError with one line saying why not."""
        if not self._ready.wait(timeout):
            self.shutdown(0)
            raise EngineStartupError(f"the engine core did not answer the handshake within {timeout:.0f} s")
        if self.ready is None:
            self.shutdown(0)
            raise EngineStartupError(self._startup_error or "the engine core failed to start")
        return self.ready

    def shutdown(self, drain_timeout: float = 0.0, timeout: float = 10.0) -> None:
        """Stop the core (it aborts what it still holds, then exits), then the threads. Safe twice,
        and from two threads at once (a drain's stop and a forced second stop): the second caller
        waits for the first one's shutdown to finish; sockets are never closed under a send."""
        with self._shutdown_lock:
            if not self._shut_down:
                self._shutdown(drain_timeout, timeout)
                self._shut_down = True

    def _shutdown(self, drain_timeout: float, timeout: float) -> None:
        if self.proc is not None and self.proc.poll() is None and self.ready is not None and self._dead is None:
            try:
                self.call("shutdown", drain_timeout, timeout=timeout + drain_timeout)
            except Exception:
                pass
        with self._send_lock:  # a send in progress finishes first; later ones see _closing
            self._closing = True
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(2)
        for fut in list(self._calls.values()):
            if not fut.done():
                fut.set_exception(EngineStartupError("the engine core stopped"))
        self._ctx.destroy(linger=0)  # closes both sockets, then terminates
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- sends (any thread) -----------------------------------------------------------------
    def _send(self, kind: EngineCoreRequestType, obj, before: Callable[[int], None] | None = None) -> int:
        payload = self._encode(obj)
        if before is not None:
            before(len(payload))  # e.g. trace the send: before the answer can possibly be traced
        with self._send_lock:
            if self._closing:
                raise RuntimeError("the engine core client is closed")
            # (often on the event loop's thread: a core that just died must not block it for ever)
            code = send_while_alive(self._input, (kind.value, payload), self.proc, copy=False)
        if code is not None:
            raise RuntimeError(self._why_dead(code))
        return len(payload)

    def add_request(self, request: EngineCoreRequest) -> int:
        """Send an ADD (its sampling_params a SamplingParams, sent as a dict)."""
        wire = msgspec.structs.replace(request, sampling_params=wire_params(request.sampling_params))
        return self._send(EngineCoreRequestType.ADD, wire, self._trace_add(request) if self.hooks.active else None)

    def abort_requests(self, request_ids: list[str], finish_reason: str = "abort",
                       stop_reason: str | None = None) -> int:
        """Send an ABORT; finish_reason "stop": the output processor matched stop_reason, a stop string."""
        before = self._trace_abort(request_ids, finish_reason, stop_reason) if self.hooks.active else None
        return self._send(EngineCoreRequestType.ABORT, EngineCoreAbort(request_ids, finish_reason, stop_reason), before)

    def _trace_add(self, request: EngineCoreRequest) -> Callable[[int], None]:
        rid = request.request_id
        return lambda nbytes: self.hooks.emit(IPC, IPC_SEND, request_id=rid, type="ADD", request_ids=[rid],
                                              bytes=nbytes, num_prompt_tokens=len(request.prompt_token_ids))

    def _trace_abort(self, ids: list[str], finish_reason: str, stop_reason) -> Callable[[int], None]:
        why = {"finish_reason": "stop", "stop_reason": stop_reason} if finish_reason == "stop" else {}
        return lambda nbytes: self.hooks.emit(IPC, IPC_SEND, request_id=ids[0] if len(ids) == 1 else None,
                                              type="ABORT", request_ids=ids, bytes=nbytes, **why)

    def call(self, method: str, *args: Any, wait: bool = True, timeout: float = CALL_TIMEOUT_S) -> Any:
        """A utility call in the core. With wait, its result (its error raised as RuntimeError)."""
        if not wait:
            self._send(EngineCoreRequestType.UTILITY, UtilityCall(0, method, list(args)))
            return None
        call_id, fut = next(self._call_ids), Future()
        self._calls[call_id] = fut
        try:
            self._send(EngineCoreRequestType.UTILITY, UtilityCall(call_id, method, list(args)))
            return fut.result(timeout)
        finally:
            self._calls.pop(call_id, None)

    def profile(self, is_start: bool = True) -> dict:
        """A utility call, answered by the core's engine thread between steps."""
        return self.call("profile", is_start, timeout=PROFILE_TIMEOUT_S)

    def start_call(self, method: str, *args: Any) -> Future:
        """A utility call whose answer (its error as RuntimeError) arrives on the returned Future;
        nothing here waits for it (a health probe that must not tie up a thread)."""
        call_id, fut = next(self._call_ids), Future()
        self._calls[call_id] = fut
        fut.add_done_callback(lambda _: self._calls.pop(call_id, None))
        try:
            self._send(EngineCoreRequestType.UTILITY, UtilityCall(call_id, method, list(args)))
        except BaseException:
            self._calls.pop(call_id, None)
            raise
        return fut

    # ---- threads ----------------------------------------------------------------------------
    def _output_loop(self) -> None:
        decode, sock = outputs_decoder().decode, self._output
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._closing:
            try:
                if not poller.poll(POLL_MS):
                    continue
                frame = sock.recv(copy=False)
            except zmq.ZMQError:
                return  # closed under us at shutdown
            # One bad frame must not end this thread: nothing would read the core any more, and
            # every request would wait for ever while the server looked healthy.
            try:
                self._handle(decode(frame.buffer), len(frame))
            except msgspec.DecodeError as e:  # not the core's (any process of this user can connect)
                self._bad_frame(len(frame), e)
            except Exception as e:  # well-formed msgpack that makes no sense (not the core's either)
                self._bad_frame(len(frame), f"{type(e).__name__}: {e}")

    def _handle(self, msg: EngineCoreOutputs, nbytes: int) -> None:
        if msg.fatal is not None:
            self._fatal = msg.fatal
        if msg.ready is not None or msg.startup_error is not None:
            if self._ready.is_set():
                raise ValueError("a second handshake")
            self.ready, self._startup_error = msg.ready, msg.startup_error
            self._deliver(msg, nbytes)  # its events: the core's last startup stages
            self._ready.set()
            return
        if msg.utility is not None:
            call_id, ok, result = msg.utility
            fut = self._calls.get(call_id)
            msg.utility = None
            self._deliver(msg, nbytes)  # events first: the caller then sees a consistent state
            if fut is not None and not fut.done():
                fut.set_result(result) if ok else fut.set_exception(RuntimeError(result))
            return
        self._deliver(msg, nbytes)

    def _bad_frame(self, nbytes: int, error: object) -> None:
        """A frame that is no EngineCoreOutputs reached the output socket (any process of this
        user can connect to it): say so, at most once a second, and go on reading."""
        self.bad_frames += 1
        now = time.monotonic()
        if now - self._bad_frame_logged >= 1.0:
            self._bad_frame_logged = now
            log.warning("ignored a %d-byte frame on the engine core's output socket that is not an engine "
                        "message (%s); %d so far", nbytes, error, self.bad_frames)

    def _deliver(self, msg: EngineCoreOutputs, nbytes: int) -> None:
        # A failing observer (a trace listener) must not end this thread: nothing would read the
        # core any more, and the handshake or every request would wait for ever.
        try:
            if msg.events and self.hooks.active:
                self._republish(msg.events)
            if self.hooks.active and (msg.outputs or msg.accepted or msg.rejected or msg.failed):
                self._trace_recv(msg, nbytes)
            self.on_message(msg, nbytes)
        except Exception:
            log.exception("handling a message from the engine core failed")

    def _republish(self, events: list) -> None:
        for ev in events:
            if ev[0] == TRACER and ev[1] in (PAUSED, RESUMED):
                self.parked = ev[1] == PAUSED
        self.hooks.emit_many([ev[:6] for ev in events], [ev[6] for ev in events])

    def _trace_recv(self, msg: EngineCoreOutputs, nbytes: int) -> None:
        ids = [o.request_id for o in msg.outputs] + msg.accepted + [r for r, _ in msg.rejected] + msg.failed
        step = msg.stats["step"] - 1 if msg.step and msg.stats else None  # the step these outputs are from
        self.hooks.emit(IPC, IPC_RECV, step=step, type="OUTPUTS" if msg.outputs else "ADDED", request_ids=ids,
                        bytes=nbytes, num_events=len(msg.events))

    def _why_dead(self, exitcode: int | None) -> str:
        return f"engine core died: {self._fatal}" if self._fatal else death_reason(exitcode)

    def _monitor(self) -> None:
        code = self.proc.wait()
        if self._closing:
            return
        time.sleep(0.05)  # let the output thread deliver what the core sent before it died
        self._dead = self._why_dead(code)
        if not self._ready.is_set():
            self._startup_error = self._startup_error or f"{self._dead} during startup"
            self._ready.set()
        for fut in list(self._calls.values()):
            if not fut.done():
                fut.set_exception(RuntimeError(self._dead))
        self.on_dead(self._dead)


class AsyncMPClient(MPClient):
    """The multiprocess client of AsyncLLM: each message goes to on_message on the output IO
    thread, which hands outputs to the requests' asyncio collectors."""


class SyncMPClient(MPClient):
    """The multiprocess client of LLMEngine: add_request waits until the core has the request
    (raising its ValueError), get_output() blocks for the next step's outputs."""

    def __init__(self, config: EngineConfig, hooks: Hooks, options: dict | None = None):
        super().__init__(config, hooks, self._on_message, self._on_core_dead, options)
        self._outputs: queue.Queue = queue.Queue()
        self._adds: dict[str, Future] = {}
        self.launch()
        self.ready = self.wait_ready()

    def add_request(self, request: EngineCoreRequest) -> None:
        fut = self._adds[request.request_id] = Future()
        try:
            super().add_request(request)
            fut.result()
        finally:
            self._adds.pop(request.request_id, None)

    def get_output(self) -> EngineCoreOutputs:
        msg = self._outputs.get()
        if isinstance(msg, BaseException):
            raise msg
        return msg

    def _on_message(self, msg: EngineCoreOutputs, nbytes: int) -> None:
        for rid, error in [(r, None) for r in msg.accepted] + msg.rejected:
            fut = self._adds.get(rid)
            if fut is not None:
                fut.set_result(None) if error is None else fut.set_exception(ValueError(error))
        if msg.failed:
            self._outputs.put((EngineDeadError if msg.fatal else RuntimeError)(msg.error))
        elif msg.step:
            self._outputs.put(msg)

    def _on_core_dead(self, reason: str) -> None:
        for fut in list(self._adds.values()):
            if not fut.done():
                fut.set_exception(RuntimeError(reason))
        self._outputs.put(RuntimeError(reason))

    def shutdown(self, drain_timeout: float = 0.0, timeout: float = 10.0) -> None:
        super().shutdown(drain_timeout, timeout)
