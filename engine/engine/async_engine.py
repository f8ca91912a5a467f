"""AsyncLLMEngine: the EngineCore in a thread of this process, served to asyncio.

The one-process mode (``serve --no-multiprocessing``, the tests, lessons that read engine
objects): the EngineCore is stepped by a ``BusyLoop`` (who may touch it when: the engine
lock, parking while a step controller holds it, requests queued while paused, aborts at the
step boundary; see ``busy_loop.py``), the same loop that runs in the engine-core process
behind ``AsyncLLM``. The front-end half is AsyncLLM's too: the ``InputProcessor`` makes each
prompt an EngineCoreRequest and the ``OutputProcessor`` turns the core's token ids into
RequestOutputs, on the engine thread; each request's outputs go to its
``RequestOutputCollector`` with one ``call_soon_threadsafe`` per step.
"""
from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import TYPE_CHECKING, AsyncIterator, Callable

from engine.engine.busy_loop import BusyLoop, PendingAdd
from engine.engine.core_types import EngineCoreOutput, EngineCoreRequest
from engine.engine.exceptions import EngineClosedError as EngineClosedError  # re-exported: the serving layer's
from engine.engine.exceptions import EngineDeadError
from engine.engine.input_processor import InputProcessor
from engine.engine.output_processor import OutputProcessor, RequestOutputCollector, RequestStream, call_soon, deliver
from engine.engine.parallel_sampling import fan_out
from engine.hooks import Hooks
from engine.outputs import EngineStats, RequestOutput
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the serving layer imports this module; torch only where an engine is built
    from engine.engine.core import EngineCore

log = logging.getLogger(__name__)

# listener(outputs of one step, stats after it, ids aborted since the last call); engine thread
StepListener = Callable[[list[RequestOutput], EngineStats, list[str]], None]


def _settle(fut: asyncio.Future, exc: BaseException | None) -> None:
    if not fut.done():  # the caller may have given up (cancelled) meanwhile
        fut.set_exception(exc) if exc is not None else fut.set_result(None)


class AsyncLLMEngine:
    """The EngineCore in a thread, served to asyncio (see the module docstring)."""

    def __init__(self, engine: EngineCore, drain_timeout: float = 5.0):
        self.engine = engine
        self.drain_timeout = drain_timeout  # shutdown(): how long in-flight requests may finish
        self.step_listeners: list[StepListener] = []
        self.input_processor = InputProcessor(engine.tokenizer, engine.hooks, engine.model_config.vocab_size)
        self.output_processor = OutputProcessor(engine.tokenizer, engine.hooks)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, RequestOutputCollector]] = {}  # engine lock
        self._core_ids: dict[str, list[str]] = {}  # request id -> the ids the core knows (n > 1: the children's)
        self._parents: dict[str, str] = {}  # and back
        self.core = BusyLoop(engine, self._on_step, self._on_fail)

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
        """The launch the engine is held before, through the Triton kernel (EngineCore's)."""
        return self.engine.held_attention_on_triton()

    async def start_profile(self) -> dict:
        """Profile every op of the forward pass from the next step on (EngineCore.profile, applied by
        the engine thread between steps)."""
        return await asyncio.wrap_future(self.core.profile(True))

    async def stop_profile(self) -> dict:
        """End the profiled window (with a profiler_dir, each rank's trace_file)."""
        return await asyncio.wrap_future(self.core.profile(False))

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
    def _idle(self):  # no requests in the engine and none pending
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
    async def add_request(self, request_id: str, prompt, params: SamplingParams, priority: int = 0) -> RequestStream:
        """Queue a request; returns once the engine has it (in `waiting`). Raises ValueError
        (bad prompt, too long, bad params) with nothing queued."""
        loop = asyncio.get_running_loop()
        request = self.input_processor.process_inputs(request_id, prompt, params, priority=priority)
        parent, requests = fan_out(request)  # n > 1: n children, gathered by the output processor
        collector, accepted, pending = RequestOutputCollector(), loop.create_future(), [len(requests)]

        def settle(r: EngineCoreRequest, exc: BaseException | None) -> None:  # under the engine lock
            if exc is None:
                self._streams[request_id] = (loop, collector)
                self.output_processor.add(r.request_id, r.prompt, r.prompt_token_ids, r.sampling_params, parent)
            pending[0] -= 1
            if exc is not None or not pending[0]:
                call_soon(loop, _settle, accepted, exc)

        self._core_ids[request_id] = [r.request_id for r in requests]
        for r in requests:
            self._parents[r.request_id] = request_id
        for r in requests:
            self.core.add_request(PendingAdd(r, partial(settle, r)))
        try:
            await accepted
        except BaseException:
            self.abort(request_id)  # cancelled, or refused: children the core took are stopped too
            raise
        return RequestStream(self, request_id, collector)

    async def generate(self, prompt, params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Outputs (cumulative) of one request until it finishes. Aborts it if the consumer
        goes away (cancellation, e.g. a client disconnect)."""
        stream = await self.add_request(request_id, prompt, params, priority)
        async for out in stream:
            yield out

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed before the next step. Unknown ids: no-op."""
        for core_id in self._core_ids.get(request_id, ()):
            self.core.abort(core_id)

    async def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; False while requests hold blocks (nothing changed)."""
        return await asyncio.to_thread(self.core.reset_prefix_cache)

    def _parent_of(self, core_id: str) -> str:
        return self._parents.get(core_id, core_id)

    def _forget(self, request_id: str) -> None:
        for core_id in self._core_ids.pop(request_id, ()):
            self._parents.pop(core_id, None)
        self.output_processor.remove(request_id)

    # ---- engine thread (under the engine lock) ----------------------------------------------
    def _on_step(self, outputs: list[EngineCoreOutput], stats: EngineStats, aborted: list[str]) -> None:
        for rid in {self._parent_of(r) for r in aborted}:  # the ids the core knows: n > 1, a child's
            self._forget(rid)
            self._streams.pop(rid, None)
        results, stopped = self.output_processor.process(outputs, stats.step - 1)
        for rid, stop in stopped:  # the core cannot see text: it finishes these as stopped at the step boundary
            self.core.abort(rid, RequestStatus.FINISHED_STOPPED, stop)
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in results:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
                self._forget(out.request_id)
            by_loop.setdefault(stream[0], []).append((stream[1], out))
        for loop, batch in by_loop.items():
            call_soon(loop, deliver, batch)
        for listener in self.step_listeners:
            try:
                listener(results, stats, aborted)
            except Exception:  # observers must not take the engine down
                log.exception("step listener failed")

    def _on_fail(self, request_ids: list[str], exc: BaseException) -> None:
        for rid in {self._parent_of(r) for r in request_ids}:
            self._forget(rid)
            stream = self._streams.pop(rid, None)
            if stream is not None:
                call_soon(stream[0], stream[1].put, exc)
