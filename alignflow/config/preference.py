"""The offline preference stage: DPO and its family, KTO, and the reference-free SimPO and ORPO, trained
after SFT on `data.preference`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from alignflow.config.base import Placement, TrainConfig

# The pure loss each name of DPO's family selects: algos/losses/dpo.py dpo_loss's loss_type.
DPO_LOSS_TYPE = {"dpo": "sigmoid", "ipo": "ipo", "cdpo": "cdpo", "robust": "robust", "hinge": "hinge",
                 "nca": "nca_pair", "apo_zero": "apo_zero", "apo_down": "apo_down", "sppo_hard": "sppo_hard"}
DPOLoss = Literal[tuple(DPO_LOSS_TYPE)]  # type: ignore[valid-type]
PreferenceLoss = Literal[(*DPO_LOSS_TYPE, "kto", "simpo", "orpo")]  # type: ignore[valid-type]
SMOOTHED = ("cdpo", "robust")  # the names that read label_smoothing, and need it above 0
DPO_FAMILY_HELP = ("dpo, ipo, cdpo (label-smoothed dpo), robust (rDPO: unbiased under flipped labels), hinge "
                   "(SLiC), nca, apo_zero, apo_down (APO: both likelihoods down, the rejected more) or sppo_hard")
# Losses with no reference model: no preference_reference stage, no reference log-probabilities.
REFERENCE_FREE = ("simpo", "orpo")


class PreferenceConfig(TrainConfig):
    """Direct alignment on preference pairs: against a frozen reference (the policy it starts from), or without one.

    dpo: -log σ(β h); cdpo: label-smoothed DPO; ipo: (h - 1/(2β))²; with h the chosen-minus-rejected
    log-ratio to the reference (Rafailov et al. 2023; Mitchell 2023; Azar et al. 2023); robust, hinge, nca,
    apo_zero, apo_down, sppo_hard: the rest of DPO's family (algos/losses/dpo.py). kto: every
    pair gives one desirable and one undesirable example, each pulled across a KL reference point
    (Ethayarajh et al. 2024). The reference's log-probabilities are computed once per dataset
    (the `preference_reference` stage) and cached. simpo: -log σ(β (ā_c - ā_r) - γ) on the mean token
    log-probabilities ā (Meng et al. 2024); orpo: the chosen response's mean NLL plus β times -log σ of the
    log odds ratio (Hong et al. 2024, whose λ is β here). Neither has a reference, so neither has that stage.
    """

    loss: PreferenceLoss = Field("dpo", description=f"{DPO_FAMILY_HELP}, or kto, against the reference; simpo "
                                 "or orpo without one (algos/losses/dpo.py has each formula)")
    beta: float = Field(0.1, gt=0, description="strength of the pull toward the reference; simpo: the scale of its "
                        "length-normalised reward (its paper uses 2-2.5); orpo: the odds-ratio term's weight λ")
    simpo_gamma: float = Field(0.5, ge=0, description="simpo: the target reward margin γ; unused by the other losses")
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="cdpo, robust: the assumed share of flipped labels (> 0); 0 for the others")
    rpo_alpha: float = Field(
        0.0, ge=0, description="DPO's family: the weight of the chosen responses' per-token NLL added to the loss "
        "(RPO, Pang et al. 2024); 0: off")
    desirable_weight: float = Field(1.0, gt=0, description="kto: weight of desirable (chosen) examples")
    undesirable_weight: float = Field(1.0, gt=0, description="kto: weight of undesirable (rejected) examples")
    learning_rate: float = Field(5e-4, gt=0, description="peak AdamW learning rate")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear learning-rate warmup; 0: none")
    reference_placement: Placement = Field(
        default_factory=Placement, description="the reference model while it scores the data once")
    reference_micro_batch_size: int | None = Field(64, ge=1, description="sequences per reference forward")

    @model_validator(mode="after")
    def _loss_options(self) -> PreferenceConfig:
        check_smoothing("preference", self.loss, self.label_smoothing)
        if self.rpo_alpha and self.loss not in DPO_LOSS_TYPE:
            raise ValueError(f"preference.rpo_alpha adds an NLL term to DPO's family; preference.loss is {self.loss}: "
                             f"leave it out")
        # Set to another value than the default (a run form sends every field, defaults included).
        owners = {"desirable_weight": "kto", "undesirable_weight": "kto", "simpo_gamma": "simpo"}
        if misplaced := sorted(n for n, owner in owners.items() if owner != self.loss
                               and getattr(self, n) != type(self).model_fields[n].default):
            raise ValueError(" and ".join(f"preference.{n} is {owners[n]}'s" for n in misplaced)
                             + f"; preference.loss is {self.loss}: leave {'it' if len(misplaced) == 1 else 'them'} "
                             f"out, or use the loss {'it' if len(misplaced) == 1 else 'each'} belongs to")
        return self


def check_smoothing(section: str, loss: str, label_smoothing: float) -> None:
    """label_smoothing above 0 with the losses that read it (SMOOTHED), and only with them."""
    if loss in SMOOTHED and label_smoothing == 0:
        raise ValueError(f"{section}.loss={loss} needs {section}.label_smoothing > 0 (with 0 it is dpo)")
    if loss not in SMOOTHED and label_smoothing:
        raise ValueError(f"{section}.label_smoothing is read by {' and '.join(SMOOTHED)}; with {section}.loss={loss} "
                         f"set it to 0 (or use one of those losses)")
