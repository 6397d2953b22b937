"""What every stage task shares: infra handles and the committed-stage pattern.

A stage task is idempotent: if its directory `{root}/{name}/{key}` is
already committed it returns it without computing (Prefect's cache is the
first line; this is the second, for a result record lost or a cache
expired). Otherwise it computes into a scratch directory, inside an MLflow
child run, and commits the directory (manifest last). The manifest records
the stage's config, input keys and code version, so `alignflow plan` can say
why a later plan of the same stage runs again.
"""

from __future__ import annotations

import datetime
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from alignflow.config import InfraConfig, cache_relevant
from alignflow.records import StageResult
from alignflow.storage import Storage
from alignflow.tracking import StageRun, Tracker

if TYPE_CHECKING:
    from tasks.plan import PlannedStage

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
    ctx: RunContext, stage: PlannedStage, compute: Callable[[Path, StageRun, str], dict[str, float]],
) -> StageResult:
    """Return the committed stage, computing and committing it if needed.

    `compute(out_dir, run, uri)` writes the stage's files into `out_dir`
    and returns its summary metrics; `uri` is where they will be committed
    (mid-stage checkpoints go under it).
    """
    storage = ctx.storage()
    uri = storage.stage_uri(stage.name, stage.key)
    result = StageResult(stage=stage.name, key=stage.key, uri=uri)
    if storage.is_committed(uri):
        log.info("%s: already committed at %s", stage.name, uri)
        return result.model_copy(update={"metrics": storage.read_manifest(uri)["meta"].get("metrics", {})})
    torch_threads(ctx.infra.torch_threads)
    config = cache_relevant(stage.config)
    with ctx.tracker().stage_run(ctx.parent_run_id, stage.name, config, tags={"alignflow.key": stage.key}) as run:
        with tempfile.TemporaryDirectory(prefix=f"alignflow-{stage.name}-") as out:
            metrics = compute(Path(out), run, uri)
            storage.commit(out, uri, meta={
                "stage": stage.name, "kind": stage.kind, "key": stage.key, "config": config,
                "input_keys": stage.input_keys, "code_version": stage.code_version, "metrics": metrics,
                "committed_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            })
        # Only now: a failed final upload must still find the mid-stage checkpoints.
        storage.prune_checkpoints(uri)
        run.set_tag("alignflow.uri", uri)
    log.info("%s: committed %s", stage.name, uri)
    return result.model_copy(update={"metrics": metrics})


def torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
