"""prepare_data: the bundled synthetic task or user data, as canonical JSONL splits."""

from __future__ import annotations

from pathlib import Path

from alignflow.config import DataConfig
from alignflow.data import formats, synthetic
from alignflow.records import StageResult
from tasks.context import RunContext, compute_stage
from tasks.plan import PlannedStage
from tasks.registry import DataStage, NoInputs

SPLITS = ("sft", "preference", "prompts", "eval", "eval_preference")


def build_splits(cfg: DataConfig, seed: int) -> dict[str, list[dict]]:
    """All splits; user data is validated row by row before anything trains."""
    if cfg.source == "synthetic":
        return synthetic.generate(cfg.synthetic, seed)
    splits = {
        "sft": formats.load_records(cfg.sft, "sft"),
        "preference": formats.load_records(cfg.preference, "preference"),
        "eval": formats.load_records(cfg.eval, "prompts"),
    }
    # RL prompts: their own source, else the SFT prompts (never the held-out
    # eval prompts). Without answers a rule reward gets answer=None.
    splits["prompts"] = (formats.load_records(cfg.prompts, "prompts") if cfg.prompts
                         else [{"prompt": r["prompt"], "answer": None} for r in splits["sft"]])
    # Held-out pairs for reward-model accuracy: the last 10% of the pairs.
    n_held = max(1, len(splits["preference"]) // 10)
    splits["eval_preference"] = splits["preference"][-n_held:]
    splits["preference"] = splits["preference"][:-n_held] or splits["eval_preference"]
    return splits


def prepare_data(stage: PlannedStage, inputs: NoInputs, ctx: RunContext) -> StageResult:
    cfg: DataStage = stage.config

    def compute(out: Path, run, uri: str) -> dict[str, float]:
        splits = build_splits(cfg.data, cfg.seed)
        for name in SPLITS:
            formats.write_jsonl(splits[name], str(out / f"{name}.jsonl"))
        metrics = {f"data/{name}_rows": float(len(splits[name])) for name in SPLITS}
        run.log_metrics(metrics)
        return metrics

    return compute_stage(ctx, stage, compute)


def load_split(data: StageResult, ctx: RunContext, name: str) -> list[dict]:
    return formats.read_jsonl(str(ctx.storage().fetch(data.uri) / f"{name}.jsonl"))
