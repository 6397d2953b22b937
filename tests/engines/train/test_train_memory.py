"""Memory options and the GPU-shaped paths that run on CPUs too, on real engines.

- Micro-batches with gradient accumulation (ZeRO-0 and ZeRO-2), two ranks, and
  gradient checkpointing give the weights of one whole-batch step of the token-mean
  SFT loss over responses of different lengths; and of KTO, whose reference point
  is taken over the whole step.
- A tied-embedding model takes a weight update in the HF rollout backend.
- A colocated round (one placement group, engines sleeping while the models
  train) runs and learns; a sleeping engine refuses work, so a wrong order fails.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("warm_actors")]  # engines/placement/warm.py

LR = 1e-2


@pytest.fixture(scope="module")
def sft_batch(tokenizer):
    from alignflow.config import SyntheticTaskConfig
    from alignflow.data import synthetic
    from engines.batches import sft_tensors

    data = synthetic.generate(SyntheticTaskConfig(num_sft=8, num_preference=1, num_eval=1, num_rl_prompts=1), seed=0)
    tensors, _ = sft_tensors(tokenizer, data["sft"], 64, 16)
    # The synthetic answers are all 2 tokens long; the loss also covers the last i % 5 prompt tokens of
    # row i, so the rows count 2 to 6 loss tokens, as responses of different lengths would.
    mask = tensors["loss_mask"]
    for i in range(len(mask)):
        first = int(mask[i].nonzero()[0])
        mask[i, first - i % 5:first] = 1
    return tensors


def _one_step(tiny_model, batch, workers: int = 1, weigh=None, objective=None,
              **engine) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """One step of `objective` (default: SFT, the token mean of the response NLL), weighed by `weigh`
    (default: response tokens)."""
    from alignflow.config import EngineConfig
    from safetensors.torch import load

    from engines.batches import shard
    from engines.train import objectives
    from engines.train.group import TrainerGroup
    from engines.train.spec import EngineSpec

    cfg = EngineConfig(learning_rate=LR, warmup_steps=0, **engine)
    spec = EngineSpec.from_config(cfg, model_path=str(tiny_model), kind="causal", total_steps=10, global_batch=8,
                                  dtype="float32", torch_threads=1, seed=0)
    group = TrainerGroup(spec, workers)
    try:
        metrics = group.train_step(shard(batch, workers), objective or objectives.causal_lm_objective,
                                   weigh=weigh or objectives.response_tokens)
        return load(group.weights_bytes()), metrics
    finally:
        group.shutdown()


def test_micro_batches_and_checkpointing_match_one_batch(ray_local, tiny_model, sft_batch):
    from engines.transport.wire import checkpoint_shapes

    whole, m_whole = _one_step(tiny_model, sft_batch)
    before = checkpoint_shapes(str(tiny_model))
    assert set(whole) == set(before)
    # The rows' response lengths differ, so the micro-batches (and ranks) hold different token counts.
    lengths = sft_batch["loss_mask"][:, 1:].sum(-1)
    assert len(set(lengths.tolist())) > 1, lengths
    variants = {
        "micro 3 (3+3+2 rows)": dict(micro_batch_size=3),
        "micro 3, ZeRO-2": dict(micro_batch_size=3, zero_stage=2),
        "micro 4, checkpointing": dict(micro_batch_size=4, gradient_checkpointing=True),
        "2 ranks of 4 rows, micro 3 (3+1)": dict(workers=2, micro_batch_size=3),
    }
    for name, engine in variants.items():
        weights, metrics = _one_step(tiny_model, sft_batch, **engine)
        # Adam's first step is about lr * sign(g): where a gradient is near 0, fp32 rounding of the
        # accumulation order can move an element by a fraction of lr. The gradient norm (below)
        # pins the scale, which Adam's step alone would hide.
        diff = max((weights[k] - whole[k]).abs().max().item() for k in whole)
        assert diff < 1e-2 * LR, f"{name}: weights differ from the whole-batch step by {diff}"
        assert metrics["loss"] == pytest.approx(m_whole["loss"], abs=1e-5), name
        assert metrics["grad_norm"] == pytest.approx(m_whole["grad_norm"], rel=1e-4), name
    # Weighed by rows, as if the loss were a mean over rows, the micro-batches' token means are mixed in
    # the wrong proportions: the step is not the whole batch's.
    from engines.train import objectives

    _, by_rows = _one_step(tiny_model, sft_batch, weigh=objectives.per_row, micro_batch_size=3)
    assert abs(by_rows["loss"] - m_whole["loss"]) > 1e-4
    # The step moved the weights (the comparison above is not between untouched copies).
    from safetensors.torch import load_file

    start = load_file(str(tiny_model / "model.safetensors"))
    assert max((whole[k] - start[k]).abs().max().item() for k in whole) > 1e-4


@pytest.fixture(scope="module")
def kto_batch(tiny_model, tokenizer):
    """8 KTO examples (4 pairs' chosen and rejected rows) with their mismatched rows. The reference
    log-probabilities are the starting policy's less 0-6 nats: implicit rewards the loss is sensitive to,
    z0 > 0 (not clamped), and rows far enough apart that each alone would give its own z0."""
    from alignflow.config import SyntheticTaskConfig
    from alignflow.data import synthetic
    from engines.models import load_policy
    from engines.train.preference import preference_tensors, sequence_logps

    data = synthetic.generate(SyntheticTaskConfig(num_sft=1, num_preference=4, num_eval=1, num_rl_prompts=1), seed=0)
    rows = preference_tensors(tokenizer, data["preference"], 64, 16)
    policy = load_policy(str(tiny_model)).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ref = sequence_logps(policy, rows.main) - 4.0 * torch.rand(8, generator=g)
        ref_kl = sequence_logps(policy, rows.kl) - 6.0 * torch.rand(8, generator=g)
    return {**rows.main, **{f"kl_{k}": v for k, v in rows.kl.items()}, "desirable": rows.desirable,
            "ref_logps": ref, "ref_kl_logps": ref_kl}


def test_kto_in_micro_batches_on_two_ranks_takes_the_whole_steps_reference_point(ray_local, tiny_model, kto_batch):
    from engines.micro_batching import micro_batches
    from engines.models import load_policy
    from engines.train import objectives
    from engines.train.preference import KTOObjective, kto_reference_point, sequence_logps

    objective = KTOObjective(beta=1.0, desirable_weight=1.0, undesirable_weight=1.5)
    whole, m_whole = _one_step(tiny_model, kto_batch, objective=objective, weigh=objectives.per_row)
    split, m_split = _one_step(tiny_model, kto_batch, workers=2, objective=objective, weigh=objectives.per_row,
                               micro_batch_size=1)
    # z0 by hand: the starting policy's log-likelihood of each mismatched row, less the reference's, averaged.
    policy = load_policy(str(tiny_model)).eval()
    kl_rows = {k.removeprefix("kl_"): v for k, v in kto_batch.items() if k.startswith("kl_")}
    with torch.no_grad():
        z0 = (sequence_logps(policy, kl_rows) - kto_batch["ref_kl_logps"]).mean().item()
        alone = [kto_reference_point(policy, [m], "cpu").item() for m in micro_batches(kto_batch, 1)]
    assert z0 > 0 and max(abs(a - z0) for a in alone) > 1.0  # one row's z0 is not the step's
    for m in (m_whole, m_split):
        assert m["kl_reference_point"] == pytest.approx(z0, rel=1e-5)
    assert m_split["loss"] == pytest.approx(m_whole["loss"], abs=1e-6)
    assert m_split["grad_norm"] == pytest.approx(m_whole["grad_norm"], rel=1e-4)
    assert max((split[k] - whole[k]).abs().max().item() for k in whole) < 1e-2 * LR


def test_tied_embeddings_take_a_weight_update_in_the_hf_backend(tmp_path, sft_batch):
    import threading

    from alignflow.config import TinyModelConfig
    from alignflow.net import free_port
    from engines.models import build_tiny_model, load_policy, weight_shapes
    from engines.rollout.base import Sampling
    from engines.rollout.hf_engine import HFEngine
    from engines.transport.wire import TransportGroup, pack, plan_buckets, send_buckets

    path = build_tiny_model(TinyModelConfig(tie_word_embeddings=True), seed=0, out_dir=tmp_path / "tied")
    trainer_side = load_policy(path)
    assert trainer_side.lm_head.weight is trainer_side.model.embed_tokens.weight
    names = weight_shapes(trainer_side)
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names  # sent once
    with torch.no_grad():
        trainer_side.model.embed_tokens.weight.add_(torch.randn_like(trainer_side.model.embed_tokens.weight))
    state = {k: v.detach() for k, v in trainer_side.state_dict().items() if k in names}
    specs = [(k, tuple(v.shape), "float32") for k, v in state.items()]

    engine = HFEngine(str(path), seed=0)
    engine.prepare_weights(specs, 2**16)
    address = ("127.0.0.1", free_port())
    joining = threading.Thread(target=engine.join_transport, args=(address, 1, 2, "gloo"))
    joining.start()
    sender = TransportGroup(address, 0, 2, "gloo")
    joining.join()

    def push() -> None:  # the engine receives in this thread, the "trainer" sends from a second one
        sending = threading.Thread(target=send_buckets, args=(sender, plan_buckets(specs, 2**16),
                                                              lambda b, out: pack(b, state, "cpu", out)))
        sending.start()
        try:
            engine.receive_weights()
        finally:
            sending.join()

    engine.sleep()
    with pytest.raises(RuntimeError, match="wake it first"):
        engine.receive_weights()  # refused before anything is received: the sender has not started
    engine.wake(["weights"])
    push()  # the weights are awake; the KV cache need not be
    with pytest.raises(RuntimeError, match="wake it first"):
        engine.generate([[1, 2, 3]], Sampling(max_new_tokens=2))
    engine.wake(["kv_cache"])
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    torch.testing.assert_close(engine.model.lm_head.weight, trainer_side.lm_head.weight, rtol=0, atol=0)
    ids = sft_batch["input_ids"][:2]
    with torch.no_grad():
        torch.testing.assert_close(engine.model(input_ids=ids).logits, trainer_side(input_ids=ids).logits)
    assert engine.generate([[1, 2, 3]], Sampling(max_new_tokens=2))


def parity_reward(prompt: str, response: str, answer: str | None) -> float:
    return float(sum(map(ord, response)) % 2)


def test_colocated_round_sleeps_engines_and_learns(ray_local, tiny_model, tokenizer):
    import ray

    from alignflow.config import ActorConfig, PPOConfig, RewardConfig, RolloutConfig, RoundConfig, SyntheticTaskConfig
    from alignflow.data import synthetic
    from engines.batches import filter_prompts
    from engines.models import load_policy
    from engines.rl.round import RLRound
    from engines.rl.round_models import RoundSetup
    from engines.train.objectives import response_logprobs

    data = synthetic.generate(SyntheticTaskConfig(num_sft=1, num_preference=1, num_eval=1, num_rl_prompts=16), seed=0)
    prompts, _ = filter_prompts(tokenizer, data["prompts"], 64, "prompts")
    cfg = RoundConfig(algorithm="grpo", steps=2, prompts_per_step=8, colocate_all=True,
                      generation=RolloutConfig(backend="hf", num_samples=4, max_new_tokens=4),
                      reward=RewardConfig(source="rule", rule=f"{__name__}:parity_reward"),
                      ppo=PPOConfig(minibatch_size=32, epochs=1), actor=ActorConfig(learning_rate=1e-2))
    path = str(tiny_model)
    rl = RLRound(cfg, RoundSetup(policy_path=path, reference_path=path, reward_path=None, prompts=prompts,
                                 dtype="float32", torch_threads=1, max_model_len=80, seed=0))
    try:
        pg = rl.models.placement_group
        assert pg is not None and len(pg.bundle_specs) == 1
        reports = [*rl.models.actor.device_reports(), ray.get(rl.models.reference.device_report.remote()),
                   *ray.get([e.device_report.remote() for e in rl.models.engines.actors])]
        assert {r["placement_group"] for r in reports} == {pg.id.hex()}, reports
        assert all(r.get("device", "cpu") == "cpu" for r in reports)
        first = rl.step(0)
        probe = first.experience.tensors()
        with torch.no_grad():  # the policy the step started from: the model on disk
            before = response_logprobs(load_policy(tiny_model).eval(), probe)
        after = rl.models.actor.evaluate(probe, response_logprobs)
        second = rl.step(1)  # generates: only possible if the sync woke the engines in order
        assert len(second.rollouts) == 32
        # What the round asked of the engine, in order (SleepState.events): each step generates, sleeps while
        # the models train, wakes its weights, takes the update, wakes its KV cache.
        [log] = rl.models.engines.events()
        cycle = ["generate", "sleep", "wake weights", "update weights", "wake kv_cache"]
        assert log["events"] == cycle * 2 and log["count"] == 10 and log["asleep"] == [], log
        # Learns: step 0's rewarded responses gained log-probability against its unrewarded ones.
        rewards, mask = first.experience.rewards, first.experience.action_mask
        gained = ((after - before) * mask).sum(-1)
        assert 0 < rewards.sum() < len(rewards)
        assert gained[rewards == 1].mean() > gained[rewards == 0].mean(), gained
    finally:
        rl.shutdown()
    assert not any(p["state"] == "CREATED" and p["placement_group_id"] == pg.id.hex()
                   for p in ray.util.placement_group_table().values())
