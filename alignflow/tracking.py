"""MLflow tracking: one parent run per pipeline run, one child run per stage.

Stages run in Ray workers, so a child run is opened by id (`parent_run_id`)
rather than through MLflow's thread-local active-run stack. Stage configs
become params, flattened with dotted names; anything that looks like a
credential is dropped first, and URIs lose their userinfo.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

# `token` but not `tokens`/`tokenizer`: max_new_tokens etc. are settings, not credentials.
_SECRET = re.compile(r"(secret|password|passwd|token(?!s|izer)|credential|access_key|api_key|private)", re.I)


def _scrub_value(value: Any) -> Any:
    """Strip `user:pass@` from URI-like strings."""
    if isinstance(value, str) and "://" in value and "@" in value:
        parts = urlsplit(value)
        if parts.username or parts.password:
            host = parts.hostname or ""
            if parts.port:
                host = f"{host}:{parts.port}"
            return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
    return value


def flatten_params(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config -> {"a.b": value}, without credential-like keys."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if _SECRET.search(str(key)):
            continue
        if isinstance(value, Mapping):
            out.update(flatten_params(value, prefix=f"{name}."))
        elif isinstance(value, (list, tuple)):
            out[name] = json.dumps(value)[:500]
        else:
            out[name] = _scrub_value(value)
    return out


class Tracker:
    """Thin handle on one MLflow tracking server / SQLite file and experiment."""

    def __init__(self, tracking_uri: str, experiment: str):
        import mlflow

        self._mlflow = mlflow
        mlflow.set_tracking_uri(tracking_uri)
        self.tracking_uri = tracking_uri
        self.experiment_id = mlflow.set_experiment(experiment).experiment_id

    def start_parent(self, run_name: str, params: Mapping[str, Any], tags: Mapping[str, str] | None = None) -> str:
        client = self._mlflow.MlflowClient()
        run = client.create_run(self.experiment_id, run_name=run_name, tags=dict(tags or {}))
        self._log_params(run.info.run_id, params)
        return run.info.run_id

    def finish(self, run_id: str, status: str = "FINISHED") -> None:
        self._mlflow.MlflowClient().set_terminated(run_id, status=status)

    def run(self, run_id: str) -> StageRun:
        """Logging into an existing run (e.g. the pipeline's parent run)."""
        return StageRun(self._mlflow.MlflowClient(), run_id)

    @contextlib.contextmanager
    def stage_run(
        self, parent_run_id: str | None, stage: str, params: Mapping[str, Any], tags: Mapping[str, str] | None = None
    ) -> Iterator[StageRun]:
        """A child run of the pipeline's parent run (or a top-level run)."""
        client = self._mlflow.MlflowClient()
        all_tags = {"alignflow.stage": stage, **(tags or {})}
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        run = client.create_run(self.experiment_id, run_name=stage, tags=all_tags)
        run_id = run.info.run_id
        self._log_params(run_id, params)
        status = "FAILED"
        try:
            yield StageRun(client, run_id)
            status = "FINISHED"
        finally:
            client.set_terminated(run_id, status=status)

    def _log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        flat = flatten_params(params)
        batch = [Param(k, str(v)[:6000]) for k, v in flat.items()]
        client = self._mlflow.MlflowClient()
        for i in range(0, len(batch), 100):
            client.log_batch(run_id, params=batch[i : i + 100])


class StageRun:
    """Logging into one stage's child run."""

    def __init__(self, client, run_id: str):
        self.client = client
        self.run_id = run_id

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        from mlflow.entities import Metric
        import time

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, obj, artifact_file)

    def set_tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value)
