"""POST /v1/completions: prompts in, text (or a stream of chunks) out.

Several prompts in one request become several engine requests, ``cmpl-X-0``, ``cmpl-X-1``
(a single prompt keeps the plain ``cmpl-X``), answered as choices with the prompt's index.
"""
from __future__ import annotations

import logging
import os
import time
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import Response

from engine.engine.exceptions import EngineClosedError, EngineDeadError
from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from engine.entrypoints.openai.serving import (
    SSE_DONE,
    ChunkFrames,
    HttpSpan,
    StopHoldback,
    answer,
    merge_streams,
    new_request_id,
    sampling_params,
    sse,
    submit,
    trace_request,
)
from engine.entrypoints.openai.state import ServerState
from engine.outputs import Logprob, RequestOutput
from engine.trace_names import API

log = logging.getLogger(__name__)
PATH = "POST /v1/completions"


def _prompts(prompt) -> list:
    """str | list[str] | list[int] | list[list[int]] -> one engine prompt per choice."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    limit = int(os.environ.get("VLLM_MAX_COMPLETION_PROMPTS", "1024"))  # vLLM's name and default
    if len(prompt) > limit:
        raise APIError(400, f"prompt is a list of {len(prompt)} prompts, more than the {limit} one request may "
                            f"hold (VLLM_MAX_COMPLETION_PROMPTS): send them in several requests", param="prompt")
    return list(prompt)


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], num_top: int,
                        offset: int = 0, out: CompletionLogprobs | None = None) -> CompletionLogprobs:
    out = out or CompletionLogprobs()
    for tok, entry in zip(token_ids, entries):
        sampled = entry[tok]
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
        # OpenAI always lists the chosen token; where two tokens decode to the same text (byte
        # pieces: "\ufffd"), the better-ranked one keeps the key, as in vLLM
        top = {sampled.decoded_token: sampled.logprob}
        top |= {lp.decoded_token: lp.logprob for t, lp in reversed(ranked[:num_top])}
        out.tokens.append(sampled.decoded_token)
        out.token_logprobs.append(sampled.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(sampled.decoded_token)
    return out


def prompt_logprobs(out: RequestOutput, num_top: int, decode) -> CompletionLogprobs:
    """The echoed prompt's part of the legacy logprobs (as OpenAI and vLLM): its first token has
    none (null), each later one its logprob given the tokens before it."""
    lp = CompletionLogprobs(tokens=[decode([out.prompt_token_ids[0]])], token_logprobs=[None], top_logprobs=[None],
                            text_offset=[0])
    return completion_logprobs(out.prompt_token_ids[1:], out.prompt_logprobs[1:], num_top,
                               len(lp.tokens[0]), lp)


async def create_completion(body: CompletionRequest, state: ServerState, request: Request) -> Response:
    rid, hooks = new_request_id("cmpl"), state.hooks
    span = HttpSpan(hooks, PATH, rid, request, body.stream)
    with span.refusals():
        state.check_model(body.model)
        prompts = _prompts(body.prompt)
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "vLLM V1 does not support best_of; use n for several samples", param="best_of")
        # echo with logprobs scores the prompt too (how evaluation harnesses ask for a loglikelihood)
        prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
        params = sampling_params(body, body.max_tokens, body.logprobs, prompt_logprobs)
        ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
        if hooks.active:
            trace_request(hooks, "completion_request", rid, params, body.user, request_ids=ids, num_prompts=len(ids))
        streams = await submit(state, ids, prompts, params, body.priority)
    return await answer(span, request, _Ctx(state, body, span, ids, params.stop_strs), streams, streams, body.stream)


class _Ctx:
    """One completion request being answered."""

    def __init__(self, state: ServerState, body: CompletionRequest, span: HttpSpan, ids: list[str], stops: list[str]):
        self.state, self.body, self.span, self.ids, self.stops = state, body, span, ids, stops
        self.rid = span.request_id
        self.created = int(time.time())

    def _prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.state.engine.tokenizer.decode(out.prompt_token_ids)

    async def collect(self, streams) -> list[RequestOutput]:
        finals: list = [None] * len(streams)
        try:
            async with aclosing(merge_streams(streams)) as merged:
                async for i, out in merged:
                    finals[i] = out
        except EngineClosedError as e:
            self.state.num_cut_at_shutdown += 1
            raise APIError(503, str(e)) from None
        return finals

    def response(self, finals: list[RequestOutput]) -> CompletionResponse:
        b, choices = self.body, []
        for i, out, c in ((i, out, c) for i, out in enumerate(finals) for c in out.outputs):
            lp = None
            if b.logprobs is not None:
                echoed = prompt_logprobs(out, b.logprobs, self.state.engine.tokenizer.decode) if b.echo else None
                offset = len(self._prompt_text(out)) if b.echo else 0
                lp = completion_logprobs(c.token_ids, c.logprobs, b.logprobs, offset, echoed)
            text = (self._prompt_text(out) if b.echo else "") + c.text
            choices.append(CompletionChoice(index=i * b.n + c.index, text=text, logprobs=lp,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return CompletionResponse(id=self.rid, created=self.created, model=self.state.model_name, choices=choices,
                                  usage=_usage(finals), kv_transfer_params=finals[0].kv_transfer_params)

    async def stream(self, streams):
        """SSE events: one chunk per new text, then usage (if asked), then [DONE]."""
        self.chunks, self.finals = 0, []
        try:
            async with aclosing(merge_streams(streams)) as merged:
                async for event in self._chunks(merged, len(streams)):
                    yield event
            opts = self.body.stream_options
            if opts and opts.include_usage:
                yield sse(CompletionResponse(id=self.rid, created=self.created, model=self.state.model_name,
                                             choices=[], usage=_usage(self.finals)))
        except EngineDeadError as e:  # the engine core process died: say so, no traceback
            yield sse(APIError(500, str(e), code="engine_dead").body())
        except EngineClosedError as e:  # the server is shutting down: say so, then [DONE]
            self.state.num_cut_at_shutdown += 1
            yield sse(APIError(503, str(e)).body())
        except Exception as e:  # the status line is gone already: report it in the stream
            log.exception("completion stream %s failed", self.rid)
            yield sse(APIError(500, f"internal error: {type(e).__name__}: {e}").body())
        finally:
            self.span.end(200, chunks=self.chunks, complete=len(self.finals) == len(streams))
        yield SSE_DONE

    async def _chunks(self, merged, num_prompts: int):
        b = self.body
        n = num_prompts * b.n  # choices: prompt i's j-th sample is choice i * n + j
        hold = [StopHoldback(self.stops) for _ in range(n)]
        self._sent_tokens, self._offsets, self._started, self._done = [0] * n, [0] * n, [False] * n, [False] * n
        frames = ChunkFrames(CompletionResponse(id=self.rid, created=self.created, model=self.state.model_name,
                                                choices=[]))
        async for p, out in merged:
            if out.finished:
                self.finals.append(out)
            for c in out.outputs:
                frame = self._choice_chunk(frames, p * b.n + c.index, out, c, hold[p * b.n + c.index])
                if frame is not None:
                    self.chunks += 1
                    yield frame

    def _choice_chunk(self, frames: ChunkFrames, i: int, out: RequestOutput, c, hold: StopHoldback):
        """Choice i's chunk for what is new in it (its text, logprobs, finish), or None."""
        b, hooks = self.body, self.state.hooks
        done = c.finish_reason is not None
        if self._done[i]:
            return None  # said all it had (n > 1: another choice of the same prompt moved)
        text = hold.delta(c.text, done)
        echoed = None
        if b.echo and not self._started[i]:
            text = self._prompt_text(out) + text
            if b.logprobs is not None:
                echoed = prompt_logprobs(out, b.logprobs, self.state.engine.tokenizer.decode)
                self._offsets[i] = len(self._prompt_text(out))
        self._started[i] = True
        lp = None
        if b.logprobs is not None:
            sent = self._sent_tokens[i]
            lp = completion_logprobs(c.token_ids[sent:], c.logprobs[sent:], b.logprobs, self._offsets[i], echoed)
            self._offsets[i] = lp.text_offset[-1] + len(lp.tokens[-1]) if lp.tokens else self._offsets[i]
        self._sent_tokens[i] = len(c.token_ids)
        self._done[i] = done
        if not done and not text and not (lp and lp.tokens):
            return None  # nothing new to say (a held-back stop prefix or a partial character)
        finish_reason = c.finish_reason if done else None
        if hooks.active:
            hooks.emit(API, "sse_chunk", request_id=self.ids[i // b.n], text=text, finish_reason=finish_reason)
        return frames.frame({"index": i, "text": text, "logprobs": lp.model_dump() if lp is not None else None,
                             "finish_reason": finish_reason, "stop_reason": c.stop_reason if done else None})


def _usage(finals: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
