"""Small typed records passed between Prefect tasks (never tensors)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StageResult(BaseModel):
    """A committed stage output: where it is and what it measured."""

    model_config = ConfigDict(frozen=True)

    stage: str
    key: str
    uri: str
    metrics: dict[str, float] = {}

