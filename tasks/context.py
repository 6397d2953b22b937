"""What every stage task shares: infra handles, the committed-stage pattern, Ray.

A stage task is idempotent: if its directory `{root}/{stage}/{key}` is
already committed it returns it without computing (Prefect's cache is the
first line; this is the second, for a result record lost or a cache
expired). Otherwise it computes into a scratch directory, inside an MLflow
child run, and commits the directory (manifest last).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from alignflow.config import InfraConfig
from alignflow.records import StageResult
from alignflow.storage import Storage
from alignflow.tracking import StageRun, Tracker

log = logging.getLogger("alignflow")


class RunContext(BaseModel):
    """Handed to every task: infra settings and the pipeline's MLflow parent run."""

    model_config = ConfigDict(frozen=True)

    infra: InfraConfig
    parent_run_id: str | None = None

    def storage(self) -> Storage:
        s = self.infra.storage
        return Storage(root=s.root, endpoint_url=s.endpoint_url, cache_dir=s.cache_dir)

    def tracker(self) -> Tracker:
        return Tracker(self.infra.mlflow_tracking_uri, self.infra.mlflow_experiment)


def compute_stage(
    ctx: RunContext,
    *,
    stage: str,
    key: str,
    params: dict[str, Any],
    compute: Callable[[Path, StageRun, str], dict[str, float]],
) -> StageResult:
    """Return the committed stage, computing and committing it if needed.

    `compute(out_dir, run, uri)` writes the stage's files into `out_dir`
    and returns its summary metrics; `uri` is where they will be committed
    (mid-stage checkpoints go under it).
    """
    storage = ctx.storage()
    uri = storage.stage_uri(stage, key)
    if storage.is_committed(uri):
        meta = storage.read_manifest(uri)["meta"]
        log.info("%s: already committed at %s", stage, uri)
        return StageResult(stage=stage, key=key, uri=uri, metrics=meta.get("metrics", {}))
    torch_threads(ctx.infra.torch_threads)
    with ctx.tracker().stage_run(ctx.parent_run_id, stage, params, tags={"alignflow.key": key}) as run:
        with tempfile.TemporaryDirectory(prefix=f"alignflow-{stage}-") as out:
            metrics = compute(Path(out), run, uri)
            storage.commit(out, uri, meta={"stage": stage, "key": key, "config": params, "metrics": metrics})
        # Only now: a failed final upload must still find the mid-stage checkpoints.
        storage.prune_checkpoints(uri)
        run.set_tag("alignflow.uri", uri)
    log.info("%s: committed %s", stage, uri)
    return StageResult(stage=stage, key=key, uri=uri, metrics=metrics)


def torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
    os.environ.setdefault("OMP_NUM_THREADS", str(n))


def _cache_key(context, parameters: dict[str, Any]) -> str:
    """Prefect cache key: the stage's content key (config + inputs + code)."""
    return f"{context.task.name}-{parameters['key']}"


def stage_task(fn: Callable, name: str):
    """A Prefect task cached by its content key, persisted, retried with backoff.

    Result storage and the retry count come from the pipeline's infra config
    (`with_options` in the flow); these are the defaults for a stage run alone.
    """
    from prefect import task
    from prefect.tasks import exponential_backoff

    # JSON results, not pickles: the results directory may be a shared bucket,
    # and a pickle read back on a cache hit could run anyone's code.
    return task(
        fn, name=name, cache_key_fn=_cache_key, persist_result=True, result_serializer="json", retries=2,
        retry_delay_seconds=exponential_backoff(backoff_factor=2), retry_jitter_factor=0.5,
    )
