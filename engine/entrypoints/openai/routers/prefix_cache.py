"""POST /reset_prefix_cache (vLLM's, there in dev mode): forget every cached block, so the next
request computes its whole prompt again (e.g. to measure a cold prefill). A control action, so
it is guarded as the trace controls are: loopback or the API key, and JSON from a web page (security.py)."""
from __future__ import annotations

from fastapi import APIRouter, Depends

from engine.entrypoints.openai.errors import ERROR_RESPONSES, APIError
from engine.entrypoints.openai.protocol import ErrorResponse
from engine.entrypoints.openai.security import require_control
from engine.entrypoints.openai.state import StateDep

router = APIRouter(tags=["server"], dependencies=[Depends(require_control)], responses=ERROR_RESPONSES | {
    403: {"model": ErrorResponse, "description": "not loopback and no --api-key"},
    409: {"model": ErrorResponse, "description": "requests hold KV blocks"},
    415: {"model": ErrorResponse, "description": "a web page's POST whose body is not declared as JSON"},
    503: {"model": ErrorResponse, "description": "the engine loop is not running"}})


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(state: StateDep) -> dict:
    """200 {"reset": true}; 409 while requests hold KV blocks (their blocks stay cached)."""
    if not state.engine.is_running:
        raise APIError(503, "the engine loop is not running")
    if not await state.engine.reset_prefix_cache():
        raise APIError(409, "requests in flight hold KV blocks; reset the prefix cache when the engine is idle",
                       code="engine_busy")
    return {"reset": True}
