"""The offline preference stage: DPO and its IPO / cDPO / KTO cousins, trained after SFT on `data.preference`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from alignflow.config.base import Placement, TrainConfig

PreferenceLoss = Literal["dpo", "ipo", "cdpo", "kto"]

# The pure loss each name selects (algos/losses/preference.py): dpo_loss's loss_type, or KTO.
DPO_LOSS_TYPE = {"dpo": "sigmoid", "ipo": "ipo", "cdpo": "cdpo"}


class PreferenceConfig(TrainConfig):
    """Direct alignment on preference pairs against a frozen reference (the policy it starts from).

    dpo: -log σ(β h); cdpo: label-smoothed DPO; ipo: (h - 1/(2β))²; with h the chosen-minus-rejected
    log-ratio to the reference (Rafailov et al. 2023; Mitchell 2023; Azar et al. 2023). kto: every
    pair gives one desirable and one undesirable example, each pulled across a KL reference point
    (Ethayarajh et al. 2024). The reference's log-probabilities are computed once per dataset
    (the `preference_reference` stage) and cached.
    """

    loss: PreferenceLoss = Field("dpo", description="dpo, ipo, cdpo (label-smoothed dpo) or kto")
    beta: float = Field(0.1, gt=0, description="strength of the pull toward the reference")
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="cdpo: the assumed share of flipped labels (> 0); 0 for the other losses")
    desirable_weight: float = Field(1.0, gt=0, description="kto: weight of desirable (chosen) examples")
    undesirable_weight: float = Field(1.0, gt=0, description="kto: weight of undesirable (rejected) examples")
    learning_rate: float = Field(5e-4, gt=0, description="peak AdamW learning rate")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear learning-rate warmup; 0: none")
    reference_placement: Placement = Field(
        default_factory=Placement, description="the reference model while it scores the data once")
    reference_micro_batch_size: int | None = Field(64, ge=1, description="sequences per reference forward")

    @model_validator(mode="after")
    def _loss_options(self) -> PreferenceConfig:
        if self.loss == "cdpo" and self.label_smoothing == 0:
            raise ValueError("preference.loss=cdpo needs preference.label_smoothing > 0 (with 0 it is dpo)")
        if self.loss != "cdpo" and self.label_smoothing:
            raise ValueError(f"preference.label_smoothing is cdpo's; with preference.loss={self.loss} set it to 0 "
                             f"(or use loss: cdpo)")
        # Set to another value than the default (a run form sends every field, defaults included).
        weights = {n for n in ("desirable_weight", "undesirable_weight")
                   if getattr(self, n) != type(self).model_fields[n].default}
        if weights and self.loss != "kto":
            raise ValueError(f"preference.{' and preference.'.join(sorted(weights))} are kto's; "
                             f"preference.loss is {self.loss}")
        return self
