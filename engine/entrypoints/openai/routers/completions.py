"""POST /v1/completions and POST /v1/chat/completions."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from engine.entrypoints.openai.errors import ERROR_RESPONSES
from engine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
)
from engine.entrypoints.openai.security import require_api_key
from engine.entrypoints.openai.serving_chat import create_chat_completion
from engine.entrypoints.openai.serving_completion import create_completion
from engine.entrypoints.openai.state import StateDep

router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Depends(require_api_key)], responses=ERROR_RESPONSES)

SSE = {"text/event-stream": {"description": "with stream: true, server-sent events ending with `data: [DONE]`"}}


@router.post("/completions", response_model=CompletionResponse,
             responses={200: {"content": SSE}})
async def completions(body: CompletionRequest, state: StateDep, request: Request):
    """Text completion for one or several prompts (strings or token ids)."""
    return await create_completion(body, state, request)


@router.post("/chat/completions", response_model=ChatCompletionResponse,
             responses={200: {"content": SSE}})
async def chat_completions(body: ChatCompletionRequest, state: StateDep, request: Request):
    """Chat completion: the messages go through the chat template, then the engine."""
    return await create_chat_completion(body, state, request)
