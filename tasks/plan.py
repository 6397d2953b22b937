"""The one planner: a PipelineConfig becomes a graph of stages with content keys.

    base_model ─> data ┬──────────────┬───────────────┬─────────────┐
        │              v              v               v             │
        └─────────> [sft] ─> [reward_model] ─> round_1 ─> ... round_R │
                       └──────────┴─────────────┴─────> eval_<policy> <┘

With a preference section (DPO and kin), SFT feeds [preference_reference] ─>
[preference]: the reference's log-probabilities of the preference split are
a cached stage of their own, and the rounds start from the preference policy.
SimPO and ORPO have no reference: SFT feeds [preference] alone.

The data stage reads the base model's tokenizer: it measures every split in
tokens and settles the prompt and response limits every later stage uses.

Which stages exist follows from the config (alignflow/config/pipeline.py):
no `sft` section, and rounds start from the base model, which is then the
reference; the reward model only where a round uses it (or the pipeline
has no rounds); a round takes only the inputs its algorithm's spec needs.
Opt-in: a `process_reward_model` (from SFT) on step-labelled solutions; a
`judge` (from SFT) for rounds whose reward asks it; offline
`distill` (from SFT) after a cached `distill_teacher`. A teacher or judge
the config names by path is committed by a base_model stage of its own.

A stage's key digests its config, the keys of its inputs, the content
fingerprints of the files, models and rule code its config names
(alignflow/store/fingerprint.py) and its kind's code version: change a stage, or
edit a file it reads, and it and everything downstream get new keys;
nothing upstream does. Planning starts nothing and imports no engine.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, SerializeAsAny

from alignflow.config import EnvironmentConfig, PipelineConfig, Section, cache_relevant
from alignflow.config.preference import REFERENCE_FREE
from alignflow.config.round.judge import JudgeGeneration, JudgeRewardConfig
from alignflow.errors import ConfigError
from alignflow.store.fingerprint import Fingerprints, module_source
from alignflow.seeds import derive_seed
from tasks import registry as r


def content_key(stage: str, config: Any, inputs: dict[str, str], code_version: str) -> str:
    """Digest of what determines a stage's output: its config, inputs and code.

    `config` is a pydantic model or a JSON-able value; `inputs` maps input
    names to their own content keys (or URIs); 20 hex chars.
    """
    if hasattr(config, "model_dump"):
        config = config.model_dump(mode="json")
    blob = json.dumps(
        {"stage": stage, "config": config, "inputs": inputs, "code": code_version},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


class PlannedStage(BaseModel):
    """One node: what runs (kind, config), on what (inputs by name), under which key."""

    model_config = ConfigDict(frozen=True)

    name: str  # unique in the pipeline; also the storage folder: {root}/{name}/{key}
    kind: str
    config: SerializeAsAny[Section]
    inputs: dict[str, str]  # input name -> upstream stage name
    input_keys: dict[str, str]  # input name -> upstream key
    key: str

    @property
    def code_version(self) -> str:
        return r.STAGE_KINDS[self.kind].code_version


class Plan(BaseModel):
    """Stages in an order where every input comes first; and what was left out, and why."""

    model_config = ConfigDict(frozen=True)

    stages: dict[str, PlannedStage]
    skipped: dict[str, str] = {}

    def of_kind(self, kind: str) -> list[PlannedStage]:
        return [s for s in self.stages.values() if s.kind == kind]

    def resolve(self, target: str) -> list[str]:
        """Stage names a target means: a stage's own name, or a kind's target (all its stages)."""
        if target in self.stages:
            return [target]
        kinds = {k.name for k in r.STAGE_KINDS.values() if k.target == target}
        names = [s.name for s in self.stages.values() if s.kind in kinds]
        if not names:
            present = {s.kind for s in self.stages.values()}  # targets this pipeline has a stage of
            valid = sorted({*(k.target for k in r.STAGE_KINDS.values() if k.name in present), *self.stages})
            why = (f" ({self.skipped[target]})" if target in self.skipped else
                   " (the config has no section that plans it)" if target in r.targets() else "")
            near = difflib.get_close_matches(target, valid, n=1, cutoff=0.75) if not why else []
            raise ConfigError(f"no stage {target!r} in this pipeline{why}; "
                              + (f"did you mean {near[0]!r}? " if near else "") + f"valid: {', '.join(valid)}")
        return names

    def upto(self, target: str) -> Plan:
        """The target's stages and everything they need, in order."""
        needed: set[str] = set()
        todo = self.resolve(target)
        while todo:
            name = todo.pop()
            if name not in needed:
                needed.add(name)
                todo.extend(self.stages[name].inputs.values())
        return Plan(stages={n: s for n, s in self.stages.items() if n in needed}, skipped=self.skipped)


class _Builder:
    def __init__(self) -> None:
        self.stages: dict[str, PlannedStage] = {}
        self.skipped: dict[str, str] = {}

    def add(self, name: str, kind: str, config: Section, external: dict[str, str] | None = None,
            **inputs: str | None) -> str:
        """`external`: config field -> fingerprint of what it names (files, models, code)."""
        wired = {k: v for k, v in inputs.items() if v is not None}
        input_keys = {k: self.stages[v].key for k, v in wired.items()} | (external or {})
        declared = r.STAGE_KINDS[kind]
        if not isinstance(config, declared.config):
            raise TypeError(f"{name}: config is {type(config).__name__}, kind {kind} takes {declared.config.__name__}")
        key = content_key(name, cache_relevant(config), input_keys, declared.code_version)
        self.stages[name] = PlannedStage(name=name, kind=kind, config=config, inputs=wired,
                                         input_keys=input_keys, key=key)
        return name


def plan_pipeline(cfg: PipelineConfig) -> Plan:
    """The graph of `cfg`: every stage that runs, with its inputs and key."""
    io = r.ModelIO(dtype=cfg.model.dtype, attn_implementation=cfg.model.attn_implementation)
    b = _Builder()

    def seed(stage: str) -> int:
        return derive_seed(cfg.seed, stage)

    prints = Fingerprints(cfg.infra.storage.cache_dir)
    base = b.add("base_model", "base_model", r.BaseModelStage(model=cfg.model, seed=seed("base_model")),
                 external={} if cfg.model.base == "tiny" else {"model.base": prints.of(cfg.model.base)})
    data = b.add("data", "data", r.DataStage(data=cfg.data.without_process(), seed=seed("data")), model=base,
                 external={f: prints.of(p) for f, p in cfg.data.sources().items() if f != "data.process.path"})
    reference = base
    if cfg.sft is not None:
        reference = b.add("sft", "sft", r.SFTStage(train=cfg.sft, io=io, seed=seed("sft")), data=data, init=base)
    else:
        b.skipped["sft"] = "the config has no sft section: rounds start from the base model"
    reward = None
    if cfg.trains_reward_model:
        reward = b.add("reward_model", "reward_model",
                       r.RewardModelStage(train=cfg.reward_model, io=io, seed=seed("reward_model")),
                       data=data, init=reference)
    else:
        b.skipped["reward_model"] = ("the config has no reward_model section" if cfg.reward_model is None else
                                     "no round scores with it or starts a critic from it")

    process_reward = None
    if cfg.process_reward_model is not None:  # opt-in: not "skipped" without it
        d = cfg.data
        files = d.source == "files"
        steps_data = b.add("process_data", "process_data", r.ProcessDataStage(
            process=d.process if files else None, synthetic=None if files else d.synthetic, seed=seed("data"),
            max_prompt_tokens=d.max_prompt_tokens, max_response_tokens=d.max_response_tokens), model=base,
            external={"data.process.path": prints.of(d.process.path)} if files else {})
        process_reward = b.add("process_reward_model", "process_reward_model", r.ProcessRewardModelStage(
            train=cfg.process_reward_model, io=io, seed=seed("process_reward_model")), data=steps_data,
            init=reference)

    judge = None
    if cfg.judge is not None:
        judge = b.add("judge", "judge", r.JudgeStage(train=cfg.judge, io=io, seed=seed("judge")), data=data,
                      init=reference)  # opt-in, like the preference stage: not "skipped" without it

    def user_model(name: str, field: str, path: str, revision: str | None) -> str:
        """A model the config names by path (a teacher, a judge), at `revision` where it is a hub id,
        committed by a base_model stage of its own."""
        return b.add(name, "base_model", r.BaseModelStage(model=cfg.model.model_copy(update={"base": path,
                                                                                             "revision": revision}),
                                                          seed=seed(name)), external={field: prints.of(path)})

    policies = {"base": base, **({"sft": reference} if reference != base else {})}  # label -> stage
    if cfg.preference is not None:
        pref = cfg.preference
        if pref.loss in REFERENCE_FREE:
            scored = None
            b.skipped["preference_reference"] = f"preference.loss {pref.loss} has no reference model"
        else:
            scored = b.add("preference_reference", "preference_reference", r.PreferenceReferenceStage(
                io=io, placement=pref.reference_placement, micro_batch_size=pref.reference_micro_batch_size),
                data=data, reference=reference)
        start = b.add("preference", "preference", r.PreferenceStage(train=pref, io=io, seed=seed("preference")),
                      data=data, init=reference, reference=scored)
        policies[pref.loss] = start
    else:  # opt-in, like the rounds: not "skipped"
        start = reference
    # Rounds start from the preference policy where there is one (or `start_from`), and keep it as their KL
    # reference (or `reference`); evaluation measures every policy's KL to SFT (or the base model).
    policy = start
    for i, round_cfg in enumerate(cfg.rounds, start=1):
        spec = round_cfg.spec
        if round_cfg.start_from:
            policy = policies[round_cfg.start_from]
        teacher = round_cfg.teacher and (policies.get(round_cfg.teacher)
                                         or user_model(f"teacher_{i}", f"rounds.{i - 1}.teacher", round_cfg.teacher,
                                                       round_cfg.teacher_revision))
        judged = round_cfg.reward.judge.model
        round_judge = None if not round_cfg.reward.uses_judge else judge if judged is None else user_model(
            f"judge_model_{i}", f"rounds.{i - 1}.reward.judge.model", judged, round_cfg.reward.judge.revision)
        external = {k: v for field, c in round_cfg.reward.source_fields(f"rounds.{i - 1}.reward") if c.source == "rule"
                    for k, v in _code(f"{field}.rule", c.rule, prints).items()}
        external |= _environment_code(f"rounds.{i - 1}.environment", round_cfg.environment, prints)
        stepwise = round_cfg.reward.uses_process_model
        policy = b.add(f"round_{i}", "rl_round",
                       r.RoundStage(round=round_cfg.resolved(), io=io, seed=seed(f"round_{i}"),
                                    step_separator=cfg.data.step_separator() if stepwise else None),
                       external=external, data=data, policy=policy,
                       reference=policies[cfg.reference_of(i - 1)] if spec.reference else None, teacher=teacher,
                       judge=round_judge,
                       reward=reward if round_cfg.needs_reward_model else None,
                       process_reward=process_reward if stepwise else None)
        policies[policy] = policy

    if cfg.distill is not None:  # after the rounds: its teacher may be one
        d = cfg.distill
        teacher = policies.get(d.teacher) or user_model("distill_teacher_model", "distill.teacher", d.teacher,
                                                        d.teacher_revision)
        cached = b.add("distill_teacher", "distill_teacher", r.DistillTeacherStage(
            io=io, top_k=d.top_k, placement=d.placement, scoring_micro_batch_size=d.micro_batch_size,
            scoring_micro_batch_tokens=d.micro_batch_tokens), data=data, student=reference, teacher=teacher)
        policies["distill"] = b.add("distill", "offline_distill", r.OfflineDistillStage(
            train=d, io=io, seed=seed("distill")), data=data, init=reference, teacher=cached)

    if cfg.evaluation is None:
        b.skipped["evaluation"] = "the config has no evaluation section"
    else:
        eval_cfg = r.PolicyEvalStage(evaluation=cfg.evaluation, io=io, seed=seed("evaluation"))
        checker = _code("evaluation.checker", cfg.evaluation.checker, prints) | _environment_code(
            "evaluation.environment", cfg.evaluation.environment, prints) | (
            _code("evaluation.vote_on", cfg.evaluation.vote_on, prints) if cfg.evaluation.vote_on else {})
        for label, name in policies.items():
            b.add(f"eval_{label}", "evaluate_policy", eval_cfg, external=checker, data=data, policy=name,
                  reference=reference, reward=reward)
        if judge:
            e = cfg.evaluation.generation
            b.add("eval_judge", "evaluate_judge", r.JudgeEvalStage(
                judge=JudgeRewardConfig(template=cfg.judge.template, generation=JudgeGeneration(
                    backend=e.backend, placement=e.placement, vllm=e.vllm)), io=io, seed=seed("eval_judge")),
                  data=data, judge=judge)
        if reward:
            b.add("eval_reward_model", "evaluate_reward_model", r.RewardModelEvalStage(
                io=io, scorer_placement=cfg.evaluation.scorer_placement,
                scoring_micro_batch_size=cfg.evaluation.micro_batch_size, rm_margin_bins=cfg.evaluation.rm_margin_bins),
                  data=data, reward=reward)
        if process_reward:
            b.add("eval_process_reward_model", "evaluate_process_reward_model", r.ProcessRewardModelEvalStage(
                io=io, scorer_placement=cfg.evaluation.scorer_placement,
                scoring_micro_batch_size=cfg.evaluation.micro_batch_size), data=steps_data,
                process_reward=process_reward)
    prints.save()
    return Plan(stages=b.stages, skipped=b.skipped)


def _code(field: str, import_path: str, prints: Fingerprints) -> dict[str, str]:
    """The source of a `module:function` the config names (a rule reward, the eval checker and vote), so
    editing it reruns the stages that call it."""
    source = module_source(import_path.split(":", 1)[0])
    return {field: prints.of(source) if source else "module-not-found"}


def _environment_code(field: str, env: EnvironmentConfig | None, prints: Fingerprints) -> dict[str, str]:
    """The user's environment class or agent function, as `_code`: editing an environment's rewards
    reruns its rounds and evaluations. (A bundled environment is alignflow's code.)"""
    if env is None:
        return {}
    if env.agent:
        return _code(f"{field}.agent", env.agent, prints)
    return _code(f"{field}.name", env.name, prints) if ":" in (env.name or "") else {}
