"""`placement.cpu_cores`: each role's processes pinned to its cores, with a thread per core. Placement
groups (engines/placement/groups.py): one the cluster can hold waits while others hold its resources;
one no node can hold fails, naming it."""

from __future__ import annotations

import os

import pytest
import torch
from pydantic import ValidationError

from alignflow.config import Placement

CORES = sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize("cores", [[], [0, 0], [-1]])
def test_cpu_cores_must_be_distinct_core_numbers(cores):
    with pytest.raises(ValidationError, match="cpu_cores"):
        Placement(cpu_cores=cores)


@pytest.mark.engine
def test_each_role_runs_on_its_cores_with_a_thread_per_core(ray_local, tiny_model, tokenizer):
    import ray

    from alignflow.config import RoundConfig, SyntheticTaskConfig
    from alignflow.data import synthetic
    from engines.batches import filter_prompts
    from engines.models import load_policy
    from engines.rl.round import RLRound
    from engines.rl.round_models import RoundSetup
    from engines.train.objectives import response_logprobs

    generate_on, train_on = [CORES[0]], [CORES[-1]]  # one core each (the same one on a 1-core machine)
    data = synthetic.generate(SyntheticTaskConfig(num_sft=1, num_preference=1, num_eval=1, num_rl_prompts=8), seed=0)
    prompts, _ = filter_prompts(tokenizer, data["prompts"], 64, "prompts")
    cfg = RoundConfig.model_validate({
        "algorithm": "grpo", "steps": 1, "prompts_per_step": 4, "reward": {"source": "rule"},
        "generation": {"backend": "hf", "num_samples": 2, "max_new_tokens": 4,
                       "placement": {"cpu_cores": generate_on}},
        "kl": {"coef": 0.04, "estimator": "k3", "apply_as": "loss"},
        "ppo": {"epochs": 1, "minibatch_size": 8},
        "actor": {"placement": {"cpu_cores": train_on}}, "scorer_placement": {"cpu_cores": train_on}})
    path = str(tiny_model)
    rl = RLRound(cfg, RoundSetup(policy_path=path, reference_path=path, reward_path=None, prompts=prompts,
                                 dtype="float32", torch_threads=2, max_model_len=80, seed=0))
    try:
        actor, = rl.models.actor.device_reports()
        scorer = ray.get(rl.models.reference.device_report.remote())
        engine, = ray.get([e.device_report.remote() for e in rl.models.engines.actors])
        assert (actor["cpu_affinity"], actor["torch_threads"]) == (train_on, 1)
        assert (scorer["cpu_affinity"], scorer["torch_threads"]) == (train_on, 1)
        assert (engine["cpu_affinity"], engine["torch_threads"]) == (generate_on, 1)
        step = rl.step(0)
        assert len(step.rollouts) == 8
        # The reference (on the trainer's core) scored them: its log-probabilities are the model's, recomputed here.
        exp = step.experience
        with torch.no_grad():
            local = response_logprobs(load_policy(tiny_model).eval(), exp.tensors())
        mask = exp.action_mask.bool()
        torch.testing.assert_close(exp.ref_logprobs[mask], local[mask], rtol=0, atol=1e-5)
    finally:
        rl.shutdown()


@pytest.mark.engine
def test_a_core_the_node_lacks_is_named(ray_local, tiny_model):
    import ray

    from engines.rl.scoring import start_scorer

    scorer = start_scorer(str(tiny_model), None, dtype="float32", torch_threads=1, cpu_cores=[4096])
    with pytest.raises(Exception, match=r"placement.cpu_cores: cores \[4096\] are not available"):
        ray.get(scorer.device_report.remote())
    ray.kill(scorer)


def test_a_scorer_without_gpus_says_its_cpu_cores_and_resources_are_not_applied(tiny_model, caplog):
    # Without GPUs the scorer runs in the task's process: pinning it would pin that process for good.
    from engines.rl.scoring import scoring

    threads = torch.get_num_threads()
    with caplog.at_level("WARNING", logger="alignflow"):
        with scoring(str(tiny_model), None, num_cpus=1, num_gpus=0, cpu_cores=[0], resources={"node:a": 0.01},
                     dtype="float32", torch_threads=1) as call:
            assert call("device_report")
    torch.set_num_threads(threads)  # the in-process scorer set this process's
    assert [r.getMessage() for r in caplog.records] == [
        "placement.cpu_cores [0] of a scorer is not applied: without GPUs it scores in the task's own process, "
        "which is not pinned (the scorer's num_gpus > 0 gives it a process)",
        "placement.resources {'node:a': 0.01} of a scorer is not applied: without GPUs it scores in the task's own "
        "process, on the node the task runs on (the scorer's num_gpus > 0 gives it a process placed by them)"]
    assert os.sched_getaffinity(0) != {0} or os.cpu_count() == 1


def test_placement_fits_counts_nodes_and_the_strategy():
    from engines.placement.groups import placement_fits

    two = [{"CPU": 8.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 1.0}]
    gpus = [{"CPU": 0.0, "GPU": 1.0}, {"CPU": 0.0, "GPU": 1.0}]
    assert placement_fits(gpus, "PACK", two)
    assert not placement_fits(gpus, "STRICT_PACK", two)  # one node must hold both
    assert placement_fits(gpus, "STRICT_PACK", [{"CPU": 2.0, "GPU": 2.0}])
    assert not placement_fits([{"GPU": 2.0}], "PACK", two)  # a bundle never splits across nodes
    assert placement_fits([{"CPU": 6.0}] * 2, "PACK", two)
    assert not placement_fits([{"CPU": 6.0}] * 3, "PACK", two)  # each fits a node, all three do not
    assert not placement_fits([{"CPU": 1.0, "accel": 1.0}], "PACK", two)
    assert placement_fits([{"CPU": 1.0, "GPU": 0.0}], "PACK", [{"CPU": 1.0}])  # what a bundle asks 0 of, no node needs


@pytest.mark.engine
def test_a_busy_placement_group_waits_and_one_no_node_holds_fails(ray_local, caplog):
    """Stages that became ready together queue for one GPU: the group that waits past the timeout for
    resources the cluster has is served once they are free; one no node can hold fails."""
    import threading
    import time

    import ray
    from ray.util import placement_group, placement_group_table, remove_placement_group

    from alignflow.errors import InsufficientResourcesError
    from engines.placement.groups import wait_placement_group

    cpus = ray.cluster_resources()["CPU"]

    class Holder:
        def ping(self) -> bool:
            return True

    holder = ray.remote(num_cpus=cpus)(Holder).remote()  # another stage's actors: every CPU slot
    assert ray.get(holder.ping.remote())
    pg, outcome = placement_group([{"CPU": 1.0}], strategy="PACK"), []

    def wait() -> None:
        try:
            wait_placement_group(pg, "busy group", "PACK", timeout_s=0.5, poll_s=0.2, say_every_s=60)
            outcome.append("reserved")
        except BaseException as e:  # noqa: BLE001  (the test reads it)
            outcome.append(e)

    waiter = threading.Thread(target=wait)
    with caplog.at_level("WARNING", logger="alignflow"):
        waiter.start()
        time.sleep(3.0)  # six times the timeout
        assert waiter.is_alive() and outcome == []
        ray.kill(holder)
        waiter.join(60)
    assert outcome == ["reserved"]
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("busy group: waiting")]
    assert len(said) == 1 and "the cluster has it, other stages hold it now" in said[0]  # once in 60 s
    remove_placement_group(pg)

    for bundles, strategy in (([{"CPU": cpus + 1}], "PACK"), ([{"CPU": cpus / 2 + 1}] * 2, "STRICT_PACK")):
        too_big = placement_group(bundles, strategy=strategy)
        started = time.monotonic()
        with pytest.raises(InsufficientResourcesError, match=rf"too big: no node of this Ray cluster can hold .*{strategy}"):
            wait_placement_group(too_big, "too big", strategy, timeout_s=0.5, poll_s=0.2)
        assert time.monotonic() - started < 30
        assert placement_group_table(too_big)["state"] == "REMOVED"


@pytest.mark.engine
def test_a_trainer_groups_ranks_start_together_or_not_at_all(ray_local, tiny_model):
    """Placed one by one, a group's first rank would start and wait in its rendezvous, holding its slot (on
    GPUs, its GPU), while another stage holds what the second needs: two such stages wait on each other.
    The ranks are one placement group: none starts until all can, and the group goes with them."""
    import threading
    import time

    import ray
    from ray._private import state  # the GCS's actor table
    from ray.util import placement_group_table

    from engines.train.group import TrainerGroup
    from engines.train.spec import EngineSpec

    def trainers() -> list[str]:
        return [a["State"] for a in state.actors().values() if a["ActorClassName"] == "TrainWorker"
                and a["State"] != "DEAD"]

    class Holder:
        def ping(self) -> bool:
            return True

    holder = ray.remote(num_cpus=ray.cluster_resources()["CPU"] - 1)(Holder).remote()  # room for one rank
    assert ray.get(holder.ping.remote()) and trainers() == []
    spec = EngineSpec(model_path=str(tiny_model), kind="causal", learning_rate=1e-3, weight_decay=0.0, warmup_steps=0,
                      total_steps=1, zero_stage=0, global_batch=2, grad_clip=1.0, seed=0, torch_threads=1)
    made: list = []

    def start() -> None:
        try:
            made.append(TrainerGroup(spec, 2))
        except BaseException as err:  # noqa: BLE001  (said below, not lost in the thread)
            made.append(err)

    starting = threading.Thread(target=start)
    starting.start()
    time.sleep(3.0)
    assert starting.is_alive() and trainers() == []  # not one rank while the second cannot start
    ray.kill(holder)
    starting.join(600)  # two ranks' start and DeepSpeed's init: ~15 s on a quiet machine, much more on a busy one
    assert not starting.is_alive() and made and not isinstance(made[0], BaseException), made
    group = made[0]
    try:
        groups = {r["placement_group"] for r in group.device_reports()}
        assert len(groups) == 1 and None not in groups, groups
        pg = group.placement_group
    finally:
        group.shutdown()
    assert placement_group_table(pg)["state"] == "REMOVED"
