"""Mid-stage checkpoints, for every stage that trains for many steps.

Every `every` steps the stage's full state is committed under
`{stage_uri}/checkpoints/step-N` (manifest last, like any artifact) and older
ones are dropped but the one before it; a retried task resumes from the newest
committed one that verifies. What
the state is (trainer group, RL round) is the caller's: it passes `save` and
`load` functions over the checkpoint's ArtifactRef, which its actors write
to and read from on their own nodes (alignflow/store/artifacts.py); the manifest
is written here, last.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from alignflow.store.artifacts import WEIGHT_FILES, ArtifactRef, Entries
from alignflow.store.storage import CorruptArtifact, Storage
from alignflow.tracking.runs import StageRun
from tasks.runner import note_resumed

log = logging.getLogger("alignflow")


class StageCheckpoints:
    def __init__(self, storage: Storage, stage_uri: str, stage: str, every: int):
        self.storage, self.stage_uri, self.stage, self.every = storage, stage_uri, stage, every

    def resume(self, load: Callable[[ArtifactRef], int], run: StageRun, total: int) -> int:
        """Load the newest committed checkpoint that verifies (`load(ref) -> its step`); 0 if there is none.
        A resume is said in MLflow (`alignflow.resumed_from_step`) and on the Prefect task run (its tags and
        its final state's message: `resumed from step S of total`).

        A corrupted newest checkpoint is skipped for the one before it (storage warns). Its small files
        are verified here, on the task's node, its weights and optimizer state by their stored sizes;
        the actors that load them fetch and verify them on their own nodes. Where they find one corrupt,
        the actors hold part of it: this attempt fails, with the checkpoint set aside (uncommitted, its
        files kept), so that the next one (Prefect's retry) starts from the one before it, or step 0."""
        latest = self.storage.latest_valid_checkpoint(self.stage_uri, skip=WEIGHT_FILES)
        if latest is None:
            return 0
        _, uri, _ = latest
        try:
            step = load(ArtifactRef(uri, self.storage))
        except CorruptArtifact as err:
            aside = self.storage.set_aside(uri)
            raise CorruptArtifact(f"{self.stage}: the checkpoint {uri} failed verification where it was loaded, "
                                  f"and is set aside ({aside}): a retry starts from the checkpoint before it, or "
                                  f"step 0. {err}") from err
        run.set_tag("alignflow.resumed_from_step", str(step))
        try:  # a new pipeline run's stage run: the steps before, from the run it resumes
            run.take_history(step)
        except Exception as err:  # noqa: BLE001  (a curve's start is not worth the stage: said, not raised)
            log.warning("%s: the steps before %d could not be copied from the run it resumes (%s: %s); its "
                        "MLflow curve starts at step %d", self.stage, step, type(err).__name__, err, step + 1)
        log.info("%s: resuming at step %d of %d (%s)", self.stage, step, total, uri)
        note_resumed(step, total)
        return step

    def due(self, step: int, total: int) -> bool:
        """After `step` steps: a checkpoint is due (never after the last step; the stage commits then)."""
        return step % self.every == 0 and step < total

    def save(self, step: int, save: Callable[[ArtifactRef], Entries]) -> None:
        """Commit the state `save(ref)` uploads (returning its manifest entries) as the checkpoint of
        `step`; drop older ones but the newest committed before it (a fallback where this one fails to verify)."""
        uri = self.storage.checkpoint_uri(self.stage_uri, step)
        self.storage.commit(None, uri, meta={"stage": self.stage, "step": step},
                            uploaded=save(ArtifactRef(uri, self.storage)))
        self.storage.prune_checkpoints(self.stage_uri, keep_step=step)
        log.info("%s: checkpoint at step %d", self.stage, step)
