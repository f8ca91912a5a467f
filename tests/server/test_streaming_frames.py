"""Streamed chunks are framed with orjson around an envelope made once (ChunkFrames): the JSON must
be exactly what the pydantic models of the OpenAI schema give, for every kind of chunk."""
import json
import math

import pytest

from engine.entrypoints.openai.protocol import (
    ChatCompletionChunk,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    TopLogprob,
)
from engine.entrypoints.openai.serving import ChunkFrames, sse


def _parse(frame: bytes | str) -> dict:
    text = frame.decode() if isinstance(frame, bytes) else frame
    assert text.startswith("data: ") and text.endswith("\n\n")
    return json.loads(text[len("data: "):])


COMPLETION_LP = CompletionLogprobs(tokens=[" a", "é"], token_logprobs=[-0.5, -math.inf],
                                   top_logprobs=[{" a": -0.5, " b": -1.25}, {"é": -math.inf}], text_offset=[0, 2])


@pytest.mark.parametrize("text, lp, finish, stop", [
    (" the", None, None, None),
    ("quote \" and \\ and \n and ☃ 👋", None, None, None),
    ("", COMPLETION_LP, None, None),
    (" end", None, "stop", "\n\n"),
    ("", None, "stop", 50256),
    (" cut", None, "length", None),
])
def test_completion_frames_are_the_schema_json(text, lp, finish, stop):
    frames = ChunkFrames(CompletionResponse(id="cmpl-1", created=1700000000, model="tiny-gpt2", choices=[]))
    for i in (0, 3):
        got = frames.frame({"index": i, "text": text, "logprobs": lp.model_dump() if lp else None,
                            "finish_reason": finish, "stop_reason": stop})
        want = sse(CompletionResponse(id="cmpl-1", created=1700000000, model="tiny-gpt2", choices=[
            CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=finish, stop_reason=stop)]))
        assert _parse(got) == _parse(want)


CHAT_LP = ChatLogprobs(content=[ChatTokenLogprob(token=" a", logprob=-0.25, bytes=[32, 97],
                                                 top_logprobs=[TopLogprob(token=" a", logprob=-0.25, bytes=[32, 97])])])


@pytest.mark.parametrize("delta, lp, finish", [
    ({"role": "assistant", "content": ""}, None, None),
    ({"content": " hi"}, None, None),
    ({"content": " hi"}, CHAT_LP, None),
    ({"content": ""}, None, "stop"),
])
def test_chat_frames_are_the_schema_json(delta, lp, finish):
    frames = ChunkFrames(ChatCompletionChunk(id="chatcmpl-1", created=1700000000, model="tiny-gpt2", choices=[]))
    got = frames.frame({"index": 0, "delta": delta, "logprobs": lp.model_dump() if lp else None,
                        "finish_reason": finish})
    want = sse(ChatCompletionChunk(id="chatcmpl-1", created=1700000000, model="tiny-gpt2", choices=[
        ChatStreamChoice(index=0, delta=DeltaMessage(**delta), logprobs=lp, finish_reason=finish)]))
    assert _parse(got) == _parse(want)


def test_an_envelope_with_choices_is_refused():
    with pytest.raises(ValueError, match="choices"):
        ChunkFrames(CompletionResponse(id="x", created=1, model="m", choices=[CompletionChoice(index=0, text="")]))
