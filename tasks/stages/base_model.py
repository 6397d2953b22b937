"""base_model: the tiny local model, or a user's HF model, committed to storage."""

from __future__ import annotations

import logging
import shutil

from alignflow.data import agent_task
from alignflow.errors import ConfigError
from alignflow.records import StageResult
from alignflow.store.storage import is_local_uri, local_path
from engines import models
from tasks.context import RunContext, StageOutput, compute_stage
from tasks.plan import PlannedStage
from tasks.registry import BaseModelStage, NoInputs

log = logging.getLogger("alignflow")
PICKLES = ("*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt")  # never committed: checkpoints are safetensors


def base_model(stage: PlannedStage, inputs: NoInputs, ctx: RunContext) -> StageResult:
    cfg: BaseModelStage = stage.config
    model = cfg.model

    # As preflight and the plan's fingerprint read it: a path (~ and file:// too) that is a directory, else a hub id.
    local = local_path(model.base) if is_local_uri(model.base) else None

    def compute(output: StageOutput, run) -> dict[str, float]:
        out = output.dir
        if model.base == "tiny":
            corpus = agent_task.tokenizer_corpus() if model.tiny.corpus == "boxes" else None  # None: the default's
            models.build_tiny_model(model.tiny, cfg.seed, out, corpus)
        elif local is not None and local.is_dir():
            if model.revision is not None:  # preflight says so first; a stage run alone checks here
                raise ConfigError(f"model.revision {model.revision!r} names a hub model's branch, tag or commit, "
                                  f"but model.base {model.base} is a local directory")
            say_padding(str(local))
            if any(local.glob("*.safetensors")):  # pickled weights beside them are left behind
                shutil.copytree(local, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(*PICKLES))
            else:  # pickled weights only (pytorch_model.bin): read by torch's weights-only unpickler, then saved
                log.info("model.base %s holds pickled weights: committed as safetensors", model.base)
                models.save_pretrained(models.load_policy(local, model.dtype), models.load_tokenizer(local), out)
        else:  # a hub id, where a hub is reachable (or its cache holds it), at model.revision
            say_padding(model.base, model.revision)
            models.save_pretrained(models.load_policy(model.base, model.dtype, revision=model.revision),
                                   models.load_tokenizer(model.base, model.revision), out)
        n_params = sum(p.numel() for p in models.load_policy(out).parameters())
        metrics = {"model/parameters": float(n_params)}
        run.log_metrics(metrics)
        return metrics

    return compute_stage(ctx, stage, compute)


def say_padding(base: str, revision: str | None = None) -> None:
    """Say once, where a user's model enters the run (a directory, or a hub id at `revision`), what every later
    stage does silently (`models.load_tokenizer`, which a hub model is saved through): a tokenizer without a pad
    token pads with its EOS token. One with neither is refused before the model is copied."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base, revision=revision)
    if tok.pad_token is None and tok.eos_token is None:
        raise ConfigError(f"model.base {base}: its tokenizer has neither a pad token nor an EOS token; the run needs "
                          f"one to pad batches and end responses (set pad_token in its tokenizer_config.json)")
    if tok.pad_token is None:
        log.warning("model.base %s: its tokenizer has no pad token, so the run pads with its EOS token %r (id %s); "
                    "padding is masked out of every loss, and an EOS the model writes still ends its response",
                    base, tok.eos_token, tok.eos_token_id)
