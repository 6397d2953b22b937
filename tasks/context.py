"""What every stage task shares: infra handles and the committed-stage pattern.

A stage task is idempotent: if its directory `{root}/{name}/{key}` is
already committed it returns it without computing (Prefect's cache is the
first line; this is the second, for a result record lost or a cache
expired). Otherwise it computes, inside an MLflow child run, and commits the
stage's directory (manifest last): the files the task wrote into its scratch
directory, and those its actors uploaded from their own nodes (StageOutput). The manifest records
the stage's config, input keys and code version, so `alignflow plan` can say
why a later plan of the same stage runs again.
"""

from __future__ import annotations

import datetime
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from alignflow.store.artifacts import WEIGHT_FILES, ArtifactRef, Entries, local_dir, merge_entries
from alignflow.cluster import scratch_dir
from alignflow.config import InfraConfig, cache_relevant
from alignflow.records import StageResult
from alignflow.redact import redact
from alignflow.store.storage import Storage
from alignflow.tracking.runs import StageRun, Tracker

if TYPE_CHECKING:
    from tasks.plan import PlannedStage

log = logging.getLogger("alignflow")


@dataclass
class StageOutput:
    """What a stage's `compute` writes: files into `dir` (this task's scratch), and through actors that
    write from their own nodes (`ref`; `add` what they uploaded). Committed together, manifest last."""

    dir: Path
    ref: ArtifactRef
    uploaded: Entries = field(default_factory=dict)

    @property
    def uri(self) -> str:
        return self.ref.uri

    def add(self, entries: Entries) -> None:
        self.uploaded = merge_entries([self.uploaded, entries])


class RunContext(BaseModel):
    """Handed to every task: infra settings and the pipeline's MLflow parent run."""

    model_config = ConfigDict(frozen=True)

    infra: InfraConfig
    parent_run_id: str | None = None
    engine_host: str | None = None  # the run's evaluation engine process, a named Ray actor (tasks/stages/eval_engine.py)

    def storage(self) -> Storage:
        s = self.infra.storage
        return Storage(root=s.root, endpoint_url=s.endpoint_url, cache_dir=s.cache_dir)

    def uri(self, result: StageResult) -> str:
        """Where a committed input is under this run's storage root: from its stage and key, not the URI it was
        committed at, which a cached result (Prefect's) keeps though the root moved or another host mounts it
        at another path."""
        return self.storage().stage_uri(result.stage, result.key)

    def ref(self, result: StageResult | None) -> ArtifactRef | None:
        """A committed input as actors receive it: each fetches it on its own node (alignflow/store/artifacts.py)."""
        return ArtifactRef(self.uri(result), self.storage()) if result is not None else None

    def tokenizer_dir(self, result: StageResult) -> str:
        """A committed model's tokenizer and config, without its weights, on this task's node."""
        return local_dir(self.ref(result), skip=WEIGHT_FILES)

    def tracker(self) -> Tracker:
        return Tracker(self.infra.mlflow_tracking_uri, self.infra.mlflow_experiment,
                       artifact_root=f"{self.infra.storage.root.rstrip('/')}/mlflow-artifacts")


def compute_stage(
    ctx: RunContext, stage: PlannedStage, compute: Callable[[StageOutput, StageRun], dict[str, float]],
) -> StageResult:
    """Return the committed stage, computing and committing it if needed.

    `compute(out, run)` writes the stage's files (StageOutput) and returns
    its summary metrics; `out.uri` is where they will be committed
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
        with tempfile.TemporaryDirectory(prefix=f"alignflow-{stage.name}-", dir=scratch_dir()) as out:
            output = StageOutput(Path(out), ArtifactRef(uri, storage))
            metrics = compute(output, run)
            storage.commit(out, uri, uploaded=output.uploaded, meta={
                "stage": stage.name, "kind": stage.kind, "key": stage.key, "config": redact(config),
                "input_keys": stage.input_keys, "code_version": stage.code_version, "metrics": metrics,
                "committed_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            })
        # Only now: a failed final upload must still find the mid-stage checkpoints. Committed, the stage is done:
        # what fails after (pruning, a tag) is said, and leaves its MLflow run FINISHED, as its artifact is good.
        for what, after in (("pruning its checkpoints", lambda: storage.prune_checkpoints(uri)),
                            ("tagging its MLflow run", lambda: run.set_tag("alignflow.uri", uri))):
            try:
                after()
            except Exception as err:  # noqa: BLE001  (storage or tracking, any kind)
                log.warning("%s: committed at %s, but %s failed (%s: %s)", stage.name, uri, what,
                            type(err).__name__, err)
    log.info("%s: committed %s", stage.name, uri)
    return result.model_copy(update={"metrics": metrics})


def torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
