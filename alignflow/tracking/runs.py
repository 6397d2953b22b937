"""MLflow tracking: one parent run per pipeline run, one child run per stage.

Stages run in Ray workers, so a child run is opened by id (`parent_run_id`) rather than through MLflow's
thread-local active-run stack. Stage configs become params, flattened with dotted names
(alignflow/tracking/params.py: anything that looks like a credential is dropped first, and URIs lose their userinfo).

Every run records the process that owns it (`alignflow.pid`, `alignflow.host`, and since when) and is
ended by that process: FINISHED, FAILED on an error, KILLED on an interrupt. A process killed outright
(SIGKILL, OOM) ends nothing, so the next pipeline start marks KILLED every RUNNING run whose owner on
this host is gone; runs owned on other hosts are left alone. A retried Prefect flow run continues its
parent run, and a retried stage its stage run (`alignflow.attempt` counts them), under a new owner.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from alignflow.interrupts import end_status, pid_alive
from alignflow.tracking.params import artifact_location, param_values
from alignflow.tracking.stage_run import StageRun, quotable

log = logging.getLogger("alignflow")

class Tracker:
    """Thin handle on one MLflow tracking server / SQLite file and experiment."""

    def __init__(self, tracking_uri: str, experiment: str, artifact_root: str | None = None):
        """`artifact_root`: where a new experiment's artifacts go when the tracking store is a database
        other than a SQLite file (`artifact_location`); see `create_experiment`."""
        import mlflow

        mlflow.set_tracking_uri(tracking_uri)  # for MLflow's own helpers; this tracker's calls name the store
        self._client = mlflow.MlflowClient(tracking_uri)
        self.tracking_uri = tracking_uri
        self.experiment_id = self.create_experiment(experiment, artifact_root)

    def create_experiment(self, name: str, artifact_root: str | None) -> str:
        """The experiment's id; created if new. It is a model-training experiment (MLflow's
        `mlflow.experimentKind` tag), so the UI opens on its runs, not on the GenAI views. Its artifacts
        go beside a SQLite file, or under `artifact_root` for another database; never into the working
        directory, MLflow's default for a database store. A server (http) places them itself."""
        from mlflow.exceptions import MlflowException

        client = self._client
        exp = client.get_experiment_by_name(name)
        if exp is None:
            try:
                return client.create_experiment(name, artifact_location=artifact_location(self.tracking_uri, artifact_root),
                                                tags={EXPERIMENT_KIND_TAG: TRAINING_KIND})
            except MlflowException:  # created meanwhile by another process of the run
                exp = client.get_experiment_by_name(name)
                if exp is None:
                    raise
        if EXPERIMENT_KIND_TAG not in exp.tags:
            client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, TRAINING_KIND)
        return exp.experiment_id

    def start_parent(self, run_name: str, params: Mapping[str, Any], tags: Mapping[str, str] | None = None,
                     reopen_tag: str | None = None) -> str:
        """The pipeline's parent run; runs left RUNNING by dead processes on this host are closed first.

        With `reopen_tag` (a key of `tags`, e.g. the Prefect flow run id), the newest parent run carrying the
        same value is reopened instead of a new one made: a retried flow run keeps its one parent, with every
        stage under it."""
        self.reap_stale()
        client = self._client
        all_tags = {**_owner_tags(), **(tags or {})}
        previous = self._reopenable(reopen_tag, all_tags.get(reopen_tag or "", ""), parent=None)
        if previous is not None:
            return self._reopen(previous, all_tags, params)
        run = client.create_run(self.experiment_id, run_name=run_name, tags=all_tags)
        try:
            self._log_params(run.info.run_id, param_values(params))
        except BaseException as exc:
            client.set_terminated(run.info.run_id, status=end_status(exc))
            raise
        return run.info.run_id

    def _reopenable(self, tag: str | None, value: str, parent: str | None, stage: str | None = None) -> Any:
        """The newest run with `tag` = `value` (under `parent`, of `stage`) to continue, or None."""
        if not tag or not quotable(value):
            return None
        query = f"tags.`{tag}` = '{value}'"
        if parent:
            query += f" and tags.`mlflow.parentRunId` = '{parent}'"
        if stage and quotable(stage):
            query += f" and tags.`alignflow.stage` = '{stage}'"
        found = [r for r in self._search(query, limit=10) if (parent is not None) == ("mlflow.parentRunId" in r.data.tags)]
        return found[0] if found else None

    def _reopen(self, run: Any, tags: Mapping[str, str], params: Mapping[str, Any]) -> str:
        """Continue `run`: RUNNING again, owned by this process, its attempt counted. Params it already
        has keep their first value (MLflow refuses a change); new ones are added, changed ones named in
        a tag."""
        client, run_id = self._client, run.info.run_id
        attempt = int(run.data.tags.get(ATTEMPT_TAG, "1")) + 1
        client.update_run(run_id, status="RUNNING")
        for key, value in {**tags, ATTEMPT_TAG: str(attempt)}.items():
            client.set_tag(run_id, key, value)
        had = run.data.params
        flat = param_values(params)
        if changed := sorted(k for k, v in flat.items() if k in had and had[k] != v):
            client.set_tag(run_id, f"alignflow.params_changed_at_attempt_{attempt}", ", ".join(changed)[:5000])
            log.warning("MLflow run %s continued with %d param(s) changed since its first attempt (%s); it keeps "
                        "the first values", run_id, len(changed), ", ".join(changed[:5]))
        self._log_params(run_id, {k: v for k, v in flat.items() if k not in had})
        log.info("MLflow run %s (%s) continued: attempt %d", run_id, run.info.run_name, attempt)
        return run_id

    def finish(self, run_id: str, status: str = "FINISHED") -> None:
        self._client.set_terminated(run_id, status=status)

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
        client = self._client
        running = [r.info.run_id for r in self._search(f"tags.`mlflow.parentRunId` = '{parent_run_id}' and "
                                                       "attributes.status = 'RUNNING'")]
        for run_id in running:
            client.set_tag(run_id, "alignflow.end_reason", "the pipeline run was stopped")
            client.set_terminated(run_id, status="KILLED")
        return running

    def reap_stale(self) -> list[str]:
        """Mark KILLED every RUNNING run of the experiment owned by a process on this host that is gone."""
        client = self._client
        host = socket.gethostname()
        query = f"attributes.status = 'RUNNING' and tags.`{HOST_TAG}` = '{host}'"
        stale = []
        for run in self._search(query):  # every page first: ending runs while paging would shift the pages
            pid, since = run.data.tags.get(PID_TAG, ""), run.data.tags.get(OWNED_TAG, str(run.info.start_time))
            if pid.isdigit() and not pid_alive(int(pid), since=int(since) / 1000):
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
        client = self._client
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
            if stage not in runs and quotable(key, stage):
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
        client = self._client
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
        return StageRun(self._client, run_id)

    @contextlib.contextmanager
    def stage_run(
        self, parent_run_id: str | None, stage: str, params: Mapping[str, Any], tags: Mapping[str, str] | None = None
    ) -> Iterator[StageRun]:
        """A child run of the pipeline's parent run (or a top-level run).

        A stage that ran before under the same parent with the same key (`tags["alignflow.key"]`) and did not
        finish (a retry: Prefect's, or of the whole flow run) continues that run, so its metrics are one history
        across attempts."""
        client = self._client
        all_tags = {"alignflow.stage": stage, **_owner_tags(), **(tags or {})}
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        previous = self._reopenable("alignflow.key", all_tags.get("alignflow.key", ""), parent_run_id, stage) \
            if parent_run_id else None
        reopened = previous is not None and previous.info.status != "FINISHED"
        if reopened:
            run_id = self._reopen(previous, all_tags, params)  # a retry of this stage in the same pipeline run
        else:
            run_id = client.create_run(self.experiment_id, run_name=stage, tags=all_tags).info.run_id
        try:
            if not reopened:
                self._log_params(run_id, param_values(params))
            yield StageRun(client, run_id)
        except BaseException as exc:
            # Best effort: an error here must not replace the one that ends the stage. A stage whose pipeline
            # was stopped (stop_children) stays KILLED where it then fails for it (its engine host gone).
            status = end_status(exc)
            try:
                if status == "FAILED" and client.get_run(run_id).info.status == "KILLED":
                    status = "KILLED"
                client.set_terminated(run_id, status=status)
            except Exception as err:
                log.warning("could not end MLflow run %s (%s): %s", run_id, status, err)
            raise
        client.set_terminated(run_id, status="FINISHED")

    def _log_params(self, run_id: str, strings: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        batch = [Param(k, v) for k, v in strings.items()]
        client = self._client
        for i in range(0, len(batch), 100):
            client.log_batch(run_id, params=batch[i : i + 100])


EXPERIMENT_KIND_TAG, TRAINING_KIND = "mlflow.experimentKind", "custom_model_development"
PID_TAG, HOST_TAG, ATTEMPT_TAG = "alignflow.pid", "alignflow.host", "alignflow.attempt"
OWNED_TAG = "alignflow.owned_since_ms"  # when `pid` took the run: a reopened run is older than its new owner


def _owner_tags() -> dict[str, str]:
    return {PID_TAG: str(os.getpid()), HOST_TAG: socket.gethostname(), OWNED_TAG: str(int(time.time() * 1000))}
