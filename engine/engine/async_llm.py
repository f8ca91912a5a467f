"""AsyncLLM: the API-server process's engine, with the engine core in its own process.

    front end (this process)                         engine core (EngineCoreProc)
    tokenize -> EngineCoreRequest (token ids) --ADD-->  waiting -> step -> EngineCoreOutputs
    RequestOutput <- OutputProcessor (text, stops) <--  new token ids, finish, stats, events

It offers the front-end interface of ``AsyncLLMEngine`` (generate, add_request, abort,
tokenizer, max_model_len, stats, step_listeners, hooks, is_running, start, shutdown, stop,
drain_timeout), so the server and the TUI serve either. Outputs are processed on the
client's output IO thread (detokenization never runs on the event loop) and handed to each
request's RequestOutputCollector with one ``call_soon_threadsafe`` per message, as in one
process.

Tracing: the core ships its trace events (with their own perf_counter_ns times, one clock on
Linux) only while this process has listeners on ``hooks``; they are republished here, in
the order the core emitted them, before anything the message they came with causes here
(the QUEUED of a request before its add returns; a step's events before its NEW_TOKENS).
Each message across the boundary is also traced in the ``ipc`` layer (type, request ids,
bytes), except messages that carry only trace events.

Design choices (and why):
* One process (``serve --no-multiprocessing``) keeps ``AsyncLLMEngine``: the same EngineCore
  loop, with the LLMEngine detokenizing itself, rather than V1's InprocClient + this class.
  It is there for comparison and for the tests and lessons that read engine objects; the
  server, the TUI and the trace schema are the same over both (the tests run in both modes).
* The core is started as ``python -m engine.engine.core_proc`` (a fresh interpreter, like 'spawn')
  rather than multiprocessing's spawn, which re-runs the caller's ``__main__``: a lesson or a
  user's script then needs no ``if __name__ == "__main__"`` guard.
* Outputs are processed on the client's IO thread, not on the event loop: the loop (HTTP, the
  TUI) never detokenizes. A stop string found here is sent to the core as an ABORT with
  finish_reason "stop", so the core frees the blocks and traces FINISHED(stop), as vLLM V1.
"""
from __future__ import annotations

import asyncio
import logging
import subprocess
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict
from typing import AsyncIterator, Callable

from engine.config import EngineConfig
from engine.engine.async_engine import RequestOutputCollector, RequestStream, StepListener, _call_soon, _deliver
from engine.engine.core import EngineClosedError, EngineDeadError
from engine.engine.core_client import HANDSHAKE_TIMEOUT_S, MPClient
from engine.engine.core_types import EngineCoreOutputs, EngineCoreRequest
from engine.engine.output_processor import OutputProcessor
from engine.hooks import BEGIN, END, Hooks
from engine.model_executor.model_loader import resolve
from engine.outputs import EngineStats, RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer
from engine.trace_names import (
    CLI,
    CORE_DIED,
    CORE_HANDSHAKE,
    CORE_PROCESS_START,
    IPC,
    IPC_RECV,
    IPC_SEND,
    PAUSED,
    RESUMED,
    TOKENIZER,
    TRACER,
)

log = logging.getLogger(__name__)


class _Stream:
    __slots__ = ("loop", "collector", "accepted")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.collector, self.accepted = loop, RequestOutputCollector(), loop.create_future()


def _settle(fut: asyncio.Future, exc: BaseException | None) -> None:
    if not fut.done():  # the caller may have given up (cancelled) meanwhile
        fut.set_exception(exc) if exc is not None else fut.set_result(None)


HEALTH_TIMEOUT_S = 5.0  # a core whose input thread has not answered a ping for this long is unhealthy
RERUN_TIMEOUT_S = 300.0  # a held launch re-run on Triton in the core (see held_attention_on_triton)


class AsyncLLM:
    """The engine behind the server, its core in another process (see the module docstring).

    launch() starts the core (call it on the main thread); wait_ready() blocks until the
    handshake; start() does both if needed. core_options: trace (ship trace events),
    install ("module:function" run in the core, e.g. the tracer's step controller)."""

    def __init__(self, config: EngineConfig, hooks: Hooks | None = None, drain_timeout: float = 5.0,
                 core_options: dict | None = None, on_dead: Callable[[str], None] | None = None,
                 core_proc: subprocess.Popen | None = None):
        self.config = config
        self.hooks = hooks or Hooks()
        self.drain_timeout = drain_timeout
        self.step_listeners: list[StepListener] = []
        self.on_dead = on_dead  # called (output thread) when the core dies unplanned
        self.model_path = resolve(config.model.model)
        self.tokenizer = load_tokenizer(self.model_path)
        self.stats: EngineStats | None = None
        self.max_model_len = self.num_blocks = self.block_size = None
        self.device = self.attention_backend = self.vocab_size = None
        self.processor = OutputProcessor(self.tokenizer, self.hooks)
        self.client = MPClient(config, self._on_message, self._on_dead, core_options, core_proc)
        self._streams: dict[str, _Stream] = {}  # guarded by _lock, with the processor's requests
        self._lock = threading.Lock()
        self._idle = threading.Event()  # no request in flight
        self._idle.set()
        self._launched = self._started = self._stopping = False
        self._parked = False
        self._aborted: list[str] = []
        self._ping: tuple[float, Future | None] = (0.0, None)  # check_health's ping in flight: (sent, answer)

    # ---- properties of the front-end interface ------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._started and not self._stopping and self.client.dead is None

    @property
    def is_parked(self) -> bool:
        """True while the core's step controller holds its engine (seen from its trace events)."""
        return self._parked

    @property
    def dead(self) -> str | None:
        return self.client.dead

    @property
    def core_pid(self) -> int | None:
        return self.client.pid

    @property
    def step_count(self) -> int:
        return self.stats.step if self.stats is not None else 0

    async def check_health(self) -> None:
        """Raise EngineDeadError unless the core is alive *and answering* (vLLM's check_health): a
        ping the core's input IO thread answers, within HEALTH_TIMEOUT_S. That thread answers while
        a step controller holds the engine thread, so a paused core is healthy; a frozen process
        (SIGSTOP) or a front end that no longer reads the core is not. Concurrent checks share
        the one ping in flight: once it is older than the timeout, they fail at once."""
        if not self.is_running:
            raise EngineDeadError(self.client.dead or "the engine is not running (shutting down?)")
        sent, fut = self._ping
        if fut is None or fut.done():
            try:
                sent, fut = self._ping = time.monotonic(), self.client.start_call("ping")
            except RuntimeError as e:  # the core died meanwhile
                raise EngineDeadError(str(e)) from None
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)),
                                   max(0.0, sent + HEALTH_TIMEOUT_S - time.monotonic()))
        except TimeoutError:
            raise EngineDeadError(f"the engine core has not answered for {time.monotonic() - sent:.1f} s "
                                  f"(pid {self.client.pid})") from None
        except RuntimeError as e:
            raise EngineDeadError(str(e)) from None

    def held_attention_on_triton(self) -> dict:
        """A utility call: the core runs the launch it is held before through the Triton kernel
        (interpreted on a CPU: seconds, hence the long timeout). Blocks: call it off the loop."""
        return self.client.call("held_attention_on_triton", timeout=RERUN_TIMEOUT_S)

    async def reset_prefix_cache(self) -> bool:
        """A utility call: empty the core's prefix cache; False while requests hold blocks."""
        return await asyncio.to_thread(self.client.call, "reset_prefix_cache")

    # ---- lifecycle ----------------------------------------------------------------------------
    def launch(self) -> AsyncLLM:
        if not self._launched:
            self._launched = True
            self._t_launch = time.perf_counter()
            if self.hooks.active:
                self.hooks.emit(CLI, CORE_PROCESS_START, BEGIN, model=self.config.model.model)
            self.client.launch()
            if self.hooks.active:
                self.hooks.emit(CLI, CORE_PROCESS_START, END, seconds=time.perf_counter() - self._t_launch,
                                pid=self.client.pid)
        return self

    def wait_ready(self, timeout: float = HANDSHAKE_TIMEOUT_S) -> dict:
        """Block until the core has built its engine and answered the handshake. Raises
        EngineStartupError (one line: the core's own error, its death or a timeout)."""
        t0 = time.perf_counter()
        if self.hooks.active:
            self.hooks.emit(CLI, CORE_HANDSHAKE, BEGIN, pid=self.client.pid)
        ready = self.client.wait_ready(timeout)
        self.max_model_len, self.num_blocks = ready["max_model_len"], ready["num_blocks"]
        self.block_size = ready["block_size"]
        self.device, self.attention_backend = ready["device"], ready["attention_backend"]
        self.vocab_size = ready["vocab_size"]
        self.stats = EngineStats(**ready["stats"])
        if self.hooks.active:
            self.hooks.emit(CLI, CORE_HANDSHAKE, END, seconds=time.perf_counter() - t0, num_blocks=self.num_blocks,
                            block_size=self.block_size, max_model_len=self.max_model_len)
        self._started = True
        return ready

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
            if self.client.dead is None:
                self._idle.wait(timeout)
            self.client.shutdown(0)
        self._fail_all(EngineClosedError("the server shut down before this request finished"))
        self._idle.set()  # nothing is left: an earlier stop() still waiting out its drain returns now

    # ---- requests (asyncio thread) ------------------------------------------------------------
    async def add_request(self, request_id: str, prompt, params: SamplingParams) -> RequestStream:
        """Queue a request; returns once the core has it in `waiting`. Raises ValueError (bad
        prompt, too long, the core's own checks) with nothing queued, EngineClosedError when
        the engine is not running (503)."""
        if self.client.dead is not None:
            raise EngineClosedError(self.client.dead)
        if self._stopping or not self._started:
            raise EngineClosedError("the engine is not running (shutting down?)")
        text, ids = self._tokenize(prompt, request_id)
        self._check_ids(ids)
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            # Again, under the lock: the core may have died since the check above, and its monitor
            # fails only the streams registered before it took the lock (this one would wait for ever).
            if self.client.dead is not None:
                raise EngineClosedError(self.client.dead)
            self._streams[request_id] = stream
            self.processor.add(request_id, text, ids, params)
            self._idle.clear()
        req = EngineCoreRequest(request_id, ids, _wire_params(params), time.monotonic(), text)

        def trace_send(nbytes: int) -> None:
            self.hooks.emit(IPC, IPC_SEND, request_id=request_id, type="ADD", request_ids=[request_id], bytes=nbytes,
                            num_prompt_tokens=len(ids))
        try:
            self.client.add_request(req, trace_send if self.hooks.active else None)
        except RuntimeError as e:
            self._drop(request_id)
            raise EngineClosedError(str(e)) from None
        try:
            await stream.accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException:
            self._drop(request_id)
            raise
        return RequestStream(self, request_id, stream.collector)

    async def generate(self, prompt, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs (cumulative) of one request until it finishes; aborts it if the consumer goes away."""
        stream = await self.add_request(request_id, prompt, params)
        async for out in stream:
            yield out

    def abort(self, request_id: str) -> None:
        """Stop a request; the core frees its blocks at its next step boundary. Unknown ids: no-op."""
        if not self._drop(request_id) or self.client.dead is not None:
            return
        def trace_send(nbytes: int) -> None:
            self.hooks.emit(IPC, IPC_SEND, request_id=request_id, type="ABORT", request_ids=[request_id], bytes=nbytes)
        try:
            self.client.abort_requests([request_id], before=trace_send if self.hooks.active else None)
        except RuntimeError:
            pass  # shutting down: the core aborts everything anyway

    def _drop(self, request_id: str) -> bool:
        with self._lock:
            found = self._streams.pop(request_id, None) is not None
            self.processor.remove(request_id)
            if not self._streams:
                self._idle.set()
        return found

    def _check_ids(self, ids: list[int]) -> None:
        """What the detokenizer here needs; the core checks the rest (lengths, the KV cache)."""
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab - 1}]")

    def _tokenize(self, prompt, request_id: str) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt must have 'prompt_token_ids'")
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            if self.hooks.active:
                self.hooks.emit(TOKENIZER, "encode", request_id=request_id, token_ids=ids,
                                pieces=[self.tokenizer.decode([t]) for t in ids])
            return prompt, ids
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or {{'prompt_token_ids': [...]}}, "
                         f"got {type(prompt).__name__}")

    # ---- the client's output thread -------------------------------------------------------------
    def _on_message(self, msg: EngineCoreOutputs, nbytes: int) -> None:
        hooks = self.hooks
        if msg.events and hooks.active:
            self._republish(msg.events)
        if hooks.active and (msg.outputs or msg.accepted or msg.rejected or msg.failed):
            self._trace_recv(msg, nbytes)
        if msg.stats is not None:
            self.stats = EngineStats(**msg.stats)
        for rid in msg.accepted:
            self._resolve(rid, None)
        for rid, error in msg.rejected:
            self._resolve(rid, ValueError(error))
        if msg.failed:
            error = EngineClosedError(msg.error) if self._stopping else RuntimeError(msg.error)
            self._fail(msg.failed, error)
        results = self._deliver(msg) if msg.outputs else []
        if msg.step:
            self._notify(results, msg.aborted)

    def _trace_recv(self, msg: EngineCoreOutputs, nbytes: int) -> None:
        ids = [o.request_id for o in msg.outputs] + msg.accepted + [r for r, _ in msg.rejected] + msg.failed
        step = msg.stats["step"] - 1 if msg.step and msg.stats else None  # the step these outputs are from
        self.hooks.emit(IPC, IPC_RECV, step=step, type="OUTPUTS" if msg.outputs else "ADDED", request_ids=ids,
                        bytes=nbytes, num_events=len(msg.events))

    def _republish(self, events: list) -> None:
        for ev in events:
            if ev[0] == TRACER and ev[1] in (PAUSED, RESUMED):
                self._parked = ev[1] == PAUSED
        self.hooks.emit_many([ev[:6] for ev in events], [ev[6] for ev in events])

    def _deliver(self, msg: EngineCoreOutputs) -> list[RequestOutput]:
        step = msg.stats["step"] - 1 if msg.stats and msg.step else None
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            results, stopped = self.processor.process(msg.outputs, step)
            for out in results:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                by_loop.setdefault(stream.loop, []).append((stream.collector, out))
            if not self._streams:
                self._idle.set()
        for loop, batch in by_loop.items():
            _call_soon(loop, _deliver, batch)
        for rid, stop in stopped:  # the core cannot see text: it finishes these as stopped when told
            def trace_send(nbytes: int, rid=rid, stop=stop) -> None:
                self.hooks.emit(IPC, IPC_SEND, request_id=rid, type="ABORT", request_ids=[rid], finish_reason="stop",
                                stop_reason=stop, bytes=nbytes)
            try:
                self.client.abort_requests([rid], "stop", stop, before=trace_send if self.hooks.active else None)
            except RuntimeError:
                pass
        return results

    def _notify(self, outputs: list[RequestOutput], aborted: list[str]) -> None:
        for listener in self.step_listeners:
            try:
                listener(outputs, self.stats, aborted)
            except Exception:  # observers must not take the front end down
                log.exception("step listener failed")

    def _resolve(self, request_id: str, exc: BaseException | None) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
            if exc is not None and stream is not None:
                del self._streams[request_id]
                self.processor.remove(request_id)
                if not self._streams:
                    self._idle.set()
        if stream is not None:
            _call_soon(stream.loop, _settle, stream.accepted, exc)

    def _fail(self, request_ids: list[str], exc: BaseException) -> None:
        with self._lock:
            streams = [(rid, self._streams.pop(rid, None)) for rid in request_ids]
            for rid, _ in streams:
                self.processor.remove(rid)
            if not self._streams:
                self._idle.set()
        for rid, stream in streams:
            if stream is not None:
                _call_soon(stream.loop, _fail_stream, stream, exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            ids = list(self._streams)
        self._fail(ids, exc)

    def _on_dead(self, reason: str) -> None:
        if self.hooks.active:  # in the trace, the log panel and the file: why everything stopped
            self.hooks.emit(IPC, CORE_DIED, reason=reason, pid=self.client.pid)
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


def _wire_params(params: SamplingParams) -> dict:
    d = asdict(params)
    d.pop("stop_strs", None)
    return d
