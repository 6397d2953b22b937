"""Offline distillation: a stage that fine-tunes SFT toward a teacher's token distributions on the SFT data."""

from __future__ import annotations

from pydantic import Field, model_validator

from alignflow.config.base import TrainConfig


class OfflineDistillConfig(TrainConfig):
    """`distill:` the SFT policy trained to the teacher's next-token distributions on the SFT split, the
    teacher's top-k log-probs at every response position computed once per data and teacher (a cached
    stage, `distill_teacher`), the loss the KL from the teacher's renormalised top-k to the student."""

    teacher: str = Field(description="a policy of this pipeline (a round_k, the preference policy's loss name, "
                                     "base) or a model directory or hub id with the student's tokenizer")
    teacher_revision: str | None = Field(
        None, description="the hub teacher's branch, tag or commit (as model.revision); a policy of this "
        "pipeline or a directory has none")
    top_k: int = Field(20, ge=1, description="teacher tokens kept per position (its distribution renormalised "
                                             "over them)")

    @model_validator(mode="after")
    def _unpacked(self) -> OfflineDistillConfig:
        if self.packing:
            raise ValueError("distill.packing: the teacher's cached log-probs are per padded row; leave packing off")
        return self
