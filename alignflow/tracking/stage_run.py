"""Logging into one stage's child run (alignflow/tracking/runs.py opens it), and the history a resumed stage
takes over from the run it resumes.

A stage stopped at step S and run again by a new pipeline run (`alignflow run` after Ctrl-C, a kill, a lost
node) resumes from its checkpoint in a child run of the new parent, which would hold steps S+1.. only: its
curve, and the MLflow UI's, would start at S. `take_history` copies steps 1..S from the run it resumes (the
newest unfinished run of the same stage and key, under any parent). A retry of the same Prefect flow run
continues the stage's own run instead (runs.py), which has them.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("alignflow")

MAX_BATCH = 1000  # metrics in one log_batch (MLflow's limit)
STEP_METRIC = "progress/step"  # what every stage logs with each step (the CLI's progress display)


def quotable(*values: str) -> bool:
    """Whether every value can stand quoted in an MLflow search filter as it is (letters, digits, _ . -)."""
    return all(re.fullmatch(r"[\w.-]+", v) for v in values)


class StageRun:
    """Logging into one stage's child run."""

    def __init__(self, client, run_id: str):
        self.client = client
        self.run_id = run_id

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = "curves") -> None:
        self.client.log_artifact(self.run_id, str(local_path), artifact_path)

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, obj, artifact_file)

    def set_tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value)

    def take_history(self, upto: int) -> int:
        """A run that logged no step yet, of a stage resuming at step `upto`: the points of steps 1..`upto` of
        the run it resumes, copied in (tagged `alignflow.history_from`); the number copied. 0 where this run
        has steps of its own (a retry continuing it) or no earlier run of its stage and key is found."""
        from mlflow.entities import Metric

        run = self.client.get_run(self.run_id)
        tags = run.data.tags
        key, stage = tags.get("alignflow.key", ""), tags.get("alignflow.stage", "")
        if upto < 1 or STEP_METRIC in run.data.metrics or not quotable(key, stage):
            return 0
        earlier = [r for r in self.client.search_runs(
            [run.info.experiment_id], f"tags.`alignflow.key` = '{key}' and tags.`alignflow.stage` = '{stage}'",
            order_by=["attributes.start_time DESC"], max_results=20)
            if r.info.run_id != self.run_id and r.info.status != "FINISHED" and STEP_METRIC in r.data.metrics
            and (r.info.start_time or 0) <= (run.info.start_time or 0)]
        if not earlier:
            return 0
        source = earlier[0]
        newest: dict[tuple[str, int], Any] = {}  # a source retried in place has steps run twice: the later
        for name in source.data.metrics:
            for m in sorted(self.client.get_metric_history(source.info.run_id, name), key=lambda m: m.timestamp):
                if 1 <= m.step <= upto:
                    newest[(m.key, m.step)] = m
        # progress/step last: a copy cut short by an error leaves this run without it, so a retry copies again
        points = [Metric(m.key, m.value, m.timestamp, m.step)
                  for m in sorted(newest.values(), key=lambda m: (m.key == STEP_METRIC, m.key, m.step))]
        for start in range(0, len(points), MAX_BATCH):
            self.client.log_batch(self.run_id, metrics=points[start:start + MAX_BATCH])
        self.set_tag("alignflow.history_from", source.info.run_id)
        log.info("%s: steps 1-%d of its curve taken from MLflow run %s, the run it resumes", stage, upto,
                 source.info.run_id)
        return len(points)
