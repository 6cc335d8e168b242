"""``GET /v1/models``: the one served model."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.edge.auth import ApiKeyDep
from gateway.openai_api.answers import ModelCard, ModelList
from gateway.state import StateDep

router = APIRouter(dependencies=[ApiKeyDep])


@router.get("/v1/models", response_model=ModelList)
async def list_models(state: StateDep) -> ModelList:
    return ModelList(data=[ModelCard(id=state.model_name)])
