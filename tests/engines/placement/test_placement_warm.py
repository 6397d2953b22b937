"""Actors kept warm (engines/placement/warm.py): real DeepSpeed ranks, vLLM engines and scorers in a local Ray.

- A group ended inside `keep_warm()` leaves its processes to the next group of its shape, which trains
  bit for bit as the first did in them, after a group of another ZeRO stage and learning rate ran there.
  (The module fixture `warm_actors`, tests/conftest.py, keeps them warm across a module's tests.)
- A group of another shape ends the idle ones; a group whose step raised, or whose model something still
  holds after the reset, is not kept; leaving `keep_warm()` ends every idle rank, and a group that ends
  after it is not kept.
- A vLLM rollout engine ended inside `keep_warm()` is built again in its process as it started: after an
  update moved its weights, the next start like its own samples exactly what it first sampled; engines a
  failed transfer tainted end.
- A scorer is taken again only by a start with its own arguments.
- A run's stages, one after another in a Ray worker (`between_stages`), hand their ranks and scorers on; an
  actor left idle `infra.keep_warm_s` ends with no one closing the pool, and no rollout engine is kept there.
"""

from __future__ import annotations

import os
import threading
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
    from engines.placement.warm import keep_warm

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
    from engines.placement.warm import keep_warm

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
        group = TrainerGroup(_spec(tiny_model, 0, 1e-2), 1)
        outliving = _pids(group)
    group.shutdown()  # after its keep_warm() ended: nothing keeps it now, so it ends
    assert _ended(outliving), "a group that outlived keep_warm() left its ranks running"
    assert warm.counts.kept == 1 and warm.idle == {}


def _actor_pid(actor) -> int:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))


def test_a_rollout_engine_kept_warm_samples_as_it_first_did(ray_local, tiny_model, tokenizer):
    import ray

    from engines import models
    from engines.batches import render_prompt
    from engines.placement.warm import keep_warm
    from engines.rollout.actors import RolloutEngines, start_rollout_actor
    from engines.rollout.base import Sampling
    from engines.transport.sync import push_state

    prompts = [render_prompt(tokenizer, [{"role": "user", "content": t}]) for t in ("Which digit is largest? 3 1 4",
                                                                                   "hello")]
    sampling = Sampling(n=2, temperature=1.0, top_p=1.0, max_new_tokens=8)

    def start():
        return start_rollout_actor("vllm", str(tiny_model), num_cpus=1, torch_threads=1, dtype="float32", seed=0,
                                   max_model_len=128)

    def sample(actor) -> list[tuple]:
        return [(r.token_ids, [round(x, 5) for x in r.logprobs], r.policy_version)
                for r in ray.get(actor.generate.remote(prompts, sampling))]

    with keep_warm() as warm:
        engines = RolloutEngines([start()])
        pid, first = _actor_pid(engines.actors[0]), sample(engines.actors[0])
        halved = {k: v * 0.5 for k, v in models.load_policy(tiny_model).state_dict().items()}
        push_state(halved, engines.actors)
        moved = sample(engines.actors[0])
        assert {v for *_, v in moved} == {1} and moved != first
        engines.shutdown()
        engines = RolloutEngines([start()])
        assert _actor_pid(engines.actors[0]) == pid
        assert sample(engines.actors[0]) == first  # the weights and the seed it started with; version 0
        engines.taint()  # as a failed weight transfer leaves them: ended, not kept
        engines.shutdown()
        assert _ended([pid])
        assert warm.counts.started == 1 and warm.counts.reused == 1 and warm.counts.kept == 1 and warm.idle == {}


def test_a_scorer_is_taken_again_only_by_a_start_like_its_own(ray_local, tiny_model):
    from engines.placement import warm
    from engines.rl.scoring import start_scorer

    def start(threads: int):
        return start_scorer(str(tiny_model), None, dtype="float32", torch_threads=threads)

    with warm.keep_warm() as pool:
        scorer = start(1)
        pid = _actor_pid(scorer)
        warm.end(scorer)
        scorer = start(1)
        assert _actor_pid(scorer) == pid
        warm.end(scorer)
        scorer = start(2)
        assert _actor_pid(scorer) != pid and _ended([pid])
        warm.end(scorer, failed=True)
        assert pool.counts == warm.Counts(started=2, reused=1, kept=2, ended=1, not_kept=0) and pool.idle == {}


class Resettable:
    """The least a kept actor is: one whose reset frees what it held."""

    def reset(self) -> bool:
        return True


def test_an_actor_that_died_idle_is_ended_not_handed_on(ray_local):
    """An idle actor killed from outside (its node lost, Ray's memory monitor) is found on the next take, ended,
    and a process started for the taker, which used to get the dead one and fail at its first call."""
    import signal

    import ray

    from engines.placement import warm

    make = ray.remote(num_cpus=0)(Resettable).remote
    with warm.keep_warm() as pool:
        first = warm.start("scorer", {"n": 1}, make)
        pid = _actor_pid(first)
        warm.end(first)
        assert pool.counts == warm.Counts(started=1, kept=1)
        os.kill(pid, signal.SIGKILL)
        assert _ended([pid])
        second = warm.start("scorer", {"n": 1}, make)
        assert _actor_pid(second) != pid  # answers: a live process, not the dead one
        assert pool.counts == warm.Counts(started=2, kept=1, ended=1) and pool.idle == {}
        warm.end(second)
        third = warm.start("scorer", {"n": 1}, make)  # a live idle one is still taken
        assert third == second and pool.counts.reused == 1
        warm.end(third, failed=True)


def stages_in_a_worker(model_path: str, idle_s: float) -> dict:
    """In a Ray worker, as tasks/runner.py runs a run's stages: a trainer group (SFT), then two of its shape at
    once (a round's actor and critic), twice; a stage that fails with one; starts that hold GPUs and a rollout
    engine's; the idle ranks left alone for twice `idle_s`; a stage of a run that keeps nothing.

    The stages keep their ranks for a minute: on a loaded machine starting one group of a stage took longer
    than `idle_s`, and the reaper ended the rank its second group was to take. `idle_s` is set after them."""
    import ray

    from alignflow.config import EngineConfig
    from engines.placement import warm
    from engines.train.group import TrainerGroup
    from engines.train.spec import EngineSpec

    spec = EngineSpec.from_config(EngineConfig(learning_rate=1e-2, warmup_steps=0), model_path=model_path,
                                  kind="causal", total_steps=10, global_batch=8, dtype="float32", torch_threads=1,
                                  seed=0)

    def pids(groups: list) -> list[int]:
        return sorted(p for g in groups for p in ray.get([w.__ray_call__.remote(lambda self: os.getpid())
                                                          for w in g.workers]))

    seen: dict = {"pids": [], "counts": []}
    for size in (1, 2, 2):  # a stage each
        pool = warm.between_stages(60.0)
        groups = [TrainerGroup(spec, 1) for _ in range(size)]
        seen["pids"].append(pids(groups))
        for g in groups:
            g.shutdown()
        seen["counts"].append(dict(vars(pool.counts)))
    seen["same_pool"] = warm.between_stages(60.0) is pool
    group = TrainerGroup(spec, 1)  # a stage that fails: its rank ends
    seen["failed_pid"] = pids([group])[0]
    group.shutdown(failed=True)
    before = dict(vars(pool.counts))
    marker = object()
    made = [warm.take(warm.trainer_shape(1, {"num_cpus": 1, "num_gpus": 1}, 1, None), 1),
            warm.start("scorer", {"num_cpus": 1, "num_gpus": 0.5}, lambda: marker),
            warm.start("rollout", {"model": model_path}, lambda: marker)]
    seen["not_this_pools"] = made == [None, marker, marker] and not pool._owned and vars(pool.counts) == before
    assert warm.between_stages(idle_s) is pool  # a later stage's keep_warm_s holds from now on
    time.sleep(2 * idle_s)
    deadline = time.monotonic() + 60  # the reaper's ray.kill, on a loaded machine
    while pool.counts.ended < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    seen.update(after=dict(vars(pool.counts)), idle=len(pool.idle))
    group = TrainerGroup(spec, 1)
    warm.between_stages(0)  # a stage of a run with infra.keep_warm_s=0: the pool closed, nothing kept after
    group.shutdown()
    for t in [t for t in threading.enumerate() if t.name == "alignflow-warm-idle"]:
        t.join(10)
    reapers = [t for t in threading.enumerate() if t.name == "alignflow-warm-idle"]
    seen.update(closed=warm._active is None and not reapers, last=dict(vars(pool.counts)))
    return seen


def test_a_runs_stages_in_one_worker_hand_on_their_ranks_and_idle_ones_end_alone(ray_local, tiny_model):
    from engines.placement import warm

    assert warm.between_stages(1.0) is None, "a driver (this test's process) got a pool that nothing closes"
    task = ray_local.remote(num_cpus=0)(stages_in_a_worker)
    seen = ray_local.get(task.remote(str(tiny_model), 1.0), timeout=1200)  # a hang's guard: three ranks' starts
    sft, round_1, round_2 = seen["pids"]
    assert sft[0] in round_1 and round_2 == round_1 and seen["same_pool"], seen  # SFT's rank, then round 1's two
    assert seen["counts"] == [{"started": 1, "reused": 0, "kept": 1, "ended": 0, "not_kept": 0},
                              {"started": 2, "reused": 1, "kept": 3, "ended": 0, "not_kept": 0},
                              {"started": 2, "reused": 3, "kept": 5, "ended": 0, "not_kept": 0}], seen["counts"]
    assert seen["failed_pid"] in round_2 and _ended([seen["failed_pid"]], timeout_s=30), "a failed stage kept its rank"
    assert seen["not_this_pools"], "a start that holds a GPU, or a rollout engine's, went through the stage pool"
    # The rank left idle ended on its own, past keep_warm_s; then a run that keeps nothing closed the pool.
    assert seen["after"] == {"started": 2, "reused": 4, "kept": 5, "ended": 1, "not_kept": 0} and seen["idle"] == 0
    assert _ended(round_2, timeout_s=30), "idle ranks' processes outlived keep_warm_s"
    assert seen["closed"] and seen["last"]["kept"] == 5 and seen["last"]["started"] == 3, seen
