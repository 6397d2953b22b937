"""The DeepSpeed training engine on Ray (CPU, gloo) with the tiny model: learning, exact resume, HF export."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math

import pytest
import torch
from safetensors.torch import load

from alignflow.config import SyntheticTaskConfig
from alignflow.data import synthetic
from engines import batches
from engines.train import objectives
from engines.train.group import TrainerGroup
from engines.train.spec import EngineSpec
from engines.train.supervised import plan

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("warm_actors")]  # engines/placement/warm.py

SFT_STEPS = 30
BATCH = 16


@pytest.fixture(scope="module")
def splits():
    return synthetic.generate(SyntheticTaskConfig(num_sft=128, num_preference=64, num_rl_prompts=1, num_eval=1), seed=0)


@pytest.fixture(scope="module")
def sft_data(splits, tokenizer):
    data, _ = batches.sft_tensors(tokenizer, splits["sft"], max_prompt_tokens=64, max_response_tokens=8)
    return data


def _spec(model_path, kind: str, **kw) -> EngineSpec:
    base = dict(model_path=str(model_path), kind=kind, learning_rate=3e-3, weight_decay=0.0, warmup_steps=3,
                total_steps=SFT_STEPS + 10, zero_stage=0, global_batch=BATCH, grad_clip=1.0, seed=0, torch_threads=1)
    return EngineSpec(**{**base, **kw})


def _batch(data, schedule, step):
    return batches.take(data, schedule.indices(step))


@pytest.fixture(scope="module")
def sft_run(ray_local, tiny_model, sft_data):
    """One SFT group trained for SFT_STEPS steps; yields (group, schedule, per-step metrics)."""
    schedule = plan(sft_data["input_ids"].shape[0], BATCH, epochs=100, max_steps=SFT_STEPS + 10, seed=0)
    group = TrainerGroup(_spec(tiny_model, "causal"), num_workers=1)
    history = []
    for step in range(SFT_STEPS):
        shards = batches.shard(_batch(sft_data, schedule, step), group.world_size)
        history.append(group.train_step(shards, objectives.causal_lm_objective, weigh=objectives.response_tokens))
    yield group, schedule, history
    group.shutdown()


def test_sft_reduces_the_loss(sft_run):
    _, _, history = sft_run
    losses = [m["loss"] for m in history]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.7 * first, f"loss {first:.3f} -> {last:.3f}"
    for m in history:
        # At ZeRO-0 DeepSpeed reports no norm; the worker computes it.
        assert set(m) >= {"loss", "response_length", "lr", "grad_norm"} and m["grad_norm"] > 0
        assert m["response_length"] == 2  # one digit + EOS per row
    # Warmup (3 steps: (s + 1) / 3 of the peak) then decay; each step reports the rate it took, not the next's.
    assert [m["lr"] for m in history[:4]] == pytest.approx([3e-3 / 3, 3e-3 * 2 / 3, 3e-3, 3e-3])
    assert max(m["lr"] for m in history) == pytest.approx(3e-3)


def _loss(model, batch) -> float:
    return float(objectives.causal_lm_objective(model, batch)[1]["loss"])


def test_resume_is_exact(sft_run, tiny_model, sft_data, tmp_path):
    group, schedule, _ = sft_run
    group.save_state(str(tmp_path), {"step": SFT_STEPS, "note": "mid-stage"})
    names = {p.name for p in tmp_path.iterdir()}
    assert {"model.safetensors", "config.json", "trainer-rank0.safetensors", "trainer-rank0.json"} <= names
    assert not any(n.endswith((".pt", ".pkl", ".bin")) for n in names)

    resumed = TrainerGroup(_spec(tiny_model, "causal"), num_workers=1)
    try:
        # Before loading, the new group is the base model: far from the trained one
        # (else this test would pass without any state being restored).
        probe = batches.shard(_batch(sft_data, schedule, SFT_STEPS), 1)[0]
        assert abs(resumed.evaluate(probe, _loss) - group.evaluate(probe, _loss)) > 0.1

        assert resumed.load_state(str(tmp_path)) == {"step": SFT_STEPS, "note": "mid-stage"}
        assert resumed.evaluate(probe, _loss) == pytest.approx(group.evaluate(probe, _loss), abs=1e-6)
        for step in (SFT_STEPS, SFT_STEPS + 1, SFT_STEPS + 2):
            shards = batches.shard(_batch(sft_data, schedule, step), 1)
            original = group.train_step(shards, objectives.causal_lm_objective, weigh=objectives.response_tokens)
            again = resumed.train_step(shards, objectives.causal_lm_objective, weigh=objectives.response_tokens)
            assert original.keys() == again.keys()
            for k in original:
                assert again[k] == pytest.approx(original[k], abs=1e-5, rel=1e-5), f"step {step}: {k}"
        # After the same updates the weights agree too (Adam moments and lr were restored).
        w_original, w_resumed = load(group.weights_bytes()), load(resumed.weights_bytes())
        assert w_original.keys() == w_resumed.keys()
        for k in w_original:
            torch.testing.assert_close(w_resumed[k], w_original[k], rtol=0, atol=1e-6)
    finally:
        resumed.shutdown()


def _sequence_logprobs(model, batch):
    from algos.sequence import shifted_logprobs

    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return shifted_logprobs(out.logits, batch["input_ids"]) * batch["attention_mask"][:, 1:]


def test_save_hf_loads_with_transformers(sft_run, sft_data, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    group, _, _ = sft_run
    group.save_hf(str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.eos_token == "<|end|>"
    batch = batches.take(sft_data, torch.arange(4))
    with torch.no_grad():
        hf = _sequence_logprobs(model, batch)
    engine = group.evaluate(batch, _sequence_logprobs)
    torch.testing.assert_close(hf, engine, rtol=0, atol=1e-5)


def _pair_accuracy_and_loss(model, batch):
    from algos.losses.preference import pairwise_reward_loss

    scores = objectives.scalar_scores(model, batch)
    n = scores.shape[0] // 2
    out = pairwise_reward_loss(scores[:n], scores[n:])
    return float(out.accuracy), float(out.loss)


def test_reward_model_learns_the_training_pairs(ray_local, tiny_model, splits, tokenizer, tmp_path):
    from transformers import AutoModelForSequenceClassification

    pairs, _ = batches.pair_tensors(tokenizer, splits["preference"], max_prompt_tokens=64, max_response_tokens=8)
    n = pairs["input_ids"].shape[0] // 2
    spec = _spec(tiny_model, "scalar", learning_rate=2e-3, total_steps=40, warmup_steps=2)
    group = TrainerGroup(spec, num_workers=1)
    try:
        acc0, loss0 = group.evaluate(pairs, _pair_accuracy_and_loss)
        assert loss0 == pytest.approx(0.6931, abs=1e-3)  # a fresh (zero) head scores every sequence 0
        schedule = plan(n, BATCH, epochs=100, max_steps=40, seed=0)
        for step in range(40):
            idx = schedule.indices(step)
            shards = batches.shard(batches.split_pairs(pairs, idx, n), 1, paired=True)
            metrics = group.train_step(shards, objectives.pairwise_objective, weigh=objectives.per_row)
            assert set(metrics) >= {"loss", "accuracy", "reward_margin"}
        acc1, loss1 = group.evaluate(pairs, _pair_accuracy_and_loss)
        assert acc1 >= 0.75, f"pairwise accuracy {acc0:.2f} -> {acc1:.2f}"
        assert loss1 < loss0 - 0.3

        # The exported reward model scores like the engine.
        group.save_hf(str(tmp_path))
        rm = AutoModelForSequenceClassification.from_pretrained(str(tmp_path)).eval()
        assert rm.config.num_labels == 1
        with torch.no_grad():
            hf_scores = rm(input_ids=pairs["input_ids"], attention_mask=pairs["attention_mask"]).logits.squeeze(-1)
        torch.testing.assert_close(hf_scores, group.evaluate(pairs, objectives.scalar_scores), rtol=0, atol=1e-4)
    finally:
        group.shutdown()


def test_batch_must_divide_across_workers(tiny_model):
    with pytest.raises(ValueError, match="must divide by num_workers"):
        TrainerGroup(dataclasses.replace(_spec(tiny_model, "causal"), global_batch=15), num_workers=2)


# ZeRO-2 saves and loads its state through the same DeepSpeed code as ZeRO-1 (stage_1_and_2).
@pytest.mark.parametrize("zero_stage", [0, 1, 3])
def test_resume_is_exact_under_zero_with_two_workers(ray_local, tiny_model, sft_data, tmp_path, zero_stage):
    """Two ranks (gloo), sharded optimizer state (ZeRO-0: whole on each rank, saved by rank 0 alone): save,
    restore into a fresh group, continue identically."""
    schedule = plan(sft_data["input_ids"].shape[0], BATCH, epochs=100, max_steps=20, seed=0)
    spec = _spec(tiny_model, "causal", zero_stage=zero_stage, total_steps=20)
    first = TrainerGroup(spec, num_workers=2)
    resumed = None
    try:
        for step in range(3):
            first.train_step(batches.shard(_batch(sft_data, schedule, step), 2), objectives.causal_lm_objective,
                             weigh=objectives.response_tokens)
        first.save_state(str(tmp_path), {"step": 3})
        from engines.train.state import load_state

        saved = [load_state(tmp_path, f"trainer-rank{r}")["optimizer"] for r in (0, 1)]
        assert (saved[1] is None) == (zero_stage == 0) and saved[0] is not None
        resumed = TrainerGroup(spec, num_workers=2)
        assert resumed.load_state(str(tmp_path)) == {"step": 3}
        for step in (3, 4):
            shards = batches.shard(_batch(sft_data, schedule, step), 2)
            original = first.train_step(shards, objectives.causal_lm_objective, weigh=objectives.response_tokens)
            again = resumed.train_step(shards, objectives.causal_lm_objective, weigh=objectives.response_tokens)
            for k in ("loss", "lr", "grad_norm"):
                assert again[k] == pytest.approx(original[k], abs=1e-5, rel=1e-5), f"zero {zero_stage} step {step}: {k}"
        w_first, w_resumed = load(first.weights_bytes()), load(resumed.weights_bytes())
        for k in w_first:
            torch.testing.assert_close(w_resumed[k], w_first[k], rtol=0, atol=1e-6)
    finally:
        first.shutdown()
        if resumed is not None:
            resumed.shutdown()


def _last_logits_and_rank(model, batch):
    """Per row: the last position's logits, and the rank that computed them."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, -1].float()
    rank = torch.full((logits.shape[0], 1), float(torch.distributed.get_rank()), device=logits.device)
    return torch.cat([logits, rank], 1)


def test_evaluate_rows_gives_each_rank_its_share_of_the_rows(ray_local, tiny_model, sft_data):
    """Old log-probs and values: each of R ranks computes 1/R of the rows (evaluate has every rank compute
    all of them). At ZeRO-3, where every rank takes part in each forward: 5 rows as 3 + 2 (+1 copy)."""
    group = TrainerGroup(_spec(tiny_model, "causal", zero_stage=3), num_workers=2)
    batch = batches.take(sft_data, torch.arange(5))
    try:
        rows = group.evaluate_rows(batch, _last_logits_and_rank)
        everything = group.evaluate(batch, _last_logits_and_rank)
    finally:
        group.shutdown()
    assert rows[:, -1].tolist() == [0, 0, 0, 1, 1] and everything[:, -1].tolist() == [0] * 5
    torch.testing.assert_close(rows[:, :-1], everything[:, :-1], rtol=0, atol=1e-5)


def test_zero3_partitions_the_model_as_it_loads(ray_local, tiny_model, sft_data):
    """Under ZeRO-3 the model is partitioned as it loads (so a model larger than one GPU loads): each of 2
    ranks holds about half the parameter bytes once loaded, where each used to hold all of them until
    DeepSpeed partitioned them. Together they hold the checkpoint, exactly; and a critic's new head,
    partitioned too, starts at zero."""
    from safetensors.torch import load, load_file

    checkpoint = {k: v for f in sorted(tiny_model.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    whole = sum(v.numel() * v.element_size() for v in checkpoint.values())
    policy = TrainerGroup(_spec(tiny_model, "causal", zero_stage=3), num_workers=2)
    try:
        held = [r["loaded_bytes"] for r in policy.device_reports()]
        assert all(0.4 * whole <= b <= 0.6 * whole for b in held), (held, whole)
        weights = load(policy.weights_bytes())
    finally:
        policy.shutdown()
    assert weights.keys() == checkpoint.keys()
    assert all(torch.equal(weights[k], checkpoint[k]) for k in checkpoint)
    critic = TrainerGroup(_spec(tiny_model, "scalar", zero_stage=3), num_workers=2)
    try:
        assert max(r["loaded_bytes"] for r in critic.device_reports()) <= 0.6 * whole
        scores = critic.evaluate(batches.take(sft_data, torch.arange(4)), objectives.scalar_scores)
    finally:
        critic.shutdown()
    assert scores.shape == (4,) and scores.abs().max().item() == 0.0


def _chunks_of_four_positions(worker) -> None:
    """In a TrainWorker: the output layer runs on 4 positions at a time (engines/train/logits.py)."""
    import engines.train.logits

    engines.train.logits.CHUNK_ELEMENTS = 4 * engines.train.logits.unwrap(worker.engine).config.vocab_size


def _in_time(fn, seconds: float = 120.0):
    """fn() in a thread; a TimeoutError if it has not returned by then (ranks out of step hang: the
    group is killed after, which ends the thread's wait)."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        return pool.submit(fn).result(timeout=seconds)
    finally:
        pool.shutdown(wait=False)


def test_zero3_ranks_call_partitioned_modules_in_step(ray_local, tiny_model, sft_data):
    """Under ZeRO-3 each call of a partitioned module gathers its weights from every rank, so the ranks
    must make as many calls; a rank with fewer crashes the group or hangs it. (1) A step whose
    shards hold 16 and 8 loss tokens, with the output layer on 4 positions at a time (4 and 2 calls):
    the weights of the same step in one call each. (2) Then a policy step on rollout rows where rank 0's
    share repeats a prompt (a shared-prefix forward: two model calls) and rank 1's does not (one)."""
    import ray
    from safetensors.torch import load

    from engines.rl import experience
    from engines.rollout.base import Rollout

    batch = batches.take(sft_data, torch.arange(BATCH))
    mask = batch["loss_mask"].clone()
    for i in range(BATCH // 2, BATCH):  # the second shard: one loss token per row
        first = int(mask[i].nonzero()[0])
        mask[i] = 0
        mask[i, first] = 1
    batch["loss_mask"] = mask
    assert [int(s["loss_mask"][:, 1:].sum()) for s in batches.shard(batch, 2)] == [16, 8]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 200, (12,), generator=g).tolist()
    rollouts = [Rollout(0 if i < 3 else i, prompt if i < 3 else torch.randint(3, 200, (12,), generator=g).tolist(),
                        torch.randint(3, 200, (3,), generator=g).tolist(), "", [0.0] * 3, True) for i in range(6)]
    rows = experience.from_rollouts(rollouts, pad_id=0).tensors()
    rows["advantages"] = torch.randn(rows["action_mask"].shape, generator=g) * rows["action_mask"]
    policy = functools.partial(objectives.policy_objective, clip_low=0.2, clip_high=0.2, dual_clip=None,
                               agg="token_mean", entropy_coef=0.0, kl_loss_coef=0.0, kl_estimator="k3",
                               kl_clamp=None, tis_cap=None, on_policy=True)
    spec = _spec(tiny_model, "causal", zero_stage=3)
    weights, metrics = [], []
    for chunked in (False, True):
        group = TrainerGroup(spec, num_workers=2)
        try:
            if chunked:
                ray.get([w.__ray_call__.remote(_chunks_of_four_positions) for w in group.workers])
            sft = _in_time(lambda: group.train_step(batches.shard(batch, 2), objectives.causal_lm_objective,
                                                    weigh=objectives.response_tokens))
            rl = _in_time(lambda: group.train_step(batches.shard(rows, 2), policy,
                                                   weigh=functools.partial(objectives.aggregated, agg="token_mean")))
            metrics.append((sft, rl))
            weights.append(load(group.weights_bytes()))
        finally:
            group.shutdown()
    (sft_0, rl_0), (sft_1, rl_1) = metrics
    assert sft_1["loss"] == pytest.approx(sft_0["loss"], abs=1e-6)
    assert sft_1["grad_norm"] == pytest.approx(sft_0["grad_norm"], rel=1e-5)
    assert rl_1["grad_norm"] == pytest.approx(rl_0["grad_norm"], rel=1e-4)
    # Adam's steps are about lr * sign(g): rounding where g is near 0 moves an element by a fraction of lr.
    assert max((weights[1][k] - weights[0][k]).abs().max().item() for k in weights[0]) < 1e-2 * spec.learning_rate


def _state_out_and_back(worker) -> None:
    """In a TrainWorker: its optimizer state offloaded to CPU memory and reloaded, as a colocated round does
    around generation (on a GPU; here on the CPU, where both moves stay on the CPU)."""
    from engines.train.spec import move_training_state

    move_training_state(worker.engine, worker.spec.zero_stage, offload=True, device=worker.device)
    move_training_state(worker.engine, worker.spec.zero_stage, offload=False, device=worker.device)


def _optimizer_state_bytes(worker) -> tuple[int, int, list[str]]:
    """In a TrainWorker: bytes of what a colocated round moves off the GPU (engines/train/spec.py: optimizer_tensors),
    its trainable parameters, and the dtypes of its model's weights."""
    from engines.train.spec import optimizer_tensors

    params = [p for p in worker.engine.module.parameters() if p.requires_grad]
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in params)  # ZeRO-3: the full size of a partitioned one
    state = sum(t.numel() * t.element_size() for t in optimizer_tensors(worker.engine.optimizer))
    return state, numel, sorted({str(p.dtype) for p in params})


@pytest.mark.parametrize("zero_stage, dtype, per_param", [(0, "bfloat16", 12), (3, "bfloat16", 12), (0, "float32", 8)])
def test_the_offloaded_optimizer_state_is_masters_and_moments(ray_local, tiny_model, sft_data, zero_stage, dtype,
                                                              per_param):
    """In bf16 DeepSpeed keeps fp32 master weights beside the model's: a colocated round must move them off
    the GPU with Adam's two moments, 12 bytes per parameter (ZeRO-0 missed the 4 of the masters before).
    In fp32 the optimizer steps the model's own weights, which stay: the moments, 8 bytes."""
    import ray

    schedule = plan(sft_data["input_ids"].shape[0], BATCH, epochs=100, max_steps=20, seed=0)
    group = TrainerGroup(_spec(tiny_model, "causal", zero_stage=zero_stage, dtype=dtype), num_workers=1)
    try:
        group.train_step(batches.shard(_batch(sft_data, schedule, 0), 1), objectives.causal_lm_objective,
                         weigh=objectives.response_tokens)  # Adam's moments exist after a first step
        [(state, numel, dtypes)] = ray.get([w.__ray_call__.remote(_optimizer_state_bytes) for w in group.workers])
        assert dtypes == [f"torch.{dtype}"]
        assert state == per_param * numel, (state, numel)
    finally:
        group.shutdown()


@pytest.mark.parametrize("zero_stage", [0, 3])  # ZeRO-2 keeps its state as ZeRO-1 does (stage_1_and_2)
def test_offloading_and_reloading_the_optimizer_state_leaves_training_unchanged(ray_local, tiny_model, sft_data,
                                                                                zero_stage):
    """ZeRO-3's own offload moves master weights and Adam moments only for DeepSpeed's FusedAdam (it asserts
    so); the trainer's optimizer is torch's AdamW, so those two move here. Steps after a round trip equal
    the steps of a group that never offloaded. On the CPU both ends of the round trip are the CPU: what
    this catches here is a round trip that loses or changes the state; that the state leaves the device
    only a GPU shows (tests/gpu: test_optimizer_state_leaves_the_gpu_and_comes_back)."""
    import ray

    schedule = plan(sft_data["input_ids"].shape[0], BATCH, epochs=100, max_steps=20, seed=0)
    spec = _spec(tiny_model, "causal", zero_stage=zero_stage, total_steps=20)
    plain, moved = TrainerGroup(spec, num_workers=1), TrainerGroup(spec, num_workers=1)
    try:
        for step in range(4):
            shards = batches.shard(_batch(sft_data, schedule, step), 1)
            if step >= 1:
                ray.get([w.__ray_call__.remote(_state_out_and_back) for w in moved.workers])
            a = plain.train_step(shards, objectives.causal_lm_objective, weigh=objectives.response_tokens)
            b = moved.train_step(shards, objectives.causal_lm_objective, weigh=objectives.response_tokens)
            assert b["loss"] == pytest.approx(a["loss"], abs=1e-6) and b["grad_norm"] == pytest.approx(a["grad_norm"], abs=1e-6)
        w_plain, w_moved = load(plain.weights_bytes()), load(moved.weights_bytes())
        for k in w_plain:
            torch.testing.assert_close(w_moved[k], w_plain[k], rtol=0, atol=0)
    finally:
        plain.shutdown()
        moved.shutdown()


def test_shards_of_one_step_must_have_one_shape():
    """Ranks cut their shards into micro-batches by rows and padded width: shards of different shapes
    could give them different numbers of forwards, which ZeRO-3 cannot survive. Refused before any rank
    is asked."""
    from types import SimpleNamespace

    group = SimpleNamespace(spec=_spec("unused", "causal"), workers=[])
    rows = lambda n, width: {"input_ids": torch.zeros(n, width, dtype=torch.long)}  # noqa: E731
    with pytest.raises(ValueError, match=r"one shape: \[\(4, 10\), \(4, 12\)\]"):
        TrainerGroup.train_step(group, [rows(4, 10), rows(4, 12)], objectives.causal_lm_objective,
                                weigh=objectives.per_row)


def _accumulation_dtypes(worker) -> tuple[str, str]:
    return str(worker.engine.get_data_types()[1]), str(worker.engine.optimizer.gradient_accumulation_dtype)


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_bf16_sums_micro_batch_gradients_in_fp32(ray_local, tiny_model, sft_data, zero_stage):
    """DeepSpeed sums micro-batch gradients in the model's dtype unless told otherwise: in bf16 every add rounds to
    8 bits of mantissa (~1 % off over 64 micro-batches). At ZeRO-2/3 the engine is told fp32, and trains so."""
    import ray

    # ZeRO-0/1 cannot, and under offload the fp32 sums would sit on the GPU: preflight says so.
    for stage, dtype, offload, accumulate in ((1, "bfloat16", "none", None), (0, "float16", "none", None),
                                              (2, "float32", "none", None), (2, "bfloat16", "optimizer", None),
                                              (3, "bfloat16", "optimizer_and_params", None),
                                              (2, "float16", "none", {"grad_accum_dtype": "fp32"})):
        spec = dataclasses.replace(_spec(tiny_model, "causal"), dtype=dtype, zero_stage=stage, offload=offload)
        assert spec.ds_config(1).get("data_types") == accumulate, (stage, dtype, offload)
    schedule = plan(sft_data["input_ids"].shape[0], BATCH, epochs=100, max_steps=20, seed=0)
    group = TrainerGroup(_spec(tiny_model, "causal", zero_stage=zero_stage, dtype="bfloat16", micro_batch_size=1),
                         num_workers=1)
    try:
        assert ray.get([w.__ray_call__.remote(_accumulation_dtypes) for w in group.workers]) == [
            ("torch.float32", "torch.float32")]
        m = group.train_step(batches.shard(_batch(sft_data, schedule, 0), 1), objectives.causal_lm_objective,
                             weigh=objectives.response_tokens)  # 16 micro-batches of one row
        assert math.isfinite(m["loss"]) and m["grad_norm"] > 0
    finally:
        group.shutdown()
