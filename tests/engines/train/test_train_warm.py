"""Trainer ranks kept warm (engines/train/warm.py), on real DeepSpeed ranks in a local Ray.

- A group ended inside `keep_warm()` leaves its processes to the next group of its shape, which trains
  bit for bit as the first did in them, after a group of another ZeRO stage and learning rate ran there.
  (The module fixture `warm_trainers`, tests/conftest.py, keeps them warm across a module's tests.)
- A group of another shape ends the idle ones; a group whose step raised, or whose model something still
  holds after the reset, is not kept; leaving `keep_warm()` ends every idle rank.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def batch(tokenizer):
    from alignflow.config import SyntheticTaskConfig
    from alignflow.data import synthetic
    from engines.batches import sft_tensors

    data = synthetic.generate(SyntheticTaskConfig(num_sft=8, num_preference=1, num_eval=1, num_rl_prompts=1), seed=0)
    return sft_tensors(tokenizer, data["sft"], 64, 16)[0]


def _spec(tiny_model, zero_stage: int, lr: float, threads: int = 1):
    from alignflow.config import EngineConfig
    from engines.train.spec import EngineSpec

    return EngineSpec.from_config(EngineConfig(learning_rate=lr, warmup_steps=0, zero_stage=zero_stage),
                                  model_path=str(tiny_model), kind="causal", total_steps=10, global_batch=8,
                                  dtype="float32", torch_threads=threads, seed=0)


def _pids(group) -> list[int]:
    import ray

    return ray.get([w.__ray_call__.remote(lambda self: os.getpid()) for w in group.workers])


def _step(group, batch, objective=None) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    from safetensors.torch import load

    from engines.batches import shard
    from engines.train import objectives

    metrics = group.train_step(shard(batch, group.world_size), objective or objectives.causal_lm_objective,
                               weigh=objectives.response_tokens)
    return load(group.weights_bytes()), metrics


def _ended(pids: list[int], timeout_s: float = 60.0) -> bool:
    """Whether every process in `pids` (this machine's) has exited, waiting up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.2)
    return False


def broken_objective(model, micro):
    raise RuntimeError("this objective fails on purpose")


def test_the_next_group_of_a_shape_takes_the_ranks_and_trains_as_in_fresh_ones(ray_local, tiny_model, batch):
    """Two ranks at ZeRO-2, then ZeRO-3 (which leaves its model on a DeepSpeed global unless the reset clears
    it: then the ranks would not be kept) at another learning rate, then ZeRO-2 again, in the same processes."""
    from engines.train.group import TrainerGroup
    from engines.train.warm import keep_warm

    ranks, first, between = 2, 2, 3
    with keep_warm() as warm:
        started = time.monotonic()
        group = TrainerGroup(_spec(tiny_model, first, 1e-2), ranks)
        fresh_s = time.monotonic() - started
        pids = _pids(group)
        fresh = _step(group, batch)
        group.shutdown()
        # Another ZeRO stage and learning rate in the same processes; its step moves the weights elsewhere.
        group = TrainerGroup(_spec(tiny_model, between, 1e-1), ranks)
        assert _pids(group) == pids
        other = _step(group, batch)
        group.shutdown()
        started = time.monotonic()
        group = TrainerGroup(_spec(tiny_model, first, 1e-2), ranks)
        warm_s = time.monotonic() - started
        assert _pids(group) == pids
        again = _step(group, batch)
        group.shutdown()
        assert warm.counts.started == ranks and warm.counts.reused == 2 * ranks and warm.counts.kept == 3 * ranks
    assert _ended(pids), "idle ranks outlived keep_warm()"
    assert warm.counts.ended == ranks
    assert max((other[0][k] - fresh[0][k]).abs().max().item() for k in fresh[0]) > 1e-3
    assert fresh[0].keys() == again[0].keys() and all(torch.equal(fresh[0][k], again[0][k]) for k in fresh[0])
    assert fresh[1] == again[1]
    print(f"two ranks: a group started in {fresh_s:.1f} s, and in {warm_s:.1f} s in warm ranks")


def test_idle_ranks_end_for_another_shape_and_a_failed_or_unfreed_group_is_not_kept(ray_local, tiny_model, batch):
    import ray

    from engines.train.group import TrainerGroup
    from engines.train.warm import keep_warm

    with keep_warm() as warm:
        group = TrainerGroup(_spec(tiny_model, 0, 1e-2), 1)
        idle = _pids(group)
        group.shutdown()
        group = TrainerGroup(_spec(tiny_model, 0, 1e-2, threads=2), 1)  # another shape: two torch threads
        failed = _pids(group)
        assert failed != idle and _ended(idle), "the idle rank of another shape was not ended"
        with pytest.raises(ray.exceptions.RayTaskError, match="fails on purpose"):
            _step(group, batch, broken_objective)
        group.shutdown()
        assert _ended(failed), "a group whose step raised was kept"
        assert warm.counts.kept == 1 and warm.counts.not_kept == 0

        group = TrainerGroup(_spec(tiny_model, 0, 1e-2, threads=2), 1)
        held = _pids(group)
        # Something in the rank's process still holds the model after the reset: its memory would not come back.
        ray.get(group.workers[0].__ray_call__.remote(lambda self: setattr(TrainerGroup, "held", self.engine.module)))
        group.shutdown()
        assert _ended(held), "a rank whose model outlived its reset was kept"
        assert warm.counts.not_kept == 1 and warm.counts.kept == 1 and warm.idle == {}
