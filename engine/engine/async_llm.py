"""AsyncLLM: the API server's engine (vLLM V1's ``v1/engine/async_llm.py``), its core in its own
process or in this one.

    front end (this process)                         engine core (EngineCoreProc, or a BusyLoop thread)
    tokenize -> EngineCoreRequest (token ids) --ADD-->  waiting -> step -> EngineCoreOutputs
    RequestOutput <- OutputProcessor (text, stops) <--  new token ids, finish, stats, events

It is the one implementation of ``EngineClient`` (``engine/engine/protocol.py``), the interface the
server and the TUI are typed against. It reaches its core through an ``EngineCoreClient``
(``self.engine_core``, V1's name): an ``AsyncMPClient`` (the core in its own process, as vLLM V1)
or, with ``multiprocess=False`` (``serve --no-multiprocessing``, the tests and lessons that read
engine objects: ``AsyncLLM.from_engine_core``), an ``AsyncInprocClient`` (the EngineCore stepped by
a BusyLoop in a thread of this process). Both clients hand it the same messages, so the
bookkeeping here is one: outputs are processed where the message arrives (the client's output IO
thread; in one process the engine thread) and handed to each request's RequestOutputCollector
with one ``call_soon_threadsafe`` per message.

Tracing: the core ships its trace events (with their own perf_counter_ns times, one clock on
Linux) only while this process has listeners on ``hooks``; they are republished here, in
the order the core emitted them, before anything the message they came with causes here
(the QUEUED of a request before its add returns; a step's events before its NEW_TOKENS).
Each message across the boundary is also traced in the ``ipc`` layer (type, request ids,
bytes), except messages that carry only trace events. In one process the core emits on
``hooks`` itself, and nothing crosses a boundary.

Design choices (and why):
* One process is there for comparison and for the tests and lessons that read engine objects;
  the server, the TUI and the trace schema are the same over both (the tests run in both modes).
* The core is started as ``python -m engine.engine.core_proc`` (a fresh interpreter, like 'spawn')
  rather than multiprocessing's spawn, which re-runs the caller's ``__main__``: a lesson or a
  user's script then needs no ``if __name__ == "__main__"`` guard.
* Outputs are processed on the client's IO thread, not on the event loop: the loop (HTTP, the
  TUI) never detokenizes. A stop string found here is sent to the core as an ABORT with
  finish_reason "stop", so the core frees the blocks and traces FINISHED(stop). vLLM V1's
  front end sends only the ids and its core records an abort (``AsyncLLM._process_outputs``
  then ``EngineCore.abort_requests``); ours says why, so the core's own trace is complete.
"""
from __future__ import annotations

import asyncio
import logging
import subprocess
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from typing import AsyncIterator, Callable

from engine.config import EngineConfig
from engine.engine.core_client import HANDSHAKE_TIMEOUT_S, EngineCoreClient
from engine.engine.core_types import EngineCoreOutputs
from engine.engine.exceptions import EngineClosedError, EngineDeadError
from engine.engine.input_processor import InputProcessor
from engine.engine.output_processor import OutputProcessor, RequestOutputCollector, RequestStream, call_soon, deliver
from engine.engine.parallel_sampling import fan_out
from engine.engine.protocol import EngineClient, StepListener
from engine.hooks import BEGIN, END, Hooks
from engine.model_executor.model_loader import resolve
from engine.outputs import EngineStats, RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer
from engine.trace_names import CLI, CORE_DIED, CORE_HANDSHAKE, CORE_PROCESS_START, IPC

log = logging.getLogger(__name__)


class _Stream:
    """One request's consumer; core_ids: the requests the core knows it by (n > 1: the children)."""
    __slots__ = ("loop", "collector", "accepted", "request_id", "core_ids", "pending")

    def __init__(self, loop: asyncio.AbstractEventLoop, request_id: str, core_ids: list[str]):
        self.loop, self.collector, self.accepted = loop, RequestOutputCollector(), loop.create_future()
        self.request_id, self.core_ids, self.pending = request_id, core_ids, len(core_ids)


def _settle(fut: asyncio.Future, exc: BaseException | None) -> None:
    if not fut.done():  # the caller may have given up (cancelled) meanwhile
        fut.set_exception(exc) if exc is not None else fut.set_result(None)


HEALTH_TIMEOUT_S = 5.0  # a core whose input thread has not answered a ping for this long is unhealthy
RERUN_TIMEOUT_S = 300.0  # a held launch re-run on Triton in the core (see held_attention_on_triton)


class AsyncLLM(EngineClient):
    """The engine behind the server (see the module docstring).

    launch() starts the core process (call it on the main thread); wait_ready() blocks until the
    handshake (in one process: builds the core and starts its loop); start() does both if needed.
    core_options (a core process): trace (ship trace events), install ("module:function" run in the
    core, e.g. the tracer's step controller). multiprocess=False: the core in this process (its
    events on `hooks` directly, a step controller on them holds it; core_options and core_proc do
    not apply)."""

    def __init__(self, config: EngineConfig, hooks: Hooks | None = None, drain_timeout: float = 5.0,
                 core_options: dict | None = None, on_dead: Callable[[str], None] | None = None,
                 core_proc: subprocess.Popen | None = None, *, multiprocess: bool = True, engine_core=None):
        if multiprocess:  # this process is the API server: the core's ranks leave it cores (engine.cpu_threads)
            config = replace(config, parallel=replace(config.parallel, api_process_count=1))
        self.config = config
        self.hooks = hooks or Hooks()
        self.drain_timeout = drain_timeout
        self.multiprocess = multiprocess
        self.step_listeners: list[StepListener] = []
        self.on_dead = on_dead  # called (a client's thread) when the core dies unplanned
        if engine_core is None:
            self.model_path = resolve(config.model.model)
            self.tokenizer = load_tokenizer(self.model_path)
        else:  # the core's own: loaded once
            self.model_path, self.tokenizer = engine_core.model_path, engine_core.tokenizer
        self.stats: EngineStats | None = None
        self.max_model_len = self.num_blocks = self.block_size = None
        self.device = self.attention_backend = self.vocab_size = None
        self.input_processor = InputProcessor(self.tokenizer, self.hooks)
        self.output_processor = OutputProcessor(self.tokenizer, self.hooks)
        client = dict(options=core_options, proc=core_proc) if multiprocess else dict(engine_core=engine_core)
        self.engine_core = EngineCoreClient.make_client(multiprocess, True, config, self.hooks,
                                                        on_message=self._on_message, on_dead=self._on_dead, **client)
        if engine_core is not None:  # what a handshake would say is known now (build_app reads it)
            from engine.engine.core_proc import handshake
            self._learn(handshake(engine_core, pid=None))
        self._streams: dict[str, _Stream] = {}  # by request id; guarded by _lock, with the processor's requests
        self._by_core_id: dict[str, _Stream] = {}  # by the ids the core knows (n > 1: the children's)
        self._lock = threading.Lock()
        self._idle = threading.Event()  # no request in flight
        self._idle.set()
        self._launched = self._started = self._stopping = False
        self._ping: tuple[float, Future | None] = (0.0, None)  # check_health's ping in flight: (sent, answer)

    @classmethod
    def from_engine_core(cls, engine_core, drain_timeout: float = 5.0,
                         on_dead: Callable[[str], None] | None = None) -> AsyncLLM:
        """Serve an EngineCore built already (an LLM's, ``llm.llm_engine.engine_core.engine_core``),
        in this process, on its hooks; start() starts its loop."""
        return cls(engine_core.config, engine_core.hooks, drain_timeout, on_dead=on_dead, multiprocess=False,
                   engine_core=engine_core)

    # ---- properties of the front-end interface ------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._started and not self._stopping and self.engine_core.dead is None

    @property
    def is_parked(self) -> bool:
        """True while a step controller holds the core's engine (another process: seen from its trace events)."""
        return self.engine_core.parked

    @property
    def dead(self) -> str | None:
        return self.engine_core.dead

    @property
    def core_pid(self) -> int | None:
        return self.engine_core.pid

    @property
    def step_count(self) -> int:
        return self.stats.step if self.stats is not None else 0

    async def check_health(self) -> None:
        """Raise EngineDeadError unless the core is alive *and answering* (vLLM's check_health): a
        ping the core's input IO thread answers, within HEALTH_TIMEOUT_S. That thread answers while
        a step controller holds the engine thread, so a paused core is healthy; a frozen process
        (SIGSTOP) or a front end that no longer reads the core is not. Concurrent checks share
        the one ping in flight: once it is older than the timeout, they fail at once. (A core in
        this process answers at once: alive is its loop's thread running, the engine not dead.)"""
        if not self.is_running:
            raise EngineDeadError(self.engine_core.dead or "the engine is not running (shutting down?)")
        sent, fut = self._ping
        if fut is None or fut.done():
            try:
                sent, fut = self._ping = time.monotonic(), self.engine_core.start_call("ping")
            except RuntimeError as e:  # the core died meanwhile
                raise EngineDeadError(str(e)) from None
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)),
                                   max(0.0, sent + HEALTH_TIMEOUT_S - time.monotonic()))
        except TimeoutError:
            raise EngineDeadError(f"the engine core has not answered for {time.monotonic() - sent:.1f} s "
                                  f"(pid {self.engine_core.pid})") from None
        except RuntimeError as e:
            raise EngineDeadError(str(e)) from None

    def held_attention_on_triton(self) -> dict:
        """A utility call: the core runs the launch it is held before through the Triton kernel
        (interpreted on a CPU: seconds, hence the long timeout). Blocks: call it off the loop."""
        return self.engine_core.call("held_attention_on_triton", timeout=RERUN_TIMEOUT_S)

    async def reset_prefix_cache(self) -> bool:
        """A utility call: empty the core's prefix cache; False while requests hold blocks."""
        return await asyncio.to_thread(self.engine_core.call, "reset_prefix_cache")

    async def start_profile(self) -> dict:
        """A utility call: profile every op of the forward pass from the next step on (EngineCore.profile)."""
        return await asyncio.to_thread(self.engine_core.profile, True)

    async def stop_profile(self) -> dict:
        """A utility call: end the profiled window (with a profiler_dir, each rank's trace_file)."""
        return await asyncio.to_thread(self.engine_core.profile, False)

    # ---- lifecycle ----------------------------------------------------------------------------
    def launch(self) -> AsyncLLM:
        if not self._launched:
            self._launched = True
            t0 = time.perf_counter()
            traced = self.multiprocess and self.hooks.active  # (one process: no process starts)
            if traced:
                self.hooks.emit(CLI, CORE_PROCESS_START, BEGIN, model=self.config.model.model)
            self.engine_core.launch()
            if traced:
                self.hooks.emit(CLI, CORE_PROCESS_START, END, seconds=time.perf_counter() - t0, pid=self.pid)
        return self

    def wait_ready(self, timeout: float = HANDSHAKE_TIMEOUT_S) -> dict:
        """Block until the core has built its engine and answered the handshake. Raises
        EngineStartupError (one line: the core's own error, its death or a timeout); in one
        process, the build's own error."""
        t0, traced = time.perf_counter(), self.multiprocess and self.hooks.active
        if traced:
            self.hooks.emit(CLI, CORE_HANDSHAKE, BEGIN, pid=self.engine_core.pid)
        ready = self.engine_core.wait_ready(timeout)
        self._learn(ready)
        if traced:
            self._trace_ready(time.perf_counter() - t0)
        self._started = True
        return ready

    def _learn(self, ready: dict) -> None:
        """What the handshake says of the core: its limits, device and stats."""
        self.max_model_len, self.num_blocks = ready["max_model_len"], ready["num_blocks"]
        self.block_size = ready["block_size"]
        self.device, self.attention_backend = ready["device"], ready["attention_backend"]
        self.vocab_size = self.input_processor.vocab_size = ready["vocab_size"]
        self.stats = EngineStats(**ready["stats"])

    @property
    def pid(self) -> int | None:
        return self.engine_core.pid

    def _trace_ready(self, seconds: float) -> None:
        self.hooks.emit(CLI, CORE_HANDSHAKE, END, seconds=seconds, num_blocks=self.num_blocks,
                        block_size=self.block_size, max_model_len=self.max_model_len)

    def start(self) -> AsyncLLM:
        """launch() and wait_ready() if not done yet (what the app's lifespan calls)."""
        self.launch()
        if not self._started:
            self.wait_ready()
        return self

    async def shutdown(self, drain_timeout: float | None = None) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.stop, drain_timeout)

    def stop(self, drain_timeout: float | None = None) -> None:
        """Stop taking requests, let in-flight ones finish for up to drain_timeout seconds,
        then stop the core (which aborts the rest) and fail what is left here."""
        timeout = self.drain_timeout if drain_timeout is None else drain_timeout
        self._stopping = True
        if self._launched:
            if self.engine_core.dead is None:
                self._idle.wait(timeout)
            self.engine_core.shutdown(0)
        self._fail_all(EngineClosedError("the server shut down before this request finished"))
        self._idle.set()  # nothing is left: an earlier stop() still waiting out its drain returns now

    # ---- requests (asyncio thread) ------------------------------------------------------------
    async def add_request(self, request_id: str, prompt, params: SamplingParams, priority: int = 0) -> RequestStream:
        """Queue a request; returns once the core has it in `waiting`. Raises ValueError (bad
        prompt, too long, the core's own checks) with nothing queued, EngineClosedError when
        the engine is not running (503)."""
        if self.engine_core.dead is not None:
            raise EngineClosedError(self.engine_core.dead)
        if self._stopping or not self._started:
            raise EngineClosedError("the engine is not running (shutting down?)")
        request = self.input_processor.process_inputs(request_id, prompt, params, priority=priority)
        parent, requests = fan_out(request)  # n > 1: n children, gathered by the output processor
        stream = _Stream(asyncio.get_running_loop(), request_id, [r.request_id for r in requests])
        with self._lock:
            if request_id in self._streams or any(cid in self._by_core_id for cid in stream.core_ids):
                raise ValueError(f"request_id {request_id!r} is already in use")
            # Again, under the lock: the core may have died since the check above, and its monitor
            # fails only the streams registered before it took the lock (this one would wait for ever).
            if self.engine_core.dead is not None:
                raise EngineClosedError(self.engine_core.dead)
            self._streams[request_id] = stream
            for r in requests:
                self._by_core_id[r.request_id] = stream
                self.output_processor.add(r.request_id, r.prompt, r.prompt_token_ids, r.sampling_params, parent)
            self._idle.clear()
        try:
            for r in requests:
                self.engine_core.add_request(r)
        except RuntimeError as e:
            self.abort(request_id)
            raise EngineClosedError(str(e)) from None
        try:
            await stream.accepted
        except BaseException:
            self.abort(request_id)  # cancelled, or refused: children the core took are stopped too
            raise
        return RequestStream(self, request_id, stream.collector)

    async def generate(self, prompt, params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Outputs (cumulative) of one request until it finishes; aborts it if the consumer goes away."""
        stream = await self.add_request(request_id, prompt, params, priority)
        async for out in stream:
            yield out

    def abort(self, request_id: str) -> None:
        """Stop a request; the core frees its blocks at its next step boundary. Unknown ids: no-op."""
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is not None:
                self._forget(stream)
        if stream is None or self.engine_core.dead is not None:
            return
        try:
            self.engine_core.abort_requests(stream.core_ids)
        except RuntimeError:
            pass  # shutting down: the core aborts everything anyway

    def _forget(self, stream: _Stream) -> None:
        """Drop a request's bookkeeping here (caller holds _lock)."""
        self._streams.pop(stream.request_id, None)
        for cid in stream.core_ids:
            self._by_core_id.pop(cid, None)
        self.output_processor.remove(stream.request_id)
        if not self._streams:
            self._idle.set()

    # ---- the client's output thread -------------------------------------------------------------
    def _on_message(self, msg: EngineCoreOutputs, nbytes: int) -> None:
        if msg.stats is not None:
            self.stats = EngineStats(**msg.stats)
        for rid in msg.accepted:
            self._resolve(rid, None)
        for rid, error in msg.rejected:
            self._resolve(rid, ValueError(error))
        if msg.failed:
            kind = EngineClosedError if self._stopping else EngineDeadError if msg.fatal else RuntimeError
            error = kind(msg.error)
            self._fail(msg.failed, error)
        results = self._deliver(msg) if msg.outputs else []
        if msg.step:
            self._notify(results, msg.aborted)

    def _deliver(self, msg: EngineCoreOutputs) -> list[RequestOutput]:
        step = msg.stats["step"] - 1 if msg.stats and msg.step else None
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            results, stopped = self.output_processor.process(msg.outputs, step)
            for out in results:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                if out.finished:
                    self._forget(stream)
                by_loop.setdefault(stream.loop, []).append((stream.collector, out))
        for loop, batch in by_loop.items():
            call_soon(loop, deliver, batch)
        for rid, stop in stopped:  # the core cannot see text: it finishes these as stopped when told
            try:
                self.engine_core.abort_requests([rid], "stop", stop)
            except RuntimeError:
                pass
        return results

    def _notify(self, outputs: list[RequestOutput], aborted: list[str]) -> None:
        for listener in self.step_listeners:
            try:
                listener(outputs, self.stats, aborted)
            except Exception:  # observers must not take the front end down
                log.exception("step listener failed")

    def _resolve(self, core_id: str, exc: BaseException | None) -> None:
        """The core took (or refused) one of a request's core requests: the request is in once all are."""
        with self._lock:
            stream = self._by_core_id.get(core_id)
            if stream is None:
                return
            stream.pending -= 1
            if exc is None and stream.pending:
                return
        call_soon(stream.loop, _settle, stream.accepted, exc)  # a refusal: add_request aborts the rest

    def _fail(self, core_ids: list[str], exc: BaseException) -> None:
        with self._lock:
            streams = {id(s): s for s in map(self._by_core_id.get, core_ids) if s is not None}.values()
            for stream in streams:
                self._forget(stream)
        for stream in streams:
            call_soon(stream.loop, _fail_stream, stream, exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            ids = list(self._by_core_id)
        self._fail(ids, exc)

    def _on_dead(self, reason: str) -> None:
        if self.hooks.active:  # in the trace, the log panel and the file: why everything stopped
            self.hooks.emit(IPC, CORE_DIED, reason=reason, pid=self.pid)
        self._fail_all(EngineDeadError(reason))
        if self.on_dead is not None:
            self.on_dead(reason)  # (serve says so and stops)
        else:
            log.error("%s", reason)


def _fail_stream(stream: _Stream, exc: BaseException) -> None:
    if not stream.accepted.done():
        stream.accepted.set_exception(exc if not isinstance(exc, EngineDeadError) else EngineClosedError(str(exc)))
    else:
        stream.collector.put(exc)
