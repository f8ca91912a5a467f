"""EngineCoreProc: the engine core in its own process (vLLM V1's ``EngineCoreProc``).

Three threads, so that socket work overlaps the step:

    input IO (the process's main thread)   recv ADD / ABORT / UTILITY, decode, hand to the core
    engine loop (BusyLoop's thread)        EngineCore.step(): schedule -> execute_model -> update_from_output
    output IO                              encode EngineCoreOutputs and send them

The process is a fresh interpreter (``python -m engine.engine.core_proc``, its arguments pickled on
stdin; fork with live threads and torch is unsafe). It connects to the two sockets the front
end bound, builds the engine (its startup stages are traced and shipped live), then answers
the handshake with num_blocks, block_size and max_model_len. It never outlives the front end:
PR_SET_PDEATHSIG (Linux) kills it when its parent dies, even by SIGKILL, and a watcher thread
exits if the parent pid changes (other systems, or a parent whose launching thread ended first).
"""
from __future__ import annotations

import ctypes
import importlib
import logging
import os
import queue
import signal
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import fields

import msgspec
import zmq

from engine.config import EngineConfig
from engine.engine.busy_loop import BusyLoop, PendingAdd
from engine.engine.core_types import (
    EngineCoreAbort,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityCall,
)
from engine.engine.exceptions import EngineClosedError, EngineDeadError
from engine.gc_utils import freeze_gc_heap
from engine.hooks import Hooks
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from engine.serial_utils import EventShipper, encoder
from engine.utils import RUNTIME_DIR_ENV

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
PARENT_POLL_S = 0.5
IDLE_FLUSH_S = 0.02  # trace events emitted outside a step (a pause, a request queued while held) wait at most this
_PARAM_FIELDS = {f.name for f in fields(SamplingParams) if f.init}


def die_with_parent(parent_pid: int) -> None:
    """Exit when the front end does: the kernel's parent-death signal, plus a watcher thread."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # it died before the signal was armed
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def handshake(engine, pid: int | None) -> dict:
    """What the front end learns of a built engine: the core's answer to the handshake."""
    kv = engine.kv_cache_manager
    return dict(num_blocks=kv.block_pool.num_gpu_blocks, block_size=kv.block_size, max_model_len=engine.max_model_len,
                model_path=str(engine.model_path), device=str(engine.device),
                attention_backend=engine.attention_backend, vocab_size=engine.model_config.vocab_size,
                pid=pid, stats=vars(engine.stats()), startup=[list(s[:2]) for s in engine.startup])


def params_from_wire(d: dict) -> SamplingParams:
    # the core sends every step's tokens: what the caller sees (final only or not) is the front end's business
    return SamplingParams(**{k: v for k, v in d.items() if k in _PARAM_FIELDS and k != "output_kind"})


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int, options: dict) -> None:
    """The process's entry point."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the front end, which stops us in order
    if input_addr.startswith("ipc://"):  # the workers' sockets in the front end's private directory
        os.environ[RUNTIME_DIR_ENV] = os.path.dirname(input_addr[len("ipc://"):])
    logging.basicConfig(level=logging.WARNING, format="engine-core %(levelname)s %(name)s: %(message)s")
    proc = EngineCoreProc(config, input_addr, output_addr, options)
    code = proc.run()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no atexit: the front end already has everything, and torch's teardown is slow


class EngineCoreProc:
    """One engine core behind an input and an output socket (see the module docstring).

    options: trace (ship trace events), install ("module:function" called in this process with
    (hooks, engine_core, options) that returns more utility methods: the tracer's step
    controller), fail_startup (a test hook: fail the handshake with this message)."""

    def __init__(self, config: EngineConfig, input_addr: str, output_addr: str, options: dict):
        self.config, self.options = config, options
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.connect(input_addr)
        # its own context: terminating it flushes what was sent, while the input thread still listens
        self.out_ctx = zmq.Context()
        self.output = self.out_ctx.socket(zmq.PUSH)
        self.output.setsockopt(zmq.LINGER, 2000)
        self.output.connect(output_addr)
        self.hooks = Hooks()
        self.shipper = EventShipper(self.hooks) if options.get("trace") else None
        self.out_q: queue.Queue = queue.Queue()
        self._order = threading.Lock()  # takes the shipper's events and queues their message as one
        self.core: BusyLoop | None = None
        self.utilities = {"stats": self._stats, "snapshot": self._snapshot, "ping": os.getpid, "trace": self._trace,
                          "reset_prefix_cache": lambda: self.core.reset_prefix_cache(),
                          "profile": lambda is_start=True: self.core.profile(bool(is_start))}
        self._done = threading.Event()
        self._out_thread = threading.Thread(target=self._output_loop, name="output-io", daemon=True)
        self._out_thread.start()

    # ---- startup ----------------------------------------------------------------------------
    def _build(self) -> dict:
        from engine.engine.core import EngineCore

        if self.options.get("fail_startup"):
            raise RuntimeError(self.options["fail_startup"])
        engine = EngineCore(self.config, self.hooks)
        engine.on_dead = self._worker_died
        engine.warm_up()
        freeze_gc_heap()
        self.core = BusyLoop(engine, self._on_step, self._on_fail)
        # runs on the input thread: the engine's thread is the one held before the launch
        self.utilities["held_attention_on_triton"] = engine.held_attention_on_triton
        install = self.options.get("install")
        if install:
            module, func = install.split(":")
            self.utilities |= getattr(importlib.import_module(module), func)(self.hooks, self.core, self.options)
        self.core.start()
        return handshake(engine, pid=os.getpid())

    def run(self) -> int:
        try:
            ready = self._build()
        except BaseException as e:  # one line for the front end; it prints it and exits
            self._send(EngineCoreOutputs(startup_error=f"{type(e).__name__}: {e}"))
            self._finish()
            return 1
        self._send(EngineCoreOutputs(ready=ready))
        try:
            self._input_loop()
        finally:
            self._finish()
        return 0

    def _finish(self) -> None:
        self.out_q.put(None)  # the output thread sends what is queued, then ends
        self._out_thread.join(5)
        self.input.close(linger=0)
        self.output.close()
        self.out_ctx.term()
        self.ctx.term()

    # ---- input IO ---------------------------------------------------------------------------
    def _input_loop(self) -> None:
        decode_add = msgspec.msgpack.Decoder(EngineCoreRequest)
        decode_abort = msgspec.msgpack.Decoder(EngineCoreAbort)
        decode_call = msgspec.msgpack.Decoder(UtilityCall)
        while not self._done.is_set():
            kind, payload = self.input.recv_multipart(copy=False)
            kind = EngineCoreRequestType(bytes(kind.buffer))
            if kind is EngineCoreRequestType.ADD:
                self._add(decode_add.decode(payload.buffer))
            elif kind is EngineCoreRequestType.ABORT:
                msg = decode_abort.decode(payload.buffer)
                stopped = msg.finish_reason == "stop"
                status = RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_ABORTED
                for rid in msg.request_ids:
                    self.core.abort(rid, status, msg.stop_reason)
            else:
                self._utility(decode_call.decode(payload.buffer))

    def _add(self, req: EngineCoreRequest) -> None:
        rid = req.request_id

        def settle(exc: BaseException | None) -> None:  # under the engine lock, once it is in `waiting`
            if exc is None:
                self._send(EngineCoreOutputs(accepted=[rid], stats=vars(self.core.stats)))
            else:
                self._send(EngineCoreOutputs(rejected=[(rid, str(exc))]))

        try:
            req.sampling_params = params_from_wire(req.sampling_params)
            self.core.add_request(PendingAdd(req, settle))
        except (ValueError, EngineClosedError) as e:
            settle(e)

    def _utility(self, call: UtilityCall) -> None:
        if call.method == "shutdown":
            self.core.stop(float(call.args[0]) if call.args else 0.0)
            self._done.set()
            self._send(EngineCoreOutputs(utility=(call.call_id, True, None)))
            return
        try:
            result, ok = self.utilities[call.method](*call.args), True
        except Exception as e:  # the caller gets the error; the core keeps serving
            result, ok = f"{type(e).__name__}: {e}", False
        if isinstance(result, Future):  # answered by the engine thread (profile): this thread goes on reading
            result.add_done_callback(lambda fut: self._answer(call.call_id, fut))
        elif call.call_id:
            self._send(EngineCoreOutputs(utility=(call.call_id, ok, result)))

    def _answer(self, call_id: int, fut: Future) -> None:
        exc = fut.exception()
        result, ok = (fut.result(), True) if exc is None else (f"{type(exc).__name__}: {exc}", False)
        if call_id:
            self._send(EngineCoreOutputs(utility=(call_id, ok, result)))

    def _trace(self, on: bool) -> bool:
        """Ship trace events or not (`serve --no-trace` ships only its startup stages)."""
        with self._order:
            if on and self.shipper is None:
                self.shipper = EventShipper(self.hooks)
            elif not on and self.shipper is not None:
                self.shipper.close()
                self.shipper = None
        return on

    def _stats(self) -> dict:
        return vars(self.core.stats)

    def _snapshot(self) -> dict:
        with self.core._lock:  # free while the engine is idle or parked; else after this step
            return self.core.engine.snapshot()

    # ---- the engine thread's callbacks --------------------------------------------------------
    def _on_step(self, outputs: list, stats, aborted: list[str]) -> None:
        self._send(EngineCoreOutputs(outputs=outputs, aborted=aborted, stats=vars(stats), step=True))

    def _on_fail(self, request_ids: list[str], exc: BaseException) -> None:
        dead = str(exc) if isinstance(exc, EngineDeadError) else None  # the front end fails them as dead
        self._send(EngineCoreOutputs(failed=request_ids, error=str(exc), fatal=dead))

    def _worker_died(self, reason: str) -> None:
        """A tensor-parallel worker died or raised: say why, then exit, so the front end takes the
        path of the core's own death (requests fail with the reason, new ones get 503)."""
        log.error("%s: the engine core exits", reason)
        self._send(EngineCoreOutputs(fatal=reason))
        self.out_q.put(None)
        self._out_thread.join(5)
        self.output.close()
        self.out_ctx.term()  # delivered (or 2 s of linger passed) before the process ends
        os._exit(3)

    def _send(self, msg: EngineCoreOutputs) -> None:
        """Queue msg for the output thread, with every trace event emitted before it (from any
        thread): the front end republishes them first, so what a message caused follows it."""
        if self.shipper is None:  # (read without the lock: tracing off costs nothing here)
            self.out_q.put(msg)
            return
        with self._order:
            if self.shipper is not None:
                msg.events = self.shipper.take()
            self.out_q.put(msg)

    # ---- output IO ----------------------------------------------------------------------------
    def _output_loop(self) -> None:
        encode, send = encoder().encode, self.output.send
        while True:
            try:
                msg = self.out_q.get(timeout=IDLE_FLUSH_S if self.shipper is not None else 1.0)
            except queue.Empty:  # events from outside a step (a pause, startup): flush them
                with self._order:
                    shipper = self.shipper
                    if shipper is not None and len(shipper) and self.out_q.empty():  # nothing queued is older
                        send(encode(EngineCoreOutputs(events=shipper.take())))
                continue
            if msg is None:
                with self._order:
                    if self.shipper is not None and len(self.shipper):
                        send(encode(EngineCoreOutputs(events=self.shipper.take())))
                return
            send(encode(msg))


if __name__ == "__main__":
    import pickle

    import engine.engine.core  # noqa: F401  torch and the engine now, while the front end starts (spawned early)

    try:
        core_args = pickle.load(sys.stdin.buffer)  # spawned early: this waits while the front end starts
    except EOFError:  # the front end stopped (a bad flag, Ctrl-C) before it sent our arguments
        sys.exit(0)
    run_engine_core(*core_args)
