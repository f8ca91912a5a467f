"""POST /tokenize and POST /detokenize (vLLM's extras): see what the model sees."""
from __future__ import annotations

from fastapi import APIRouter

from engine.entrypoints.openai.errors import ERROR_RESPONSES, APIError
from engine.entrypoints.openai.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from engine.entrypoints.openai.serving_chat import chat_prompt
from engine.entrypoints.openai.state import StateDep

router = APIRouter(tags=["tokenizer"], responses=ERROR_RESPONSES)


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, state: StateDep) -> TokenizeResponse:
    """Token ids of `prompt`, or of `messages` after the chat template."""
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt")
    text = body.prompt if body.prompt is not None else await chat_prompt(state, body.messages,
                                                                          body.add_generation_prompt)
    ids = await state.renderer.encode(text)
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=state.engine.max_model_len)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, state: StateDep) -> DetokenizeResponse:
    state.check_model(body.model)
    vocab = len(state.engine.tokenizer)
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token ids must be in [0, {vocab - 1}], got {bad[:5]}", param="tokens")
    return DetokenizeResponse(prompt=state.engine.tokenizer.decode(body.tokens))
