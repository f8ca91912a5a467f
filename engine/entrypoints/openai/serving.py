"""Shared serving logic: OpenAI fields -> SamplingParams, submitting to the async engine,
stop-string hold-back for streams, merging several request streams, SSE framing, aborting
when the client goes away, and the http layer's span of each request (HttpSpan, answer)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from typing import AsyncIterator

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from engine.engine.exceptions import EngineClosedError
from engine.engine.output_processor import RequestStream
from engine.entrypoints.openai.errors import APIError, bad_request
from engine.entrypoints.openai.protocol import SamplingRequest
from engine.entrypoints.openai.state import ServerState
from engine.hooks import BEGIN, END
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from engine.structured_output.backend_xgrammar import validate_structured_output
from engine.trace_names import API, HTTP


def new_request_id(prefix: str) -> str:
    """`cmpl-…` / `chatcmpl-…`: the id the engine, the trace and the TUI all show."""
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def sampling_params(req: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options can only be set when stream is true", param="stream_options")
    try:
        structured_outputs = _structured_outputs(req)
        return SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k in (None, 0) else req.top_k,  # OpenAI-style 0 means off
            min_p=req.min_p or 0.0, seed=req.seed, presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            logit_bias=_token_bias(req.logit_bias), allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
            structured_outputs=structured_outputs,
            extra_args={"kv_transfer_params": req.kv_transfer_params} if req.kv_transfer_params else None)
    except SamplingParamsError as e:
        raise bad_request(e) from None


def _structured_outputs(req: SamplingRequest) -> StructuredOutputsParams | None:
    """OpenAI's response_format or vLLM's structured_outputs (not both) as StructuredOutputsParams."""
    fmt, so = req.response_format, req.structured_outputs
    if fmt is not None and fmt.type != "text" and so is not None:
        raise APIError(400, "set response_format or structured_outputs, not both", param="response_format")
    if so is not None:
        return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                       json_object=so.json_object, whitespace_pattern=so.whitespace_pattern,
                                       disable_any_whitespace=so.disable_any_whitespace)
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(400, "response_format json_schema needs json_schema.schema (the JSON schema)",
                       param="response_format")
    return StructuredOutputsParams(json=fmt.json_schema.schema_)


def _token_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias has token ids as JSON keys (strings)."""
    if bias is None:
        return None
    try:
        return {int(t): b for t, b in bias.items()}
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids (integers)", param="logit_bias") from None


class HttpSpan:
    """The http layer's span of one OpenAI request (`POST /v1/completions`, `POST
    /v1/chat/completions`): BEGIN as it arrives, END once with how it ended: a refusal's status
    and message, a client that left (499), a full answer's usage, a stream's chunk count."""

    def __init__(self, hooks, path: str, request_id: str, request: Request, stream: bool):
        self.hooks, self.path, self.request_id = hooks, path, request_id
        if hooks.active:
            hooks.emit(HTTP, path, BEGIN, request_id=request_id, stream=stream,
                       client=request.client and request.client.host)

    def end(self, status: int, **attrs) -> None:
        if self.hooks.active:
            self.hooks.emit(HTTP, self.path, END, request_id=self.request_id, status=status, **attrs)

    @contextlib.contextmanager
    def refusals(self):
        """Around the checks and the submit: an APIError ends the span with its status, then goes on up."""
        try:
            yield
        except APIError as e:
            self.end(e.status, error=e.message)
            raise


async def answer(span: HttpSpan, request: Request, ctx, what, streams: list[RequestStream], stream: bool) -> Response:
    """The submitted request's answer: its SSE stream (ctx.stream(what), which ends the span), or
    the full response once generated (ctx.collect(what), then ctx.response), 499 if the client left."""
    if stream:
        return event_stream(ctx.stream(what), streams)
    final = await until_disconnected(request, ctx.collect(what))
    if final is None:  # the client left; its requests were aborted and nobody reads this
        span.end(499, disconnected=True)
        return Response(status_code=499)
    resp = ctx.response(final)
    span.end(200, usage=resp.usage.model_dump())
    return JSONResponse(resp.model_dump())


def trace_request(hooks, name: str, request_id: str, params: SamplingParams, user: str | None, **attrs) -> None:
    """The api layer's event for a request as the serving layer understood it."""
    hooks.emit(API, name, request_id=request_id, params=vars(params), user=user, **attrs)


async def submit(state: ServerState, request_ids: list[str], prompts: list, params: SamplingParams,
                 priority: int = 0) -> list[RequestStream]:
    """Tokenize every prompt (engine.renderers.online_renderer), then queue all or none: a bad
    one aborts those already queued, then raises 400."""
    try:
        if params.structured_outputs is not None:  # on a thread: the first one imports xgrammar (~2 s)
            await state.renderer.run(validate_structured_output, params.structured_outputs)
        engine_prompts = [await state.renderer.process(rid, p) for rid, p in zip(request_ids, prompts)]
    except ValueError as e:
        raise bad_request(e) from None
    streams: list[RequestStream] = []
    try:
        for rid, prompt in zip(request_ids, engine_prompts):
            streams.append(await state.engine.add_request(rid, prompt, params, priority))
    except BaseException as e:
        for s in streams:
            s.abort()
        if isinstance(e, EngineClosedError):
            raise APIError(503, str(e)) from None
        if isinstance(e, ValueError):
            raise bad_request(e) from None
        raise
    return streams


class StopHoldback:
    """Streams text without ever sending part of a stop string.

    While the text ends with a prefix of a stop string ("...\\n\\nUs" with stop "\\n\\nUser")
    that tail is held back: if the stop string completes, the engine cuts it from the final
    text, and anything already sent could not be taken back. Sent text is always a prefix of
    the final text, so the chunks add up to exactly the non-streamed answer.
    """

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.sent = 0

    def delta(self, text: str, finished: bool) -> str:
        end = len(text) if finished else len(text) - self._held(text)
        if end <= self.sent:
            return ""
        out, self.sent = text[self.sent:end], end
        return out

    def _held(self, text: str) -> int:
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) from several streams as they arrive. Closing this aborts them all."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))
        else:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()  # cancelling a pump aborts its request
        for s in streams:
            s.abort()


def sse(obj: BaseModel | dict | str) -> str:
    if isinstance(obj, BaseModel):
        obj = obj.model_dump_json()
    elif isinstance(obj, dict):
        obj = json.dumps(obj)
    return f"data: {obj}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class ChunkFrames:
    """The SSE frames of one streamed response's chunks.

    The envelope (id, object, created, model, usage) is the pydantic model's own JSON, made once
    per response from a chunk with no choices; each chunk's choice (a dict with the fields of the
    model's choice class) is serialized with orjson between its halves. 0.6 µs a chunk instead of
    6 µs for building and dumping the pydantic models, paid 64 times a step under 64 streams
    (measured). tests/server/test_streaming_frames.py checks both give the same JSON.
    """

    def __init__(self, envelope: BaseModel):
        head, sep, tail = envelope.model_dump_json().partition('"choices":[]')
        if not sep:
            raise ValueError("the envelope must be a chunk with choices=[]")
        self.head, self.tail = f"data: {head}\"choices\":[".encode(), f"]{tail}\n\n".encode()

    def frame(self, choice: dict) -> bytes:
        return self.head + orjson.dumps(choice) + self.tail


def event_stream(gen, streams: list[RequestStream]) -> StreamingResponse:
    """An SSE response that aborts its requests however it ends. When the client disconnects,
    Starlette cancels the sender, which may leave `gen` suspended (or never started), so the
    background task, which runs after the response in every case, closes it and aborts."""
    async def cleanup() -> None:
        await gen.aclose()
        for s in streams:
            s.abort()

    return StreamingResponse(gen, media_type="text/event-stream", background=BackgroundTask(cleanup))


async def until_disconnected(request: Request, work):
    """Run `work` (a coroutine) but cancel it if the client disconnects first, so a
    non-streaming request whose client has gone is aborted in the engine. Returns None then."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # a cancelled task is done only once it has run its cancellation: wait for that
            # (its result, had it finished meanwhile, is nobody's: the client has gone)
            await asyncio.wait({task})
    if task.cancelled():
        return None
    return task.result()
