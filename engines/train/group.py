"""The training engine as one: `TrainerGroup`, the ranks (engines/train/worker.py: TrainWorker) of one
DeepSpeed process group, started together and driven as a single engine (engines/train/worker.py says how
a step runs on each rank)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
import torch

from alignflow.store.artifacts import Entries, Source, merge_entries
from engines.accumulate import combine_ranks, loss_scales
from engines.batches import padded_shards
from engines.micro_batching import step_micro_batches
from engines.placement import warm
from engines.placement.devices import actor_options
from engines.placement.groups import reserve_together
from engines.train.spec import EngineSpec
from engines.train.worker import TrainWorker


class TrainerGroup:
    """`num_workers` TrainWorker actors acting as one training engine."""

    def __init__(self, spec: EngineSpec, num_workers: int, placements: list[dict[str, Any]] | None = None,
                 wait: bool = True):
        """`placements`: per rank, Ray actor options (num_cpus, num_gpus, scheduling_strategy) that
        replace the spec's placement (colocation); None: each rank on the spec's CPUs/GPUs.
        `wait=False`: return at once, `wait_ready()` waits (a round starts its other actors meanwhile)."""
        if spec.global_batch % num_workers:
            raise ValueError(f"batch_size {spec.global_batch} must divide by num_workers {num_workers}")
        default = actor_options(spec.num_cpus_per_worker, spec.num_gpus_per_worker, resources=spec.resources_per_worker)
        self.spec, self.world_size, self.workers = spec, num_workers, []
        self.placement_group = None  # ranks of their own: reserved together (else `placements` place them)
        # Inside warm.keep_warm(): ranks of this shape a group left idle (engines/placement/warm.py). Ranks placed
        # by the caller have no shape of their own: never kept.
        self._failed, self._pending_setup = False, []
        self._shape = None if placements is not None else warm.trainer_shape(num_workers, default, spec.torch_threads,
                                                                              spec.cpu_cores)
        idle = warm.take(self._shape, num_workers) if self._shape is not None else None
        try:
            if idle is not None:
                self.workers, self.placement_group, self._master = idle.actors, idle.placement_group, idle.master
            else:
                if placements is None:
                    self.placement_group, placements = reserve_together(default, num_workers,
                                                                        f"{spec.kind} trainer ranks")
                self.workers = [ray.remote(**placements[rank])(TrainWorker).remote(
                    rank, num_workers, spec.torch_threads, spec.cpu_cores) for rank in range(num_workers)]
                self._master = self.workers[0].address.remote()  # an argument of every setup: Ray passes its value
            self._pending_setup = [w.setup.remote(spec, self._master) for w in self.workers]
        except BaseException:
            self._failed = True
            self.shutdown()  # the placement group with them
            raise
        self.param_metrics: dict[str, float] = {}
        if wait:
            self.wait_ready()

    def wait_ready(self) -> TrainerGroup:
        """Blocks until every worker has set up (a failure kills the workers and raises)."""
        if self._pending_setup:
            try:  # with LoRA: the trainable share of the parameters (lora/trainable_fraction); {} without
                self.param_metrics = ray.get(self._pending_setup)[0]
            except BaseException:
                self._failed = True
                self.shutdown()  # the calling worker process lives on; so would the actors
                raise
            self._pending_setup = []
        return self

    def train_step(self, shards: list[dict[str, Any]], objective: Callable, paired: bool = False, *,
                   weigh: Callable[[dict[str, Any]], float]) -> dict[str, float]:
        """One optimizer step on a global batch given as one shard per worker, each cut into micro-batches
        of at most `micro_batch_size` rows and `micro_batch_tokens` padded tokens (pairs kept whole);
        `weigh(micro)`: what the objective averages over in it (engines/train/objectives.py), as loss_scales."""
        if len({tuple(s["input_ids"].shape) for s in shards}) > 1:  # else the ranks' micro-batch counts may differ
            raise ValueError(f"shards of one step must have one shape: {[tuple(s['input_ids'].shape) for s in shards]}")
        size, tokens = self.spec.micro_batch_size, self.spec.micro_batch_tokens
        parts = step_micro_batches(shards, size, tokens=tokens, paired=paired)
        results = self._get([w.train_step.remote(p, objective, scales)
                           for w, p, scales in zip(self.workers, parts, loss_scales(parts, weigh))])
        summarize = getattr(objective, "summarize", None)  # metrics of the whole step (KTO's reward margin)
        return summarize(combine_ranks(results)) if summarize else combine_ranks(results)

    def skip_updates(self, n: int) -> None:
        """Move the learning-rate schedule on by `n` optimizer steps not taken (a round step whose dynamic
        sampling left fewer minibatches than the schedule was sized for), so that it is where the round is."""
        if n > 0:
            self._get([w.skip_updates.remote(n) for w in self.workers])

    def evaluate(self, batch: dict[str, Any], fn: Callable, without_adapters: bool = False) -> Any:
        """`fn(model, batch)`, rank 0's result (every rank runs it: ZeRO-3 needs all in each forward);
        `without_adapters`: on the LoRA base model, the frozen reference (TrainWorker.evaluate)."""
        return self._get([w.evaluate.remote(batch, fn, without_adapters) for w in self.workers])[0]

    def evaluate_rows(self, batch: dict[str, Any], fn: Callable, without_adapters: bool = False) -> torch.Tensor:
        """`fn(model, rows)` -> one result row per batch row (logprobs, values), each rank on its share of
        the rows (batches.padded_shards), concatenated in row order: 1/R of `evaluate`'s work per rank."""
        if self.world_size == 1:
            return self.evaluate(batch, fn, without_adapters)
        shards = padded_shards(batch, self.world_size)
        parts = self._get([w.evaluate.remote(s, fn, without_adapters) for w, s in zip(self.workers, shards)])
        return torch.cat(parts)[: batch["input_ids"].shape[0]]

    def save_hf(self, target: Source) -> Entries:
        """Every rank writes its part (rank 0 the files); a ref: the entries they uploaded."""
        return merge_entries(self._get([w.save_hf.remote(target) for w in self.workers]))

    def save_state(self, target: Source, extra: dict[str, Any]) -> Entries:
        return merge_entries(self._get([w.save_state.remote(target, extra) for w in self.workers]))

    def load_state(self, source: Source) -> dict[str, Any]:
        return self._get([w.load_state.remote(source) for w in self.workers])[0]

    def weights_bytes(self) -> bytes:
        return self._get([w.weights_bytes.remote() for w in self.workers])[0]  # rank 0's

    def offload_states(self) -> None:
        self._get([w.offload_states.remote() for w in self.workers])

    def reload_states(self) -> None:
        self._get([w.reload_states.remote() for w in self.workers])

    def device_reports(self) -> list[dict[str, Any]]:
        return self._get([w.device_report.remote() for w in self.workers])

    def taint(self) -> None:
        """A call on the ranks from outside (the weight transport's) failed: they end with the group, not kept warm."""
        self._failed = True

    def _get(self, refs: list) -> list:
        """`ray.get(refs)`; a group one of whose calls raised is not kept warm (its ranks may be mid-collective)."""
        try:
            return ray.get(refs)
        except BaseException:
            self._failed = True
            raise

    def shutdown(self, failed: bool = False) -> None:
        """Ends the ranks, or inside warm.keep_warm() leaves them reset and idle where every call succeeded and
        the caller's work with them did not fail (`failed`: it may have left a call of theirs running)."""
        self._failed = self._failed or failed
        workers, self.workers = self.workers, []
        if workers and self._shape is not None and not self._failed and not self._pending_setup:
            if warm.keep(self._shape, warm.Idle(workers, self.placement_group, self._master)):
                self.placement_group = None
                return
        for w in workers:
            ray.kill(w)
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None
