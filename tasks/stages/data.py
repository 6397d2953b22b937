"""prepare_data: the bundled synthetic task or user data, as canonical JSONL splits."""

from __future__ import annotations

import collections
import json
import logging
import random
from dataclasses import dataclass

from alignflow.config import DataConfig
from alignflow.errors import ConfigError, DataError
from alignflow.data import agent_task, load, stepwise_task, synthetic
from alignflow.records import StageResult
from alignflow.seeds import derive_seed
from tasks.context import RunContext, StageOutput, compute_stage
from tasks.plan import PlannedStage
from tasks.registry import DataInputs, DataStage, ProcessDataStage

log = logging.getLogger("alignflow")

SPLITS = ("sft", "preference", "preference_unpaired", "prompts", "eval", "eval_preference")


def build_splits(cfg: DataConfig, seed: int) -> tuple[dict[str, list[dict]], dict[str, int]]:
    """All splits, and what was counted on the way (metric name under data/ -> count: pairs left out, eval
    prompts also trained on); user data is validated row by row before anything trains."""
    if cfg.source == "synthetic":
        task = agent_task if cfg.synthetic.task == "boxes" else synthetic
        return {**task.generate(cfg.synthetic, seed), "preference_unpaired": []}, {}
    # No preference file (a pipeline with nothing that reads pairs: alignflow/config/pipeline.py checks): no pairs.
    preference = load.load_records(cfg.preference, "preference") if cfg.preference is not None else []
    pairs = [r for r in preference if "label" not in r]
    # A pair whose two replies are the same text teaches nothing (DPO's gradient and a reward model's margin
    # are zero on it) and is a miss in held-out accuracy: Anthropic HH holds some. They are left out, counted.
    ties = sum(r["chosen"] == r["rejected"] for r in pairs)
    if ties:
        log.warning("%s: %d of %d preference pairs have the same chosen and rejected reply; they are left out",
                    cfg.preference.path, ties, len(pairs))
        if ties == len(pairs):
            raise DataError(f"{cfg.preference.path}: every preference pair ({ties}) has the same chosen and "
                            "rejected reply")
    splits = {
        "sft": load.load_records(cfg.sft, "sft"),
        # Unpaired rows (data.preference.label_key) are KTO's; pairs serve every preference stage.
        "preference": [r for r in pairs if r["chosen"] != r["rejected"]],
        "preference_unpaired": [r for r in preference if "label" in r],
        "eval": load.load_records(cfg.eval, "prompts"),
    }
    # RL prompts: their own source, else the SFT prompts (never the held-out
    # eval prompts). Without answers a rule reward gets answer=None.
    splits["prompts"] = (load.load_records(cfg.prompts, "prompts") if cfg.prompts
                         else [{"prompt": r["prompt"], "answer": None, **{k: r[k] for k in ("tools",) if k in r}}
                               for r in splits["sft"]])
    splits["preference"], splits["eval_preference"] = held_out_pairs(splits["preference"], seed)
    return splits, {"preference_ties_left_out": ties, "eval_prompts_in_training": seen_in_training(splits)}


def seen_in_training(splits: dict[str, list[dict]]) -> int:
    """Held-out eval prompts that a training split holds too (SFT, RL prompts, preference pairs or examples):
    counted and said, since their accuracy is partly recall. Not removed: the split is the user's. A prompt is
    what the policy is shown: its text (or messages) and its tools; other columns (an id, a level, a
    solution) are not compared. The bundled tasks build their splits apart and are not checked (the boxes
    task asks one question of different boxes: the same text, another episode)."""
    def key(record: dict) -> str:
        return json.dumps([record["prompt"], record.get("tools")], sort_keys=True, default=str)

    trained = {key(r) for name in ("sft", "prompts", "preference", "preference_unpaired") for r in splits[name]}
    seen = [i for i, r in enumerate(splits["eval"], start=1) if key(r) in trained]
    if seen:
        log.warning("data.eval: %d of %d prompts are in a training split too (the first: eval rows %s); their "
                    "accuracy measures recall as much as skill", len(seen), len(splits["eval"]), seen[:5])
    return len(seen)


def held_out_pairs(pairs: list[dict], seed: int, split: str = "preference") -> tuple[list[dict], list[dict]]:
    """(trained, held out): the pairs of about 10 % of the prompts, drawn by the seed, held out for the reward
    model's accuracy; both keep the file's order. By prompt, so that no held-out prompt was trained on (HH and
    SHP hold several pairs per prompt, side by side), and drawn, so that a file sorted by source holds out
    every source. A prompt whose pairs would take the hold-out past twice its 10 % is passed over (a few
    prompts of many pairs each would take half the data). Where no prompt fits (one prompt, or a few of many
    pairs each), the last 10 % of the pairs are held out, and the prompts they share with training are said."""
    keys = [json.dumps(r["prompt"], sort_keys=True) for r in pairs]
    sizes = collections.Counter(keys)
    prompts = list(sizes)
    random.Random(derive_seed(seed, f"eval_{split}")).shuffle(prompts)
    what = "pairs" if split == "preference" else "rows"
    budget = load.held_out_count(len(pairs))
    held, count = set(), 0
    for prompt in prompts[:-1]:  # one prompt at least is trained on
        if count >= budget:
            break
        if count + sizes[prompt] <= 2 * budget:
            held.add(prompt)
            count += sizes[prompt]
    if held:
        return [r for r, k in zip(pairs, keys) if k not in held], [r for r, k in zip(pairs, keys) if k in held]
    if len(pairs) == 1:
        log.warning("data.%s holds one %s: it is both trained on and held out, so its held-out accuracy is its "
                    "training accuracy", split, what[:-1])
        return pairs, pairs
    if pairs:
        log.warning("data.%s's %d %s have %d prompt(s), none of whose %s fit a 10 %% hold-out: the last 10 %% of "
                    "the %s are held out, and their prompts are trained on too", split, len(pairs), what, len(sizes),
                    what, what)
    n_held = load.held_out_count(len(pairs))
    return pairs[: len(pairs) - n_held], pairs[len(pairs) - n_held:]


def prepare_data(stage: PlannedStage, inputs: DataInputs, ctx: RunContext) -> StageResult:
    cfg: DataStage = stage.config

    def compute(output: StageOutput, run) -> dict[str, float]:
        from engines import lengths, models

        out = output.dir
        splits, counted = build_splits(cfg.data, cfg.seed)
        model_dir = ctx.tokenizer_dir(inputs.model)
        measured = lengths.measure(models.load_tokenizer(model_dir), splits)
        limits = lengths.resolve(cfg.data, measured, models.max_positions(model_dir))
        for line in lengths.describe(measured, limits):
            log.info("%s", line)
        metrics = _written(out, {name: splits[name] for name in SPLITS}, measured, limits)
        metrics |= {f"data/{name}": float(n) for name, n in counted.items()}
        run.log_metrics(metrics)
        return metrics

    return compute_stage(ctx, stage, compute)


def _written(out, splits: dict[str, list[dict]], measured, limits) -> dict[str, float]:
    """Each split as JSONL under `out`; the metrics of their rows, token lengths and limits."""
    for name, records in splits.items():
        load.write_jsonl(records, str(out / f"{name}.jsonl"))
    metrics = {f"data/{name}_rows": float(len(records)) for name, records in splits.items()}
    metrics.update({f"data/{name}_{k}": float(v) for name, m in measured.items() for k, v in m.stats().items()})
    return metrics | limits.metrics()


def step_labelled(cfg: ProcessDataStage) -> list[dict]:
    """A process reward model's solutions: data.process's rows, or the bundled task's (on prompts none of its
    other splits holds)."""
    if cfg.process is not None:
        return load.load_records(cfg.process, "process")
    return stepwise_task.solutions(cfg.synthetic, cfg.seed, synthetic.generate(cfg.synthetic, cfg.seed))


def prepare_process_data(stage: PlannedStage, inputs: DataInputs, ctx: RunContext) -> StageResult:
    """The step-labelled solutions, about 10 % of their prompts held out (eval_process), measured in tokens with
    limits of their own: a stage apart from `data`, so that adding a process reward model to a pipeline leaves
    every other stage's key as it was."""
    cfg: ProcessDataStage = stage.config

    def compute(output: StageOutput, run) -> dict[str, float]:
        from engines import lengths, models

        splits = dict(zip(lengths.STEP_SPLITS, held_out_pairs(step_labelled(cfg), cfg.seed, split="process")))
        model_dir = ctx.tokenizer_dir(inputs.model)
        measured = lengths.measure(models.load_tokenizer(model_dir), splits)
        bounds = DataConfig(max_prompt_tokens=cfg.max_prompt_tokens, max_response_tokens=cfg.max_response_tokens)
        limits = lengths.resolve(bounds, measured, models.max_positions(model_dir))
        for line in lengths.describe(measured, limits):
            log.info("%s", line)
        metrics = _written(output.dir, splits, measured, limits)
        run.log_metrics(metrics)
        return metrics

    return compute_stage(ctx, stage, compute)


@dataclass(frozen=True)
class TokenLimits:
    prompt: int
    response: int

    def for_generation(self, max_new_tokens: int, model_path: str, where: str,
                       field: str = "generation.max_new_tokens", schemas: int = 0) -> tuple[int, int]:
        """(prompt limit, vLLM max_model_len) for generating `max_new_tokens` after each prompt (`field` names
        the setting: an episode's tokens are environment.max_episode_tokens). `schemas`: the tokens an
        environment's tool schemas add to every prompt the data stage measured (agentic.py episode_prompts),
        on top of its limit.

        Prompts longer than the model's positions leave room for are left out
        (counted by the caller's filter, with a warning here); none fitting is
        a ConfigError. Preflight rejects an explicit data.max_prompt_tokens
        that cannot fit; with `auto` the data's longest prompt may not.
        """
        from engines.models import max_positions

        positions = max_positions(model_path)
        wanted = self.prompt + schemas
        prompt = min(wanted, positions - max_new_tokens)
        if prompt < 1:
            raise ConfigError(f"{where}{field}={max_new_tokens} leaves no room for a prompt: "
                              f"the model has {positions} positions")
        if schemas:
            log.info("%sprompts take up to %d tokens: the data's %d and the environment's tool schemas' %d",
                     where, wanted, self.prompt, schemas)
        if prompt < wanted:
            log.warning("%s%s=%d: prompts over %d tokens (of up to %d) are left out; the model has %d positions",
                        where, field, max_new_tokens, prompt, wanted, positions)
        return prompt, prompt + max_new_tokens


def token_limits(data: StageResult) -> TokenLimits:
    """The prompt and response limits the data stage settled (engines/lengths.py)."""
    return TokenLimits(int(data.metrics["data/max_prompt_tokens"]), int(data.metrics["data/max_response_tokens"]))


def load_split(data: StageResult, ctx: RunContext, name: str) -> list[dict]:
    return load.read_jsonl(str(ctx.storage().fetch(ctx.uri(data)) / f"{name}.jsonl"))
