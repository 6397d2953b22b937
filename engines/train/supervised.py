"""The step loop shared by SFT and reward-model training.

Data order is a pure function of (seed, step): epoch e uses permutation
`randperm(n, seed + e)`, so a run resumed at step s sees exactly the batches
an uninterrupted run would have seen from s on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from alignflow.errors import ConfigError
from engines.batches import shard, split_pairs, take
from engines.train.group import TrainerGroup


@dataclass(frozen=True)
class Schedule:
    rows: int
    batch_size: int
    total_steps: int
    seed: int

    @property
    def steps_per_epoch(self) -> int:
        return max(1, self.rows // self.batch_size)

    def order(self, epoch: int) -> torch.Tensor:
        """Epoch `epoch`'s permutation of the rows: (rows,) long."""
        return torch.randperm(self.rows, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))

    def indices(self, step: int) -> torch.Tensor:
        epoch, pos = divmod(step, self.steps_per_epoch)
        return self.order(epoch)[pos * self.batch_size : (pos + 1) * self.batch_size]

    @property
    def left_per_epoch(self) -> int:
        """Rows each epoch leaves out (`rows % batch_size`: whole batches only), a different set each epoch."""
        return self.rows - self.steps_per_epoch * self.batch_size

    def never_trained(self) -> int:
        """Rows no step takes: an epoch's leftovers, and the rest of an epoch cut by a fraction or max_steps."""
        seen = torch.zeros(self.rows, dtype=torch.bool)
        for epoch in range(-(-self.total_steps // self.steps_per_epoch)):
            steps = min(self.steps_per_epoch, self.total_steps - epoch * self.steps_per_epoch)
            seen[self.order(epoch)[: steps * self.batch_size]] = True
        return int((~seen).sum())

    def left_out(self, what: str, unseen: int) -> str:
        """What the schedule leaves out, said: `unseen` is never_trained()."""
        return (f"{unseen} of {self.rows} {what} are never trained on: each epoch takes {self.steps_per_epoch} whole "
                f"batches of {self.batch_size}, leaving {self.left_per_epoch} out (a different set each epoch), "
                f"over {self.total_steps} steps")


def plan(rows: int, batch_size: int, epochs: float, max_steps: int | None, seed: int,
         field: str = "batch_size", what: str = "training rows") -> Schedule:
    """Steps for `epochs` passes (at least 1), capped by `max_steps`. Fewer `rows` than a batch is the user's
    to fix (not retried): a ConfigError naming the config `field` and the rows (`what`)."""
    if rows < batch_size:
        raise ConfigError(f"{field}: {batch_size} is more than the {rows} {what}; lower it, or give it more data")
    total = max(1, int(epochs * (rows // batch_size)))
    if max_steps is not None:
        total = min(total, max_steps)
    return Schedule(rows=rows, batch_size=batch_size, total_steps=total, seed=seed)


def fit(
    group: TrainerGroup,
    data: dict[str, torch.Tensor],
    schedule: Schedule,
    objective: Callable,
    weigh: Callable,
    *,
    paired: bool,
    start_step: int = 0,
    after_step: Callable[[int, dict[str, float]], None],
) -> int:
    """Run steps [start_step, total_steps); `after_step(steps done, metrics)` after each. `weigh`: what
    `objective` averages over (TrainerGroup.train_step). Returns the number of steps run."""
    n_rows = data["input_ids"].shape[0] // (2 if paired else 1)
    for step in range(start_step, schedule.total_steps):
        t0 = time.perf_counter()
        idx = schedule.indices(step)
        batch = split_pairs(data, idx, n_rows) if paired else take(data, idx)
        metrics = group.train_step(shard(batch, group.world_size, paired=paired), objective, paired=paired, weigh=weigh)
        metrics["step_time_s"] = time.perf_counter() - t0
        after_step(step + 1, metrics)
    return schedule.total_steps - start_step
