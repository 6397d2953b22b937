"""A process reward model (PRM): a scalar head scoring every step of a solution, trained on step labels."""

from __future__ import annotations

from pydantic import model_validator

from alignflow.config.base import TrainConfig
from alignflow.config.data import DataConfig


class ProcessRewardModelConfig(TrainConfig):
    """Binary cross-entropy at the end of every step of data.process's solutions (or the bundled task's:
    data.synthetic.num_process), from SFT (or the base model). Its evaluation scores the held-out solutions:
    step accuracy, solution accuracy (the weakest step's sign) and the first wrong step found."""

    @model_validator(mode="after")
    def _no_packing(self) -> ProcessRewardModelConfig:
        if self.packing:
            raise ValueError("packing: a process reward model trains on padded rows only; set packing: false")
        return self


def process_data_missing(data: DataConfig) -> str | None:
    """Why a process reward model would have no step-labelled solutions to train on, or None."""
    if data.source == "files" and data.process is None:
        return ("process_reward_model trains on step-labelled solutions: give data.process (rows of a prompt, its "
                "steps and a label per step), or set process_reward_model: null")
    if data.source == "synthetic" and not data.synthetic.num_process:
        return ("process_reward_model trains on step-labelled solutions, and data.synthetic.num_process is 0: set "
                "it (2000, say) for the bundled task's, or set process_reward_model: null")
    return None
