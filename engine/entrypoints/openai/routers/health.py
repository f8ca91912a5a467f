"""GET /health (200 while the engine is alive and answering, else 503) and GET /version."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Response

from engine.engine.exceptions import EngineDeadError
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
            responses={200: {"description": "the engine is alive and answering (an empty body, as in vLLM); "
                                            "one held by the step controller is", "content": None},
                       503: {"model": ErrorResponse,
                             "description": "the engine died, is stopping, or its core process stopped answering"}})
async def health(state: StateDep) -> Response:
    try:
        await state.engine.check_health()  # the engine core process: a ping, answered within seconds
    except EngineDeadError as e:
        raise APIError(503, str(e)) from None
    return Response(status_code=200)


@router.get("/version")
async def get_version() -> dict:
    return {"version": package_version()}
