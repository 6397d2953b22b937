"""The whole pipeline: which stages exist follows from these sections.

    data -> base model -> [sft] -> [reward model] -> [preference] -> rounds 1..R -> [evaluation]

A section set to null is not planned. SFT absent: rounds start from the base model, which is then also
the reference. A preference section (DPO's family, KTO, SimPO, ORPO; off by default) trains after SFT; rounds then
start from it. The reward model is trained when a round scores with it or starts its critic from it, or
when there are no rounds and no preference stage (it is then a product of the run); otherwise it is
skipped: with a preference stage and no rounds, the pipeline is SFT, preference, evaluation.
"""

from __future__ import annotations

import re
from typing import Literal, get_args

from pydantic import Field, model_validator

from alignflow.config.base import Placement, Section, TrainConfig
from alignflow.config.data import DataConfig
from alignflow.config.evaluation import EvalConfig
from alignflow.config.distill import OfflineDistillConfig
from alignflow.config.round.judge import VERDICTS, JudgeConfig
from alignflow.config.model import ModelConfig
from alignflow.config.preference import REFERENCE_FREE, PreferenceConfig, PreferenceLoss
from alignflow.config.process import ProcessRewardModelConfig, process_data_missing
from alignflow.config.round.rl import ActorConfig, RoundConfig
from alignflow.redact import config_credentials
from alignflow.config.round.verdicts import parse_verdict


# Names a policy of a pipeline can have (`rounds[i].teacher` / `start_from`); any other teacher is a model path.
POLICY_NAME = re.compile(rf"base|sft|round_\d+|{'|'.join(get_args(PreferenceLoss))}")


def _policy_or_model(field: str, name: str, known: list[str], where: str, revision: str | None = None) -> None:
    """A teacher is a policy of `known`, or a model directory or hub id; a policy's name (POLICY_NAME) that is
    not among `known` is an error, not a path. A `revision` pins a hub model: a policy has none."""
    if name not in known and POLICY_NAME.fullmatch(name):
        raise ValueError(f"{field}: {name!r} names no policy {where} (those are {', '.join(known)}); anything else "
                         f"is taken as a model directory or hub id")
    if revision is not None and name in known:
        raise ValueError(f"{field}_revision: {name!r} is a policy of this pipeline, which has no revision; a "
                         f"revision pins a hub model's branch, tag or commit")


class SFTConfig(TrainConfig):
    """Supervised fine-tuning: next-token loss on response tokens only."""

    train_on: Literal["response", "assistant_turns"] = Field(
        "response", description="response: the loss on each row's response (a conversation's last reply); "
        "assistant_turns: also on every assistant message of a conversation prompt, its content and the chat "
        "template's end of turn (OpenRLHF's --multiturn, TRL's assistant_only_loss; counted as "
        "data/sft_assistant_turns). A template that renders earlier turns otherwise than the last (Qwen3's) fails "
        "the stage before training, naming the row")
    objective: Literal["nll", "dft"] = Field(
        "nll", description="nll: the mean negative log-likelihood of the response tokens; dft: Dynamic Fine-Tuning, "
        "each token's NLL weighted by its own probability, held constant (Wu et al. 2025, arXiv 2508.05629): "
        "logged as train/loss, the NLL beside it as train/nll")
    neftune_alpha: float | None = Field(
        None, gt=0, description="NEFTune: uniform noise of scale alpha / sqrt(sequence length x embedding width) on "
        "the input embeddings while training (Jain et al. 2023, arXiv 2310.05914; the paper tries 5 to 15); None: off")


class RewardModelConfig(TrainConfig):
    """Bradley-Terry pairwise reward model, initialised from SFT (or the base model)."""

    margin: float = Field(0.0, ge=0, description="added margin in -log sigmoid(c - r - m)")


class StorageConfig(Section):
    """One root URI for every artifact; credentials come from the environment."""

    root: str = Field("./artifacts", description="local path or fsspec URI (s3://...) every artifact goes under")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto)")
    cache_dir: str = Field("~/.cache/alignflow", description="local copies of remote checkpoints")


class InfraConfig(Section):
    """Where the pipeline runs and reports."""

    storage: StorageConfig = Field(StorageConfig(), description="where artifacts are stored")
    mlflow_tracking_uri: str = Field(
        "sqlite:///mlflow.db", description="MLflow tracking URI (a relative sqlite path: from the working directory)")
    mlflow_experiment: str = Field("alignflow", description="MLflow experiment the runs are logged to")
    ray_address: str | None = Field(None, description="existing cluster; None starts a local Ray")
    ray_num_cpus: int = Field(
        16, ge=1, description="logical CPU slots of the local Ray (actors and tasks each take slots; not cores)")
    prefect_api_url: str | None = Field(None, description="None: the CLI starts a local API")
    task_retries: int = Field(2, ge=0, description="retries of a failed stage (not for config/data errors); 0: none")
    retry_delay_seconds: float = Field(
        2.0, ge=0, description="seconds between a failed stage and its retry, on average: Prefect draws each "
        "delay at random, at most 1.5x it, so that stages failed together do not retry together")
    keep_warm_s: float = Field(
        30.0, ge=0, description="seconds a stage's trainer ranks and scorers that hold no GPU, once it ends, stay "
        "idle in their processes for the run's next stage in the same worker to take, where its placement matches, "
        "instead of starting processes of its own (engines/placement/warm.py); Ray resources stay held meanwhile. "
        "0: none kept")
    torch_threads: int = Field(
        2, ge=1, description="torch/OpenMP threads per process, where a placement sets no cpu_cores")
    allocator: Literal["glibc_retain", "jemalloc", "system"] = Field(
        "glibc_retain", description="CPU memory allocator of every process Ray starts: glibc keeping freed "
        "memory for reuse instead of returning it to the kernel at every free (no extra library); jemalloc "
        "(libjemalloc2, preloaded, no decay); or glibc as it comes. bench/step/rl_step.py measures them")


class PipelineConfig(Section):
    """The whole pipeline. `seed` is the one seed every stage derives its own from."""

    name: str = Field("tiny", description="run name: MLflow's parent run is <name>-<flow run name>")
    seed: int = Field(0, description="the one seed every stage derives its own from")
    data: DataConfig = Field(DataConfig(), description="where the data comes from")
    model: ModelConfig = Field(ModelConfig(), description="the base policy")
    sft: SFTConfig | None = Field(
        SFTConfig(), description="supervised fine-tuning; null: no SFT stage, rounds start from the base model")
    reward_model: RewardModelConfig | None = Field(
        RewardModelConfig(), description="reward model, trained where used (see above); null: none, rounds score "
        "with reward.source rule or remote")
    process_reward_model: ProcessRewardModelConfig | None = Field(
        None, description="a process reward model scoring each step of a solution, trained on data.process (from "
        "SFT); null: none")
    preference: PreferenceConfig | None = Field(
        None, description="offline DPO (or its family)/KTO/SimPO/ORPO after SFT; rounds start from it; "
                          "null: no preference stage")
    distill: OfflineDistillConfig | None = Field(
        None, description="offline distillation of a teacher into SFT on the SFT data (its own policy, `distill`); "
        "null: none")
    judge: JudgeConfig | None = Field(
        None, description="a generative judge trained on verdicts of the preference pairs (from SFT), for rounds "
        "whose reward asks a judge; null: none")
    # The second round's critic, fresh from the reward model, learns values for 3 steps before the actor
    # (a low-entropy policy by then) moves: without, 4 of 5 asynchronous second rounds went wrong (README).
    rounds: list[RoundConfig] = Field(
        default_factory=lambda: [RoundConfig(), RoundConfig(actor=ActorConfig(freeze_steps=3))],
        description="RL rounds in order, each from the previous policy; []: no RL")
    evaluation: EvalConfig | None = Field(EvalConfig(), description="held-out evaluation; null: none")
    infra: InfraConfig = Field(InfraConfig(), description="where the pipeline runs and reports")

    def hf_placements(self) -> dict[str, Placement]:
        """Where the pipeline runs transformers models, by field: trainers, scorers (reference, reward model,
        teacher) and engines of the hf backend. vLLM engines run their own attention."""
        out: dict[str, Placement] = {}
        for name in ("sft", "reward_model", "process_reward_model", "preference", "distill", "judge"):
            section = getattr(self, name)
            if section is not None and (name != "reward_model" or self.trains_reward_model):
                out[f"{name}.placement"] = section.placement
        if self.preference is not None and self.preference.loss not in REFERENCE_FREE:
            out["preference.reference_placement"] = self.preference.reference_placement
        for i, r in enumerate(self.rounds):
            out[f"rounds.{i}.actor.placement"] = r.actor.placement
            if r.spec.critic:
                out[f"rounds.{i}.critic.placement"] = r.critic.placement
            if (r.uses_reference and not self.reference_is_actor(i)) or r.reward.uses_model or \
                    r.reward.uses_process_model:
                out[f"rounds.{i}.scorer_placement"] = r.scorer_placement
            engines = [("generation", r.generation)] + [("reward.judge.generation", r.reward.judge.generation)] * \
                r.reward.uses_judge
            out.update({f"rounds.{i}.{f}.placement": g.placement for f, g in engines if g.backend == "hf"})
        if self.evaluation is not None:
            out["evaluation.scorer_placement"] = self.evaluation.scorer_placement
            if self.evaluation.generation.backend == "hf":
                out["evaluation.generation.placement"] = self.evaluation.generation.placement
        return out

    @model_validator(mode="after")
    def _flash_attention_on_gpus(self) -> PipelineConfig:
        if self.model.attn_implementation != "flash_attention_2":
            return self
        cpu = [field for field, p in self.hf_placements().items() if p.num_gpus <= 0]
        if cpu:
            raise ValueError(f"model.attn_implementation: flash_attention_2 runs on GPUs only, and these place a "
                             f"model on the CPU (num_gpus: 0): {', '.join(cpu)}; give them a GPU, or use sdpa")
        return self

    @property
    def trains_reward_model(self) -> bool:
        return self.reward_model is not None and (
            (not self.rounds and self.preference is None) or any(r.needs_reward_model for r in self.rounds))

    def policies_before(self, index: int) -> list[str]:
        """The policies round `index` (0-based) may start from or take as its teacher: base, sft, the
        preference policy (named by its loss) and the rounds before it."""
        return ["base", *(["sft"] * (self.sft is not None)), *([self.preference.loss] if self.preference else []),
                *(f"round_{k}" for k in range(1, index + 1))]

    def reference_is_actor(self, index: int) -> bool:
        """Round `index` (0-based) needs no reference scorer: a LoRA actor that starts from the rounds' KL
        reference is that reference with its adapters off (engines/rl/round_placement.py reference_is_actor,
        which compares the two checkpoints the plan hands the round)."""
        r = self.rounds[index]
        return (r.actor.lora is not None and r.uses_reference and not r.spec.teacher
                and self.start_of(index) == self.reference_of(index))

    def start_of(self, index: int) -> str:
        """The policy round `index` (0-based) starts from."""
        given = self.rounds[index].start_from
        return given or (f"round_{index}" if index else self.policies_before(0)[-1])

    def reference_of(self, index: int) -> str:
        """The KL reference of round `index` (0-based): `reference` (start: the policy it starts from), else the
        policy the rounds started from."""
        given = self.rounds[index].reference
        return self.start_of(index) if given == "start" else given or self.policies_before(0)[-1]

    @model_validator(mode="after")
    def _no_credentials(self) -> PipelineConfig:
        """A config made in Python is checked as a file is: a flow run keeps it (alignflow/redact.py)."""
        if written := [why for _, why in config_credentials(self.model_dump(mode="json", exclude_unset=True))]:
            raise ValueError("; ".join(written))
        return self

    @model_validator(mode="after")
    def _policy_names(self) -> PipelineConfig:
        for i, r in enumerate(self.rounds):
            known = self.policies_before(i)
            for field in ("start_from", "reference"):
                given = getattr(r, field)
                if given is not None and given not in known and not (field == "reference" and given == "start"):
                    raise ValueError(f"rounds.{i}.{field}: {given!r} is no policy before round_{i + 1}; valid: "
                                     f"{', '.join(known + ['start'] * (field == 'reference'))}")
            if r.teacher is None:
                continue
            _policy_or_model(f"rounds.{i}.teacher", r.teacher, known, f"before round_{i + 1}", r.teacher_revision)
            if r.teacher == self.start_of(i):
                raise ValueError(f"rounds.{i}.teacher: {r.teacher!r} is the policy round_{i + 1} starts from: "
                                 f"distilling a model into itself changes nothing (set rounds.{i}.start_from)")
        return self

    @model_validator(mode="after")
    def _distill_teacher(self) -> PipelineConfig:
        if self.distill is None:
            return self
        if self.sft is None:
            raise ValueError("distill trains SFT's policy toward the teacher on the SFT data: it needs the sft section")
        teacher = self.distill.teacher
        _policy_or_model("distill.teacher", teacher, self.policies_before(len(self.rounds)), "of this pipeline",
                         self.distill.teacher_revision)
        if teacher == "sft":
            raise ValueError("distill.teacher: 'sft' is the policy the distill stage starts from: distilling a "
                             "model into itself changes nothing")
        return self

    @model_validator(mode="after")
    def _preference_data_where_read(self) -> PipelineConfig:
        if self.data.source != "files" or self.data.preference is not None:
            return self
        readers = [name for name, reads in (("reward_model", self.trains_reward_model),
                                            ("preference", self.preference is not None),
                                            ("judge", self.judge is not None)) if reads]
        if readers:
            drop = {"reward_model": "reward_model: null" + (
                " with every round scoring by reward.source rule or remote and critic.init: policy" if self.rounds
                else " (without rounds it is trained as the run's product)")}
            raise ValueError(f"data.preference: not given, but {' and '.join(readers)} "
                             f"{'trains' if len(readers) == 1 else 'train'} on preference pairs: give data.preference, "
                             f"or set {' and '.join(drop.get(n, f'{n}: null') for n in readers)}")
        return self

    @model_validator(mode="after")
    def _process_data(self) -> PipelineConfig:
        if self.process_reward_model is not None and (why := process_data_missing(self.data)):
            raise ValueError(why)
        if self.process_reward_model is None and (asking := [f"rounds.{i}" for i, r in enumerate(self.rounds)
                                                             if r.reward.uses_process_model]):
            raise ValueError(f"{', '.join(asking)} {'asks' if len(asking) == 1 else 'ask'} the process reward model "
                             "(reward.source process_model), but process_reward_model is null: add a "
                             "process_reward_model section (it trains one)")
        return self

    @model_validator(mode="after")
    def _judge_where_needed(self) -> PipelineConfig:
        for i, r in enumerate(self.rounds):
            j = r.reward.judge
            if not r.reward.uses_judge or j.model is not None:
                continue
            if self.judge is None:
                raise ValueError(f"rounds.{i} asks the pipeline's judge (reward.judge.model is null) but the config "
                                 f"has no judge section; add one (it trains a judge) or set rounds.{i}.reward.judge.model")
            if j.template != self.judge.template:
                raise ValueError(f"rounds.{i}.reward.judge.template differs from judge.template, which the "
                                 f"pipeline's judge was trained with: {j.template!r} against {self.judge.template!r}")
            right, wrong = (parse_verdict(VERDICTS[v], j) for v in (True, False))
            if right is None or wrong is None or right <= wrong:
                raise ValueError(f"rounds.{i}.reward.judge reads the pipeline's judge, trained to answer "
                                 f"{VERDICTS[True]!r} or {VERDICTS[False]!r}, which its parse / pattern / scores read "
                                 f"as {right} and {wrong}: every verdict would score alike (unparsed_reward where "
                                 f"None); keep parse: regex and the scores of those words, the right one higher")
        return self

    @model_validator(mode="after")
    def _reward_model_where_needed(self) -> PipelineConfig:
        if self.reward_model is None:
            needing = [f"rounds.{i} ({r.algorithm})" for i, r in enumerate(self.rounds) if r.needs_reward_model]
            if needing:
                raise ValueError(
                    f"{', '.join(needing)} use the reward model (reward.source=model, or critic.init=reward_model) "
                    f"but reward_model is null; add a reward_model section, or score with "
                    f"reward.source=rule|remote|process_model "
                    f"and start a critic from the policy (critic.init=policy)")
        return self
