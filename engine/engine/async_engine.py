"""AsyncLLMEngine: the engine loop in a background thread of this process, served to asyncio.

The loop, and who may touch the LLMEngine when (the engine lock, parking while a step
controller holds the engine, requests queued while paused, aborts at the step boundary), is
``engine.engine.core.EngineCore``: the same loop runs in the engine-core process behind
``engine.engine.async_llm.AsyncLLM``. This module adapts it to asyncio: each request's outputs go to
a ``RequestOutputCollector``, with one ``call_soon_threadsafe`` per step.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable

from engine.config import EngineConfig
from engine.engine.core import EngineClosedError as EngineClosedError  # re-exported: engine.server imports it from here
from engine.engine.core import EngineCore, EngineDeadError, PendingAdd
from engine.hooks import Hooks
from engine.outputs import EngineStats, RequestOutput
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the serving layer imports this module; torch only where an engine is built
    from engine.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

# listener(outputs of one step, stats after it, ids aborted since the last call); engine thread
StepListener = Callable[[list[RequestOutput], EngineStats, list[str]], None]


@dataclass
class _Add:
    request_id: str
    prompt: object
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    collector: RequestOutputCollector
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


class RequestOutputCollector:
    """One request's output not yet taken by its consumer (vLLM V1's ``RequestOutputCollector``).

    put() (event loop) keeps one pending item: outputs are cumulative, so a newer output replaces
    an older one nobody read yet, and an exception (the request is over) replaces any output.
    A consumer that falls behind, say 64 SSE streams on two cores, then takes one output
    carrying several new tokens and writes one chunk for them, instead of working through a
    backlog of one-token outputs that each cost a chunk (measured in benchmarks.two_processes).
    """
    __slots__ = ("item", "ready")

    def __init__(self):
        self.item: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if not isinstance(self.item, BaseException):
            self.item = item
        self.ready.set()

    async def get(self) -> RequestOutput | BaseException:
        while self.item is None:
            await self.ready.wait()
        item, self.item = self.item, None
        self.ready.clear()
        return item


class RequestStream:
    """One request's outputs, as an async iterator. Ends after the finished output.

    Iterating stops the request (abort) if the iteration is cancelled or fails first; a
    consumer that just stops iterating should call ``abort()`` (a no-op once finished).
    """

    def __init__(self, engine: AsyncLLMEngine, request_id: str, collector: RequestOutputCollector):
        self.engine, self.request_id, self._collector = engine, request_id, collector
        self.finished = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self._collector.get()
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
    """The engine loop (an EngineCore) in a thread of this process, served to asyncio: the
    one-process mode (`serve --no-multiprocessing`, the tests, lessons). The LLMEngine
    detokenizes and checks stop strings itself; outputs go to each request's collector
    with one ``call_soon_threadsafe`` per step."""

    def __init__(self, engine: LLMEngine, drain_timeout: float = 5.0):
        self.engine = engine
        self.drain_timeout = drain_timeout  # shutdown(): how long in-flight requests may finish
        self.step_listeners: list[StepListener] = []
        self._streams: dict[str, _Add] = {}  # live requests; under the engine lock
        self.core = EngineCore(engine, self._on_step, self._on_fail)

    @classmethod
    def from_config(cls, config: EngineConfig, hooks: Hooks | None = None, **kwargs) -> AsyncLLMEngine:
        from engine.engine.llm_engine import LLMEngine

        return cls(LLMEngine(config, hooks), **kwargs)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_path(self):
        return self.engine.model_path

    @property
    def hooks(self) -> Hooks:
        return self.engine.hooks

    @property
    def stats(self) -> EngineStats:
        return self.core.stats

    @property
    def step_count(self) -> int:
        return self.engine.step_count

    @property
    def device(self) -> str:
        return str(self.engine.device)

    def held_attention_on_triton(self) -> dict:
        """The launch the engine is held before, through the Triton kernel (LLMEngine's)."""
        return self.engine.held_attention_on_triton()

    @property
    def attention_backend(self) -> str:
        return self.engine.attention_backend

    @property
    def is_running(self) -> bool:
        return self.core.is_running

    @property
    def is_parked(self) -> bool:
        """True while a step controller holds the engine thread in a gate."""
        return self.core.is_parked

    async def check_health(self) -> None:
        """Raise EngineDeadError unless the engine thread runs (a held one runs: it is parked)."""
        if not self.core.is_running:
            raise EngineDeadError(self.engine.dead or "the engine loop is not running")

    @property
    def _idle(self) -> threading.Event:  # no requests in the engine and none pending
        return self.core._idle

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> AsyncLLMEngine:
        self.core.start()
        return self

    async def shutdown(self, drain_timeout: float | None = None) -> None:
        """Stop taking requests, let in-flight ones finish for up to drain_timeout seconds,
        abort the rest and stop the engine thread."""
        await asyncio.get_running_loop().run_in_executor(None, self.stop, drain_timeout)

    def stop(self, drain_timeout: float | None = None) -> None:
        """Blocking shutdown(). A controller that keeps the engine parked is not waited for
        beyond the timeout (the engine thread is a daemon)."""
        self.core.stop(self.drain_timeout if drain_timeout is None else drain_timeout)

    # ---- requests (asyncio thread) --------------------------------------------------------
    async def add_request(self, request_id: str, prompt, params: SamplingParams) -> RequestStream:
        """Queue a request; returns once the engine has it (in `waiting`). Raises the
        engine's ValueError (bad prompt, too long, bad params) with nothing queued."""
        loop = asyncio.get_running_loop()
        add = _Add(request_id, prompt, params, loop, RequestOutputCollector(), loop.create_future())

        def settle(exc: BaseException | None) -> None:  # under the engine lock
            if exc is None:
                self._streams[request_id] = add
            _resolve(loop, add.accepted, exc)

        self.core.add_request(PendingAdd(request_id, prompt, params, settle))
        try:
            await add.accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # it may have been added meanwhile
            raise
        return RequestStream(self, request_id, add.collector)

    async def generate(self, prompt, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs (cumulative) of one request until it finishes. Aborts it if the consumer
        goes away (cancellation, e.g. a client disconnect)."""
        stream = await self.add_request(request_id, prompt, params)
        async for out in stream:
            yield out

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed before the next step. Unknown ids: no-op."""
        self.core.abort(request_id)

    async def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; False while requests hold blocks (nothing changed)."""
        return await asyncio.to_thread(self.core.reset_prefix_cache)

    # ---- engine thread (under the engine lock) ----------------------------------------------
    def _on_step(self, outputs: list[RequestOutput], stats: EngineStats, aborted: list[str]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for rid in aborted:
            self._streams.pop(rid, None)
        for out in outputs:
            add = self._streams.get(out.request_id)
            if add is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(add.loop, []).append((add.collector, out))
        for loop, batch in by_loop.items():
            _call_soon(loop, _deliver, batch)
        for listener in self.step_listeners:
            try:
                listener(outputs, stats, aborted)
            except Exception:  # observers must not take the engine down
                log.exception("step listener failed")

    def _on_fail(self, request_ids: list[str], exc: BaseException) -> None:
        for rid in request_ids:
            add = self._streams.pop(rid, None)
            if add is not None:
                _call_soon(add.loop, add.collector.put, exc)


def _deliver(batch: list[tuple[RequestOutputCollector, RequestOutput]]) -> None:
    for collector, out in batch:
        collector.put(out)
