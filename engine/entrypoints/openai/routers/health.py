"""GET /health (200 while the engine loop runs, else 503) and GET /version."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Response

from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.protocol import ErrorResponse
from engine.entrypoints.openai.state import StateDep

router = APIRouter(tags=["server"])


def package_version() -> str:
    try:
        return version("vllm-trace")
    except PackageNotFoundError:  # running from a checkout that was never installed
        return "0+unknown"


@router.get("/health", response_class=Response,
            responses={200: {"description": "the engine loop runs (an empty body, as in vLLM)", "content": None},
                       503: {"model": ErrorResponse, "description": "the engine loop is not running"}})
async def health(state: StateDep) -> Response:
    if not state.engine.is_running:
        raise APIError(503, "the engine loop is not running")
    return Response(status_code=200)


@router.get("/version")
async def get_version() -> dict:
    return {"version": package_version()}
