"""GET /v1/models."""
from __future__ import annotations

from fastapi import APIRouter, Depends

from engine.entrypoints.openai.errors import ERROR_RESPONSES
from engine.entrypoints.openai.protocol import ModelCard, ModelList
from engine.entrypoints.openai.security import require_api_key
from engine.entrypoints.openai.state import StateDep

router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Depends(require_api_key)], responses=ERROR_RESPONSES)


@router.get("/models", response_model=ModelList)
async def list_models(state: StateDep) -> ModelList:
    engine = state.engine
    return ModelList(data=[ModelCard(id=state.model_name, created=state.created, root=str(engine.model_path),
                                     max_model_len=engine.max_model_len)])
