"""`GET /v1/models` and `GET /v1/models/{id}`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvgate"
    root: str | None = None  # vLLM extra: the model the name serves
    max_model_len: int | None = None  # vLLM extra
    features: list[str] | None = None  # kvgate extra: what the replica serves (protocol/features.py)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
