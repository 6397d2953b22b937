"""`placement.cpu_cores`: each role's processes pinned to its cores, with a thread per core."""

from __future__ import annotations

import os

import pytest
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
    from engines.rl import RLRound
    from engines.round_models import RoundSetup

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
        assert len(step.rollouts) == 8 and step.metrics["kl_to_reference"] >= 0  # the reference scored them
    finally:
        rl.shutdown()


@pytest.mark.engine
def test_a_core_the_node_lacks_is_named(ray_local, tiny_model):
    import ray

    from engines.scoring import start_scorer

    scorer = start_scorer(str(tiny_model), None, dtype="float32", torch_threads=1, cpu_cores=[4096])
    with pytest.raises(Exception, match=r"placement.cpu_cores: cores \[4096\] are not available"):
        ray.get(scorer.device_report.remote())
    ray.kill(scorer)
