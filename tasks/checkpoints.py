"""Mid-stage checkpoints, for every stage that trains for many steps.

Every `every` steps the stage's full state is committed under
`{stage_uri}/checkpoints/step-N` (manifest last, like any artifact) and older
ones are dropped; a retried task resumes from the newest committed one. What
the state is (trainer group, RL round) is the caller's: it passes `save` and
`load` functions over a local directory.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from pathlib import Path

from alignflow.storage import Storage
from alignflow.tracking import StageRun

log = logging.getLogger("alignflow")


class StageCheckpoints:
    def __init__(self, storage: Storage, stage_uri: str, stage: str, every: int):
        self.storage, self.stage_uri, self.stage, self.every = storage, stage_uri, stage, every

    def resume(self, load: Callable[[Path], int], run: StageRun) -> int:
        """Load the newest committed checkpoint that verifies (`load(dir) -> its step`); 0 if there is none.

        A corrupted newest checkpoint is skipped for the one before it (storage warns)."""
        latest = self.storage.latest_valid_checkpoint(self.stage_uri)
        if latest is None:
            return 0
        _, uri, local = latest
        step = load(local)
        run.set_tag("alignflow.resumed_from_step", str(step))
        log.info("%s: resuming at step %d (%s)", self.stage, step, uri)
        return step

    def due(self, step: int, total: int) -> bool:
        """After `step` steps: a checkpoint is due (never after the last step; the stage commits then)."""
        return step % self.every == 0 and step < total

    def save(self, step: int, save: Callable[[str], None]) -> None:
        """Commit the state `save(dir)` writes as the checkpoint of `step`; drop older ones."""
        with tempfile.TemporaryDirectory(prefix=f"alignflow-{self.stage}-ckpt-") as tmp:
            save(tmp)
            uri = self.storage.checkpoint_uri(self.stage_uri, step)
            self.storage.commit(tmp, uri, meta={"stage": self.stage, "step": step})
        self.storage.prune_checkpoints(self.stage_uri, keep_step=step)
        log.info("%s: checkpoint at step %d", self.stage, step)
