"""POST /v1/chat/completions: messages -> chat template -> one engine request."""
from __future__ import annotations

import logging
import time

from fastapi import Request
from fastapi.responses import Response

from engine.engine.exceptions import EngineClosedError, EngineDeadError
from engine.engine.output_processor import RequestStream
from engine.entrypoints.openai.chat_template import render_chat
from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.protocol import (
    MAX_LOGPROBS,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    TopLogprob,
    UsageInfo,
)
from engine.entrypoints.openai.serving import (
    SSE_DONE,
    ChunkFrames,
    HttpSpan,
    StopHoldback,
    answer,
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
PATH = "POST /v1/chat/completions"


async def chat_prompt(state: ServerState, messages, add_generation_prompt: bool = True) -> str:
    """The prompt text of `messages`, rendered on the tokenizer threads (a long conversation
    takes a while, and the event loop serves everyone)."""
    msgs = [dict(role=m.role, content=m.text()) | ({"name": m.name} if m.name else {}) for m in messages]
    try:
        return await state.renderer.run(render_chat, state.engine.tokenizer, state.chat_template, msgs,
                                         add_generation_prompt)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None


def _num_logprobs(body: ChatCompletionRequest) -> int | None:
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}",
                       param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], num_top: int) -> ChatLogprobs:
    def top(lp: Logprob) -> dict:
        return dict(token=lp.decoded_token, logprob=lp.logprob, bytes=list(lp.decoded_token.encode()))

    content = []
    for tok, entry in zip(token_ids, entries):
        ranked = sorted(entry.values(), key=lambda lp: lp.rank or 0)[:num_top]
        content.append(ChatTokenLogprob(**top(entry[tok]), top_logprobs=[TopLogprob(**top(lp)) for lp in ranked]))
    return ChatLogprobs(content=content)


async def create_chat_completion(body: ChatCompletionRequest, state: ServerState, request: Request) -> Response:
    rid, hooks = new_request_id("chatcmpl"), state.hooks
    span = HttpSpan(hooks, PATH, rid, request, body.stream)
    with span.refusals():
        state.check_model(body.model)
        num_logprobs = _num_logprobs(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = sampling_params(body, max_tokens, num_logprobs)
        prompt = await chat_prompt(state, body.messages, body.add_generation_prompt)
        if hooks.active:
            trace_request(hooks, "chat_request", rid, params, body.user, prompt=prompt, num_messages=len(body.messages))
        [stream] = await submit(state, [rid], [prompt], params, body.priority)
    return await answer(span, request, _Ctx(state, body, span, params.stop_strs), stream, [stream], body.stream)


class _Ctx:
    def __init__(self, state: ServerState, body: ChatCompletionRequest, span: HttpSpan, stops: list[str]):
        self.state, self.body, self.span, self.stops = state, body, span, stops
        rid = self.rid = span.request_id
        self.created = int(time.time())
        self._frames = ChunkFrames(ChatCompletionChunk(id=rid, created=self.created, model=state.model_name,
                                                       choices=[]))

    def _logprobs(self, token_ids, entries) -> ChatLogprobs | None:
        return chat_logprobs(token_ids, entries, self.body.top_logprobs or 0) if self.body.logprobs else None

    async def collect(self, stream: RequestStream) -> RequestOutput:
        out = None
        try:
            async for out in stream:
                pass
        except EngineClosedError as e:
            self.state.num_cut_at_shutdown += 1
            raise APIError(503, str(e)) from None
        return out

    def response(self, out: RequestOutput) -> ChatCompletionResponse:
        choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                              logprobs=self._logprobs(c.token_ids, c.logprobs), finish_reason=c.finish_reason,
                              stop_reason=c.stop_reason) for c in out.outputs]
        return ChatCompletionResponse(id=self.rid, created=self.created, model=self.state.model_name,
                                      choices=choices, usage=_usage(out), kv_transfer_params=out.kv_transfer_params)

    def _chunk(self, index: int, delta: dict, logprobs: ChatLogprobs | None = None,
               finish_reason: str | None = None) -> bytes:
        """One chunk's frame; delta holds only what changed (DeltaMessage without its None fields)."""
        return self._frames.frame({"index": index, "delta": delta,
                                   "logprobs": logprobs.model_dump() if logprobs is not None else None,
                                   "finish_reason": finish_reason})

    async def stream(self, stream: RequestStream):
        n = self.body.n
        hooks, chunks, final = self.state.hooks, 0, None
        hold, sent_tokens, done = [StopHoldback(self.stops) for _ in range(n)], [0] * n, [False] * n
        try:
            for i in range(n):  # OpenAI opens each choice with the role
                yield self._chunk(i, {"role": "assistant", "content": ""})
            async for out in stream:
                final = out if out.finished else None
                for c in out.outputs:
                    i = c.index
                    if done[i]:
                        continue  # n > 1: another choice moved
                    done[i] = c.finish_reason is not None
                    text = hold[i].delta(c.text, done[i])
                    sent, sent_tokens[i] = sent_tokens[i], len(c.token_ids)
                    lp = self._logprobs(c.token_ids[sent:], c.logprobs[sent:]) if self.body.logprobs else None
                    if not done[i] and not text and not (lp and lp.content):
                        continue  # nothing new to say (a held-back or partial character)
                    reason = c.finish_reason if done[i] else None
                    if hooks.active:
                        hooks.emit(API, "sse_chunk", request_id=self.rid, text=text, finish_reason=reason)
                    chunks += 1
                    yield self._chunk(i, {"content": text}, lp, reason)
            opts = self.body.stream_options
            if opts and opts.include_usage and final is not None:
                yield sse(ChatCompletionChunk(id=self.rid, created=self.created, model=self.state.model_name,
                                              choices=[], usage=_usage(final)))
        except EngineDeadError as e:  # the engine core process died: say so, no traceback
            yield sse(APIError(500, str(e), code="engine_dead").body())
        except EngineClosedError as e:  # the server is shutting down: say so, then [DONE]
            self.state.num_cut_at_shutdown += 1
            yield sse(APIError(503, str(e)).body())
        except Exception as e:  # the status line is gone already: report it in the stream
            log.exception("chat stream %s failed", self.rid)
            yield sse(APIError(500, f"internal error: {type(e).__name__}: {e}").body())
        finally:
            self.span.end(200, chunks=chunks, complete=final is not None)
        yield SSE_DONE


def _usage(out: RequestOutput) -> UsageInfo:
    p, c = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
    return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)
