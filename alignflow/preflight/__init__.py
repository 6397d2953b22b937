"""Preflight: what a run needs outside its config, checked in seconds before Prefect or Ray start
(`alignflow validate`, and the start of `run` / `stage`):

    models.py    model.base, a distillation round's teacher and a judge load; explicit lengths, episodes and a
                 judge engine's max_model_len fit their model's positions; LoRA targets name layers it can adapt;
                 DFT is refused on a freshly built tiny model
    rewards.py   rule rewards, the checker and environments (with their tools' schemas) import and take the
                 arguments they are given; remote reward services answer
    stores.py    the storage root, and a SQLite tracking file's directory, take a probe; on a Ray cluster, the
                 local paths a run reads and writes are said
    alignflow/data/checks.py   data files exist and every row of a local one parses (of a remote one, the
                 first `data.preflight_rows`)
    unused.py    settings nothing reads (a critic under GRPO, vLLM's under backend hf) are said
    slots.py     a local Ray can place each stage

Every problem is collected, naming its field and where its value came from (the file, or a
command-line override), into one ConfigError. Heavy imports (transformers) stay inside checks.
"""

from __future__ import annotations

import sys
from pathlib import Path

from alignflow.config import PipelineConfig
from alignflow.config.loading import ConfigSources, config_sources
from alignflow.data.checks import check_files
from alignflow.errors import ConfigError
from alignflow.preflight.findings import Findings
from alignflow.preflight.models import check_lengths, check_models
from alignflow.preflight.rewards import check_rewards
from alignflow.preflight.stores import check_storage, check_tracking_store, note_local_paths_on_cluster
from alignflow.preflight.unused import note_unused_settings
from alignflow.preflight.slots import check_slots

__all__ = ["Findings", "check", "preflight"]


def preflight(cfg: PipelineConfig, overrides: list[str] | None = None, config_path: str | Path | None = None,
              sources: ConfigSources | None = None) -> Findings:
    """Run every check on a loaded config (`config_path` and `overrides` as given to load_config, or
    `sources` as config_from_parameter returned them)."""
    found = Findings(sources or config_sources(config_path, overrides))
    positions = check_models(cfg, found)
    check_files(cfg, found)
    if positions is not None:
        check_lengths(cfg, positions, found)
    check_rewards(cfg, found)
    check_storage(cfg, found)
    check_tracking_store(cfg, found)
    note_local_paths_on_cluster(cfg, found)
    note_unused_settings(cfg, found)
    check_slots(cfg, found)
    return found


def check(cfg: PipelineConfig, overrides: list[str] | None = None, config_path: str | Path | None = None,
          sources: ConfigSources | None = None) -> Findings:
    """preflight, raising one ConfigError that lists every problem; else what it found (checks, notes)."""
    found = preflight(cfg, overrides, config_path, sources)
    if n := len(found.problems):
        raise ConfigError(f"preflight found {n} problem{'s' * (n > 1)}:\n  " + "\n  ".join(found.problems))
    for note in found.notes:
        print(f"preflight: {note}", file=sys.stderr)
    return found
