"""MLflow tracking: one parent run per pipeline run, one child run per stage.

Stages run in Ray workers, so a child run is opened by id (`parent_run_id`)
rather than through MLflow's thread-local active-run stack. Stage configs
become params, flattened with dotted names; anything that looks like a
credential is dropped first, and URIs lose their userinfo.

Every run records the process that owns it (`alignflow.pid`,
`alignflow.host`) and is ended by that process: FINISHED, FAILED on an
error, KILLED on an interrupt. A process killed outright (SIGKILL, OOM) ends
nothing, so the next pipeline start marks KILLED every RUNNING run whose
owner on this host is gone; runs owned on other hosts are left alone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from alignflow.interrupts import end_status

log = logging.getLogger("alignflow")

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
        """The pipeline's parent run; runs left RUNNING by dead processes on this host are closed first."""
        self.reap_stale()
        client = self._mlflow.MlflowClient()
        run = client.create_run(self.experiment_id, run_name=run_name, tags={**_owner_tags(), **(tags or {})})
        try:
            self._log_params(run.info.run_id, params)
        except BaseException as exc:
            client.set_terminated(run.info.run_id, status=end_status(exc))
            raise
        return run.info.run_id

    def finish(self, run_id: str, status: str = "FINISHED") -> None:
        self._mlflow.MlflowClient().set_terminated(run_id, status=status)

    def stage_runs(self, parent_run_id: str) -> list[dict[str, Any]]:
        """The stage runs under a parent run, for a progress display: stage, status, step, total steps,
        start/end (ms) and latest metrics."""
        children = reversed(self._search(f"tags.`mlflow.parentRunId` = '{parent_run_id}'"))  # oldest first
        return [{"stage": r.data.tags.get("alignflow.stage", r.info.run_name), "status": r.info.status,
                 "step": int(r.data.metrics.get("progress/step", 0)),
                 "total": int(r.data.tags.get("alignflow.total_steps", 0)), "start": r.info.start_time,
                 "end": r.info.end_time, "metrics": dict(r.data.metrics)} for r in children]

    def stop_children(self, parent_run_id: str) -> list[str]:
        """Mark KILLED the stage runs under `parent_run_id` that are still RUNNING: the pipeline run was
        stopped, and its stages with it (their processes, Ray workers, end with the CLI's Ray and could
        not end their runs themselves)."""
        client = self._mlflow.MlflowClient()
        running = [r.info.run_id for r in self._search(f"tags.`mlflow.parentRunId` = '{parent_run_id}' and "
                                                       "attributes.status = 'RUNNING'")]
        for run_id in running:
            client.set_tag(run_id, "alignflow.end_reason", "the pipeline run was stopped")
            client.set_terminated(run_id, status="KILLED")
        return running

    def reap_stale(self) -> list[str]:
        """Mark KILLED every RUNNING run of the experiment owned by a process on this host that is gone."""
        client = self._mlflow.MlflowClient()
        host = socket.gethostname()
        query = f"attributes.status = 'RUNNING' and tags.`{HOST_TAG}` = '{host}'"
        stale = []
        for run in self._search(query):  # every page first: ending runs while paging would shift the pages
            pid = run.data.tags.get(PID_TAG, "")
            if pid.isdigit() and not pid_alive(int(pid), since=run.info.start_time / 1000):
                stale.append((run.info.run_id, pid))
        for run_id, pid in stale:
            client.set_tag(run_id, "alignflow.end_reason", f"process {pid} on {host} died")
            client.set_terminated(run_id, status="KILLED")
        reaped = [run_id for run_id, _ in stale]
        if reaped:
            log.warning("marked %d MLflow run(s) KILLED: left RUNNING by processes on %s that are gone",
                        len(reaped), host)
        return reaped

    def metric_histories(
        self, parent_run_id: str, stage_keys: Mapping[str, str] | None = None,
        keep: Callable[[str], bool] | None = None,
    ) -> dict[str, dict[str, list[tuple[int, float]]]]:
        """Stage name -> metric key -> [(step, value)] by step, from the stages' child runs.

        A stage with no child run under `parent_run_id` (served from cache) is
        looked up by its content key (`stage_keys`, default the parent's
        `alignflow.key.<stage>` tags): the newest FINISHED run of the
        experiment tagged with that key, whatever its parent. Several child
        runs of one stage (retries) are merged oldest first, so a resumed
        attempt's steps follow the ones its predecessor logged. `keep` picks
        the metric keys to read (default all).
        """
        client = self._mlflow.MlflowClient()
        if stage_keys is None:
            tags = client.get_run(parent_run_id).data.tags
            stage_keys = {k.removeprefix("alignflow.key."): v for k, v in tags.items()
                          if k.startswith("alignflow.key.")}
        runs: dict[str, list[Any]] = {}
        for run in self._search(f"tags.`mlflow.parentRunId` = '{parent_run_id}'"):
            stage = run.data.tags.get("alignflow.stage")
            if stage:
                runs.setdefault(stage, []).append(run)
        for stage, key in stage_keys.items():
            if stage not in runs and re.fullmatch(r"[\w.-]+", key) and re.fullmatch(r"[\w.-]+", stage):
                found = self._search(f"tags.`alignflow.key` = '{key}' and tags.`alignflow.stage` = '{stage}' "
                                     "and attributes.status = 'FINISHED'", limit=1)
                if found:
                    runs[stage] = found
        out: dict[str, dict[str, list[tuple[int, float]]]] = {}
        for stage, attempts in runs.items():
            merged: dict[str, dict[int, float]] = {}
            for run in sorted(attempts, key=lambda r: r.info.start_time or 0):
                for name in run.data.metrics:
                    if keep is None or keep(name):
                        steps = merged.setdefault(name, {})
                        for m in sorted(client.get_metric_history(run.info.run_id, name),
                                        key=lambda m: (m.step, m.timestamp)):
                            steps[m.step] = m.value
            out[stage] = {name: sorted(steps.items()) for name, steps in merged.items()}
        return out

    def _search(self, query: str, limit: int | None = None) -> list[Any]:
        """Runs of the experiment matching `query`, newest first (every page, or the first `limit`)."""
        client = self._mlflow.MlflowClient()
        found, token = [], None
        while True:
            page = client.search_runs([self.experiment_id], filter_string=query,
                                      order_by=["attributes.start_time DESC"],
                                      max_results=min(limit or 1000, 1000), page_token=token)
            found.extend(page)
            token = page.token
            if not token or (limit and len(found) >= limit):
                return found[:limit] if limit else found

    def run(self, run_id: str) -> StageRun:
        """Logging into an existing run (e.g. the pipeline's parent run)."""
        return StageRun(self._mlflow.MlflowClient(), run_id)

    @contextlib.contextmanager
    def stage_run(
        self, parent_run_id: str | None, stage: str, params: Mapping[str, Any], tags: Mapping[str, str] | None = None
    ) -> Iterator[StageRun]:
        """A child run of the pipeline's parent run (or a top-level run)."""
        client = self._mlflow.MlflowClient()
        all_tags = {"alignflow.stage": stage, **_owner_tags(), **(tags or {})}
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        run = client.create_run(self.experiment_id, run_name=stage, tags=all_tags)
        run_id = run.info.run_id
        try:
            self._log_params(run_id, params)
            yield StageRun(client, run_id)
        except BaseException as exc:
            # Best effort: an error here must not replace the one that ends the stage.
            try:
                client.set_terminated(run_id, status=end_status(exc))
            except Exception as err:
                log.warning("could not end MLflow run %s (%s): %s", run_id, end_status(exc), err)
            raise
        client.set_terminated(run_id, status="FINISHED")

    def _log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        flat = flatten_params(params)
        batch = [Param(k, str(v)[:6000]) for k, v in flat.items()]
        client = self._mlflow.MlflowClient()
        for i in range(0, len(batch), 100):
            client.log_batch(run_id, params=batch[i : i + 100])


PID_TAG, HOST_TAG = "alignflow.pid", "alignflow.host"


def _owner_tags() -> dict[str, str]:
    return {PID_TAG: str(os.getpid()), HOST_TAG: socket.gethostname()}


def pid_alive(pid: int, since: float | None = None) -> bool:
    """Whether process `pid` on this host is alive (one of another user counts; a zombie does not).

    With `since` (epoch seconds the run started), a process that started
    later is a reused pid, not the run's owner (Linux; elsewhere not checked).
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (OSError, StopIteration):
        return True
    fields = stat[stat.rindex(")") + 2:].split()
    started = boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    # btime is whole seconds: 2 s of slack before calling the pid reused.
    return fields[0] != "Z" and (since is None or started <= since + 2)


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

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = "curves") -> None:
        self.client.log_artifact(self.run_id, str(local_path), artifact_path)

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, obj, artifact_file)

    def set_tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value)
