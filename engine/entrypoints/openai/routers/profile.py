"""POST /start_profile and POST /stop_profile (vLLM's): every op of the forward pass profiled
from the next step on, then no more. Each op is a kernel launch in the trace (layer ``kernel``,
with ``op``, ``flops``, ``bytes`` and ``profiled: true``); the window is marked by the
``profiler`` layer's ``start`` and ``stop`` events; with ``--profiler-dir`` torch.profiler
captures it too, one file per rank (named in the answer to /stop_profile). Control actions,
guarded as the trace controls are: loopback or the API key, and JSON from a web page (security.py)."""
from __future__ import annotations

from fastapi import APIRouter, Depends

from engine.engine.exceptions import EngineClosedError, EngineDeadError
from engine.entrypoints.openai.errors import ERROR_RESPONSES, APIError
from engine.entrypoints.openai.protocol import ErrorResponse
from engine.entrypoints.openai.security import require_control
from engine.entrypoints.openai.state import StateDep

router = APIRouter(tags=["server"], dependencies=[Depends(require_control)], responses=ERROR_RESPONSES | {
    403: {"model": ErrorResponse, "description": "not loopback and no --api-key"},
    415: {"model": ErrorResponse, "description": "a web page's POST whose body is not declared as JSON"},
    503: {"model": ErrorResponse, "description": "the engine loop is not running"}})


async def _profile(state, is_start: bool) -> dict:
    engine = state.engine
    if not engine.is_running:
        raise APIError(503, "the engine loop is not running")
    try:
        return await (engine.start_profile() if is_start else engine.stop_profile())
    except (EngineClosedError, EngineDeadError, RuntimeError) as e:
        raise APIError(503, f"the engine could not {'start' if is_start else 'stop'} profiling: {e}") from None


@router.post("/start_profile")
async def start_profile(state: StateDep) -> dict:
    """200 {"profiling": true, "step": the first profiled step, "profiler_dir", "ranks"}."""
    return await _profile(state, True)


@router.post("/stop_profile")
async def stop_profile(state: StateDep) -> dict:
    """200 {"profiling": false, "step": the last profiled step, "profiler_dir", "ranks": [{"rank",
    "trace_file" (with a profiler dir)}]}."""
    return await _profile(state, False)
