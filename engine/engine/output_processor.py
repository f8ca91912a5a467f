"""OutputProcessor: the API-server side of a request's outputs (vLLM V1's ``output_processor.py``).

The core sends token ids; here they become text. Per request: incremental detokenization,
stop strings (a match finishes the request and is returned so the caller aborts it in the
core: the core cannot see text), logprobs as ``Logprob`` objects, and one ``RequestOutput``
per step (or only the final one, for output_kind "final_only"). It traces what it does as
the ``detokenizer`` layer's NEW_TOKENS. One OutputProcessor serves every front end: LLMEngine
(offline, in-process or not), AsyncLLM (the API server, one process or two).

``RequestOutputCollector`` and ``RequestStream`` hand one request's outputs to its asyncio
consumer (the API server's front ends).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol

from engine.engine.core_types import EngineCoreOutput
from engine.engine.parallel_sampling import ParentRequest
from engine.hooks import INSTANT, Hooks
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import IncrementalDetokenizer
from engine.trace_names import API, DETOKENIZER, FAN_OUT, NEW_TOKENS


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    text: str = ""
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # V1's shape: None for the first token
    parent: ParentRequest | None = None  # n > 1: this is one of its children


class OutputProcessor:
    """Turns EngineCoreOutputs into RequestOutputs. Not thread-safe: one thread processes
    (the client's output thread); add/remove from others go through the caller's lock."""

    def __init__(self, tokenizer, hooks: Hooks):
        self.tokenizer, self.hooks = tokenizer, hooks
        self.requests: dict[str, RequestState] = {}  # by the id the core knows (a child's, for n > 1)
        self.parents: dict[str, ParentRequest] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            parent: ParentRequest | None = None) -> None:
        det = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.requests[request_id] = RequestState(request_id, prompt, prompt_token_ids, params, det, parent=parent)
        if parent is not None and parent.request_id not in self.parents:
            self.parents[parent.request_id] = parent
            if self.hooks.active:
                self._trace_fan_out(parent)

    def remove(self, request_id: str) -> None:
        """Forget a request (a parent: all its children)."""
        parent = self.parents.pop(request_id, None)
        for rid in parent.child_ids if parent is not None else (request_id,):
            self.requests.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _trace_fan_out(self, parent: ParentRequest) -> None:
        # no request_id: the parent is no request of the engine's; its children are
        self.hooks.emit(API, FAN_OUT, parent_id=parent.request_id, child_ids=parent.child_ids, n=len(parent.child_ids))

    def process(self, outputs: list[EngineCoreOutput], step: int | None
                ) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """(the RequestOutputs to hand out, the (request id, stop string) of requests a stop
        string finished, to abort in the core)."""
        results, stopped = [], []
        traced = [] if self.hooks.active else None
        for out in outputs:
            st = self.requests.get(out.request_id)
            if st is None:
                continue  # finished here already (a stop string), or aborted
            piece = self._append(st, out)
            finish, stop_reason = out.finish_reason, out.stop_reason
            cut = None
            if finish != "stop":  # eos and stop tokens were checked first in the core
                stop = self._match_stop(st, len(piece))
                if stop is not None:
                    finish, stop_reason, cut = "stop", stop, st.text
                    if out.finish_reason is None:
                        stopped.append((st.request_id, stop))
            if traced is not None:
                attrs = {"token_ids": out.new_token_ids, "text": piece}
                if cut is not None:  # the core's FINISHED has no text: the trace learns the cut here
                    attrs |= {"stop": stop_reason, "text_after_stop": cut}
                traced.append((DETOKENIZER, NEW_TOKENS, INSTANT, st.request_id, step, attrs))
            if finish is not None:
                del self.requests[st.request_id]
            if st.parent is not None:  # n > 1: the parent's output, with every child's completion so far
                parent_out = st.parent.add_output(self._output(st, finish, stop_reason))
                if parent_out is not None:
                    results.append(parent_out)
                if parent_out is not None and parent_out.finished:
                    self.parents.pop(st.parent.request_id, None)
            elif finish is not None or st.params.output_kind != "final_only":
                results.append(self._output(st, finish, stop_reason))
        if traced:
            self.hooks.emit_many(traced)
        return results, stopped

    def _append(self, st: RequestState, out: EngineCoreOutput) -> str:
        pieces = [st.detokenizer.add(tok) for tok in out.new_token_ids]
        st.token_ids += out.new_token_ids
        st.text = st.detokenizer.text
        if out.new_logprobs is not None:
            decode = self.tokenizer.decode
            st.logprobs += [{t: Logprob(lp, rank, decode([t])) for t, lp, rank in entry} for entry in out.new_logprobs]
        if out.new_prompt_logprobs is not None:
            decode = self.tokenizer.decode
            st.prompt_logprobs = [None] + [{t: Logprob(lp, rank, decode([t])) for t, lp, rank in entry}
                                           for entry in out.new_prompt_logprobs]
        if out.metrics:
            st.metrics |= out.metrics
        st.num_cached_tokens = out.num_cached_tokens
        st.kv_transfer_params = out.kv_transfer_params
        return "".join(pieces)

    def _match_stop(self, st: RequestState, new_chars: int) -> str | None:
        p = st.params
        if not p.stop_strs or len(st.token_ids) < p.min_tokens:
            return None
        for stop in p.stop_strs:
            # only the new tail can hold a new match: what was checked before had none
            at = st.text.find(stop, max(0, len(st.text) - new_chars - len(stop) - 64))
            if at >= 0:
                st.text = st.text[:at + (len(stop) if p.include_stop_str_in_output else 0)]
                return stop
        return None

    def _output(self, st: RequestState, finish: str | None, stop_reason) -> RequestOutput:
        completion = CompletionOutput(0, st.text, list(st.token_ids),
                                      list(st.logprobs) if st.params.logprobs is not None else None,
                                      finish, stop_reason)
        return RequestOutput(st.request_id, st.prompt, st.prompt_token_ids, [completion], finish is not None,
                             st.num_cached_tokens, dict(st.metrics), st.prompt_logprobs, st.kv_transfer_params)


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


class _Aborts(Protocol):
    def abort(self, request_id: str) -> None: ...


class RequestStream:
    """One request's outputs, as an async iterator. Ends after the finished output.

    Iterating stops the request (abort) if the iteration is cancelled or fails first; a
    consumer that just stops iterating should call ``abort()`` (a no-op once finished).
    """

    def __init__(self, engine: _Aborts, request_id: str, collector: RequestOutputCollector):
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


def call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
    """loop.call_soon_threadsafe, from another thread; a closed loop has nobody listening any more."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def deliver(batch: list[tuple[RequestOutputCollector, RequestOutput | BaseException]]) -> None:
    """On the event loop: one step's outputs (or errors) to their collectors."""
    for collector, out in batch:
        collector.put(out)
