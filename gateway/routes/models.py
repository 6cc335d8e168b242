"""``GET /v1/models``: the one served model."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.auth import ApiKeyDep
from gateway.state import StateDep
from shared.schemas import ModelCard, ModelList

router = APIRouter(dependencies=[ApiKeyDep])


@router.get("/v1/models", response_model=ModelList)
async def list_models(state: StateDep) -> ModelList:
    return ModelList(data=[ModelCard(id=state.model_name)])
