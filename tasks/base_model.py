"""base_model: the tiny local model, or a user's HF model, committed to storage."""

from __future__ import annotations

import shutil
from pathlib import Path


from alignflow.config import ModelConfig
from alignflow.records import StageResult
from engines import models
from tasks.context import RunContext, compute_stage, stage_task

STAGE = "base_model"
CODE_VERSION = "2"  # 2: tokenizer trained with Qwen2 splitting (loads back identically)


def base_model(cfg: ModelConfig, key: str, ctx: RunContext) -> StageResult:
    def compute(out: Path, run, uri: str) -> dict[str, float]:
        if cfg.base == "tiny":
            models.build_tiny_model(cfg.tiny, cfg.seed, out)
        elif Path(cfg.base).is_dir():
            shutil.copytree(cfg.base, out, dirs_exist_ok=True)
        else:  # a hub id, where a hub is reachable
            models.save_pretrained(models.load_policy(cfg.base, cfg.dtype), models.load_tokenizer(cfg.base), out)
        n_params = sum(p.numel() for p in models.load_policy(out).parameters())
        metrics = {"model/parameters": float(n_params)}
        run.log_metrics(metrics)
        return metrics

    return compute_stage(ctx, stage=STAGE, key=key, params=cfg.model_dump(mode="json"), compute=compute)


base_model_task = stage_task(base_model, name="base_model")
