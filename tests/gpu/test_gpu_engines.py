"""Every engine on a CUDA device: training at ZeRO-0/2/3 in bf16, the reward model with a margin,
PPO and GRPO rounds on the HF rollout backend, colocation with sleep and wake, evaluation scorers,
and the tied-embedding weight update with logprob parity.

Each test asserts where the parameters live (cuda) as well as what the step computed.

With ALIGNFLOW_GPU_TESTS_DEVICE=cpu the same tests run on the CPU, every GPU share 0 and every
device assertion expecting the CPU: all but the device itself, so that CI, which has no GPU, runs
this suite's calls into the engines (tests/engines/test_engines_gpu_suite.py). What only a GPU
shows would hold trivially there (optimizer state that "leaves the GPU", already on the CPU; the
memory an engine host gives back; weights a sleeping engine moves off the GPU): those tests run up
to that part and then skip, saying so (`on_gpu_only`), so the CPU run never reports it as passed.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = pytest.mark.gpu

DEVICE = os.environ.get("ALIGNFLOW_GPU_TESTS_DEVICE", "cuda")


def gpus(share: float) -> float:
    """A GPU share of Ray's placement: as given on the GPU, 0 on the CPU."""
    return share if DEVICE == "cuda" else 0


def on_gpu_only(what_ran: str) -> None:
    """Where a test's last checks hold only on a GPU, its CPU run stops there as skipped, saying what did run
    before: it reports as what it is, not as a GPU pass (tests/engines/test_engines_gpu_suite.py counts it)."""
    if DEVICE != "cuda":
        pytest.skip(f"{CPU_ONLY_PART}: {what_ran}")


CPU_ONLY_PART = "checked up to its GPU-only part on the CPU"

# bf16 has an 8-bit mantissa: a token logprob recomputed by another kernel (HF generate's
# incremental decoding vs one full forward) differs by up to about 0.1 nats, 0.02 on average.
BF16_MAX_ABS, BF16_MEAN_ABS = 0.15, 0.03


def _gpu_engine(model, kind, dtype="bfloat16", zero=0, lr=1e-3, batch=16, share=1.0, **extra):
    from alignflow.config import EngineConfig, Placement
    from engines.train.group import TrainerGroup
    from engines.train.spec import EngineSpec

    cfg = EngineConfig(learning_rate=lr, warmup_steps=0, zero_stage=zero, placement=Placement(num_gpus=gpus(share)),
                       **extra)
    spec = EngineSpec.from_config(cfg, model_path=str(model), kind=kind, total_steps=20, global_batch=batch,
                                  dtype=dtype, torch_threads=2, seed=0)
    return TrainerGroup(spec, 1)


def _on_device(report: dict, dtype: str | None = None) -> None:
    assert report["device"].startswith(DEVICE) and report["param_devices"] == [DEVICE], report
    if dtype:
        assert report["param_dtypes"] == [f"torch.{dtype}"], report


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_sft_bf16_on_gpu(ray_gpu, gpu_model, gpu_tokenizer, task_data, zero):
    from engines.batches import sft_tensors, shard, take
    from engines.train import objectives

    tensors, _ = sft_tensors(gpu_tokenizer, task_data["sft"], 64, 16)
    group = _gpu_engine(gpu_model, "causal", zero=zero, lr=3e-3, micro_batch_size=8)
    try:
        _on_device(group.device_reports()[0], "bfloat16")
        batch = take(tensors, torch.arange(16))
        losses = [group.train_step(shard(batch, 1), objectives.causal_lm_objective, weigh=objectives.response_tokens)["loss"] for _ in range(8)]
        assert losses[-1] < losses[0] - 0.1, losses
    finally:
        group.shutdown()


def _optimizer_state_devices(worker) -> list[str]:
    """In a TrainWorker: the devices of its optimizer's moments and fp32 master weights (ZeRO-0 in bf16:
    DeepSpeed's `fp32_groups`; ZeRO-2: its fp32 partitions; ZeRO-3: its flat fp32 partitions)."""
    from engines.train.spec import optimizer_tensors

    opt = worker.engine.optimizer
    tensors = optimizer_tensors(opt) + list(getattr(opt, "single_partition_of_fp32_groups", None) or [])
    return sorted({t.device.type for t in tensors})


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_optimizer_state_leaves_the_gpu_and_comes_back(ray_gpu, gpu_model, gpu_tokenizer, task_data, zero):
    """What a colocated round does around generation, at every ZeRO stage (ZeRO-3's own offload asserts
    DeepSpeed's FusedAdam; the trainer's AdamW is moved by engines/train/spec.py)."""
    import ray

    from engines.batches import sft_tensors, shard, take
    from engines.train import objectives

    tensors, _ = sft_tensors(gpu_tokenizer, task_data["sft"], 64, 16)
    batch = shard(take(tensors, torch.arange(16)), 1)
    group = _gpu_engine(gpu_model, "causal", zero=zero, lr=3e-3)
    try:
        first = group.train_step(batch, objectives.causal_lm_objective, weigh=objectives.response_tokens)["loss"]
        devices = lambda: ray.get(group.workers[0].__ray_call__.remote(_optimizer_state_devices))  # noqa: E731
        seen = [devices()]
        group.offload_states()
        seen.append(devices())
        group.reload_states()
        seen.append(devices())
        later = [group.train_step(batch, objectives.causal_lm_objective, weigh=objectives.response_tokens)["loss"] for _ in range(4)]
        assert later[-1] < first - 0.1, (first, later)
    finally:
        group.shutdown()
    on_gpu_only("optimizer state on the CPU has no GPU to leave: the calls ran and training went on")
    assert seen == [[DEVICE], ["cpu"], [DEVICE]], seen


def test_offloaded_optimizer_steps_with_deepspeeds_cpu_adam(ray_gpu, gpu_model, gpu_tokenizer, task_data):
    """ZeRO-Offload (`offload: optimizer`, ZeRO-2) on a GPU: the bf16 weights train on the GPU, the fp32
    masters and moments live in CPU memory, DeepSpeed's CPU Adam (built on first use) steps them, and the
    loss falls. On the CPU the optimizer is torch's AdamW (engines/train/spec.py: steps_with_cpu_adam)."""
    import ray

    from engines.batches import sft_tensors, shard, take
    from engines.train import objectives

    tensors, _ = sft_tensors(gpu_tokenizer, task_data["sft"], 64, 16)
    batch = shard(take(tensors, torch.arange(16)), 1)
    group = _gpu_engine(gpu_model, "causal", zero=2, lr=3e-3, offload="optimizer")
    try:
        _on_device(group.device_reports()[0], "bfloat16")
        kind = ray.get(group.workers[0].__ray_call__.remote(lambda w: type(w.engine.optimizer.optimizer).__name__))
        assert kind == ("DeepSpeedCPUAdam" if DEVICE == "cuda" else "AdamW")
        losses = [group.train_step(batch, objectives.causal_lm_objective, weigh=objectives.response_tokens)["loss"]
                  for _ in range(6)]
        assert ray.get(group.workers[0].__ray_call__.remote(_optimizer_state_devices)) == ["cpu"]
        assert losses[-1] < losses[0] - 0.1, losses
    finally:
        group.shutdown()


def test_reward_model_with_margin_on_gpu(ray_gpu, gpu_model, gpu_tokenizer, task_data):
    import functools

    from engines.batches import pair_tensors, shard, split_pairs
    from engines.train import objectives

    tensors, _ = pair_tensors(gpu_tokenizer, task_data["preference"], 64, 16)
    group = _gpu_engine(gpu_model, "scalar", zero=2, lr=3e-3)
    try:
        _on_device(group.device_reports()[0], "bfloat16")
        n = tensors["input_ids"].shape[0] // 2
        batch = split_pairs(tensors, torch.arange(16), n)
        objective = functools.partial(objectives.pairwise_objective, margin=0.5)  # a margin tensor on the GPU
        out = [group.train_step(shard(batch, 1, paired=True), objective, paired=True, weigh=objectives.per_row) for _ in range(8)]
        assert out[-1]["loss"] < out[0]["loss"], [m["loss"] for m in out]
    finally:
        group.shutdown()


def _gpu_bytes(worker) -> int:
    """In a TrainWorker: what torch's allocator holds on its GPU (0 on the CPU)."""
    return torch.cuda.memory_allocated() if worker.device.type == "cuda" else 0


def test_a_rank_kept_warm_on_the_gpu_frees_its_model_and_takes_the_next_engine(ray_gpu, gpu_model, gpu_tokenizer,
                                                                               task_data):
    """What `keep_warm()` does on a GPU between a driver's engines (engines/placement/warm.py; a run's stages keep
    no GPU rank): an SFT rank at ZeRO-2 reset, its model and optimizer off the GPU, then a reward model at ZeRO-3
    set up in the same process, on the GPU, and training."""
    import ray

    from engines.batches import pair_tensors, sft_tensors, shard, split_pairs, take
    from engines.placement.warm import keep_warm
    from engines.train import objectives

    sft, _ = sft_tensors(gpu_tokenizer, task_data["sft"], 64, 16)
    pairs, _ = pair_tensors(gpu_tokenizer, task_data["preference"], 64, 16)
    pid = lambda g: ray.get(g.workers[0].__ray_call__.remote(lambda self: os.getpid()))  # noqa: E731
    with keep_warm() as pool:
        group = _gpu_engine(gpu_model, "causal", zero=2, lr=3e-3)
        first = pid(group)
        group.train_step(shard(take(sft, torch.arange(16)), 1), objectives.causal_lm_objective,
                         weigh=objectives.response_tokens)
        worker = group.workers[0]
        group.shutdown()
        assert pool.counts.kept == 1, pool.counts  # reset: its model freed
        left = ray.get(worker.__ray_call__.remote(_gpu_bytes))
        assert left < 1 << 20, f"{left} bytes still allocated on the GPU after the reset"
        group = _gpu_engine(gpu_model, "scalar", zero=3, lr=3e-3)
        try:
            assert pid(group) == first and pool.counts.reused == 1, pool.counts
            _on_device(group.device_reports()[0], "bfloat16")
            batch = split_pairs(pairs, torch.arange(16), pairs["input_ids"].shape[0] // 2)
            out = [group.train_step(shard(batch, 1, paired=True), objectives.pairwise_objective, paired=True,
                                    weigh=objectives.per_row) for _ in range(4)]
            assert out[-1]["loss"] < out[0]["loss"], [m["loss"] for m in out]
        finally:
            group.shutdown()


def _round(cfg, model, prompts, reward_path=None):
    from engines.rl.round import RLRound
    from engines.rl.round_models import RoundSetup

    return RLRound(cfg, RoundSetup(policy_path=str(model), reference_path=str(model), reward_path=reward_path,
                                   prompts=prompts, dtype="bfloat16", torch_threads=2, max_model_len=96, seed=0))


def _prompts(tokenizer, task_data):
    from engines.batches import filter_prompts

    return filter_prompts(tokenizer, task_data["prompts"], 64, "prompts")[0]


def _assert_round_on_device(rl) -> None:
    import ray

    m = rl.models
    for group in (m.actor, m.critic):
        if group is not None:
            _on_device(group.device_reports()[0], "bfloat16")
    for scorer in {id(s): s for s in (m.reference, m.rewarder) if s is not None}.values():
        report = ray.get(scorer.device_report.remote())  # also its placement group, CPU affinity, threads
        models = {k: report[k] for k in ("reference", "reward") if k in report}
        assert models and all(v == [DEVICE] for v in models.values()), report
    for report in ray.get([e.device_report.remote() for e in m.engines.actors]):
        assert report["policy"] == [DEVICE], report


def _moves_policy(rl) -> None:
    from engines.train.objectives import response_logprobs

    first = rl.step(0)
    probe = first.experience.tensors()
    before = rl.models.actor.evaluate(probe, response_logprobs)
    assert before.device.type == "cpu" and before.dtype == torch.float32  # crossed the boundary on the CPU
    rl.step(1)
    after = rl.models.actor.evaluate(probe, response_logprobs)
    assert (after - before).abs().max() > 1e-3


def _engine_samples_at_trainer_logprobs(rl, tokenizer, task_data) -> None:
    """The round's engine samples with the weights the trainer has: its token log-probs are the trainer's, within
    bf16 rounding (an update that did not arrive whole would show)."""
    from engines.rl import experience
    from engines.rollout.base import Sampling
    from engines.train import objectives

    prompts = [ids for ids, _ in _prompts(tokenizer, task_data)[:8]]
    exp = experience.from_rollouts(rl.models.engines.generate(prompts, Sampling(n=2, max_new_tokens=6)),
                                   tokenizer.pad_token_id)
    trainer = rl.models.actor.evaluate(exp.tensors(), objectives.response_logprobs)
    diff = (trainer - exp.rollout_logprobs).abs()[exp.action_mask.bool()]
    assert diff.max() < BF16_MAX_ABS and diff.mean() < BF16_MEAN_ABS, (diff.max(), diff.mean())


def _gpu_round_cfg(algorithm: str, share: float, backend: str = "hf", **kw):
    from alignflow.config import ActorConfig, CriticConfig, Placement, PPOConfig, RolloutConfig, RoundConfig, VLLMConfig

    gpu = Placement(num_cpus=1, num_gpus=gpus(share))
    vllm = VLLMConfig(gpu_memory_utilization=0.25)  # colocated: a quarter of the GPU for weights and KV cache
    kw.setdefault("steps", 2)
    return RoundConfig(
        algorithm=algorithm, prompts_per_step=8, scorer_placement=gpu,
        generation=RolloutConfig(backend=backend, num_samples=4, max_new_tokens=6, placement=gpu, vllm=vllm),
        ppo=PPOConfig(minibatch_size=32, epochs=1), actor=ActorConfig(learning_rate=3e-3, placement=gpu),
        critic=CriticConfig(placement=gpu), **kw)


def parity_reward(prompt: str, response: str, answer: str | None) -> float:
    """Splits the random model's responses into two classes: rewards that differ within a group (the
    task's own rule, an exact answer, would score every response of a random model 0)."""
    return float(sum(map(ord, response)) % 2)


@pytest.mark.parametrize("algorithm, share, extra, scored_by_model", [
    ("ppo", 0.2, {}, True),  # actor, critic, scorer (reference + reward model), engine: a GPU share each
    ("grpo", 0.25, {"reward": {"source": "rule", "rule": f"{__name__}:parity_reward"}}, False),  # KL loss, k3
])
def test_round_on_gpu_moves_policy(ray_gpu, gpu_model, gpu_reward_model, gpu_tokenizer, task_data, algorithm,
                                   share, extra, scored_by_model):
    reward_path = str(gpu_reward_model) if scored_by_model else None  # PPO's critic starts from it too
    rl = _round(_gpu_round_cfg(algorithm, share, **extra), gpu_model, _prompts(gpu_tokenizer, task_data),
                reward_path=reward_path)
    try:
        _assert_round_on_device(rl)
        _moves_policy(rl)
    finally:
        rl.shutdown()


def test_colocated_ppo_sleeps_and_wakes_on_one_gpu(ray_gpu, gpu_model, gpu_reward_model, gpu_tokenizer, task_data):
    import ray

    cfg = _gpu_round_cfg("ppo", 1.0, colocate_all=True, colocate_offload="always")
    rl = _round(cfg, gpu_model, _prompts(gpu_tokenizer, task_data), reward_path=str(gpu_reward_model))
    try:
        assert len(rl.models.placement_group.bundle_specs) == 1
        _assert_round_on_device(rl)
        _moves_policy(rl)  # step 2 generates only if step 1's sync woke the engine in order
        # What the round asked of the engine (SleepState.events): each step it generated, slept while the
        # models trained, woke its weights, took the update, woke its KV cache.
        engine = rl.models.engines.actors[0]
        [log] = rl.models.engines.events()
        assert log["events"] == ["generate", "sleep", "wake weights", "update weights", "wake kv_cache"] * 2, log
        on_gpu_only("the round slept and woke its engine in order; on the CPU its weights have no GPU to leave")
        # And what sleeping does on a GPU: the engine's weights leave it, and come back when woken.
        ray.get(engine.sleep.remote())
        asleep = ray.get(engine.device_report.remote())["policy"]
        ray.get(engine.wake.remote(["weights"]))
        assert (asleep, ray.get(engine.device_report.remote())["policy"]) == (["cpu"], [DEVICE])
    finally:
        rl.shutdown()


def test_colocated_grpo_stays_on_the_gpu_where_it_fits_and_takes_each_update(ray_gpu, gpu_model, gpu_tokenizer,
                                                                             task_data):
    """colocate_offload: auto (the default). On a GPU with room for every model, the first update finds that
    they fit together: from then on the engine stays awake and the optimizer state stays on the GPU. Each
    update still reaches the engine, through the staging buffer whose CUDA IPC handle it opened once: after
    three updates it samples at the trainer's log-probs. On the CPU nothing has a GPU to fit: it moves as
    `always` does, every step."""
    import ray

    rule = {"source": "rule", "rule": f"{__name__}:parity_reward"}
    rl = _round(_gpu_round_cfg("grpo", 1.0, colocate_all=True, steps=3, reward=rule), gpu_model,
                _prompts(gpu_tokenizer, task_data))
    try:
        resident = [rl.step(s).metrics["resident"] for s in range(3)]
        [log] = rl.models.engines.events()
        worker = rl.models.actor.workers[0]
        optimizer_devices = ray.get(worker.__ray_call__.remote(_optimizer_state_devices))
        _engine_samples_at_trainer_logprobs(rl, gpu_tokenizer, task_data)
        moved = ["generate", "sleep", "wake weights", "update weights", "wake kv_cache"]
        if DEVICE != "cuda":
            assert (resident, log["events"][:15]) == ([0.0] * 3, moved * 3), (resident, log)
        on_gpu_only("with no GPU to fit, the round moved its models every step and the updates arrived")
        assert resident == [1.0] * 3, resident
        assert log["events"][:9] == [*moved, "generate", "update weights", "generate", "update weights"], log
        assert optimizer_devices == [DEVICE], optimizer_devices
    finally:
        rl.shutdown()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM is not installed (on a GPU machine: pip install -e '.[gpu]')")
@pytest.mark.skipif(DEVICE != "cuda", reason="vLLM sleeps only on GPUs; on the CPU the gpu-small e2e (tests/e2e) "
                                             "runs colocated vLLM rounds")
def test_colocated_ppo_on_vllm_sleeps_wakes_and_serves_each_update(ray_gpu, gpu_model, gpu_reward_model,
                                                                   gpu_tokenizer, task_data):
    """configs/gpu-small.yaml's round: actor, critic, scorer and a vLLM engine (CUDA graphs on) on one GPU.
    Asleep, the engine gives the GPU its weights and KV cache; woken in order, it takes each update by CUDA
    IPC into memory its graphs still point at, so its sampled-token logprobs are the trainer's."""
    import ray

    # offload always: under auto the round would find everything fits and keep the engine awake, so a sync
    # after the sleep below would push into a sleeping engine (the round itself never sleeps it then).
    rl = _round(_gpu_round_cfg("ppo", 1.0, backend="vllm", colocate_all=True, colocate_offload="always"), gpu_model,
                _prompts(gpu_tokenizer, task_data), reward_path=str(gpu_reward_model))
    engine = rl.models.engines.actors[0]

    def free() -> int:
        return ray.get(engine.__ray_call__.remote(lambda self: torch.cuda.mem_get_info()[0]))

    try:
        _moves_policy(rl)  # step 2 generates only if step 1's sync woke the engine in order
        awake = free()
        rl.models.engines.sleep()
        assert free() - awake > 2**30, (awake, free())  # the KV cache (a quarter of the GPU) and weights left
        rl.models.sync(push=True)  # weights woken, the update by IPC, then the KV cache
        assert awake - free() < 2**28, (awake, free())
        _engine_samples_at_trainer_logprobs(rl, gpu_tokenizer, task_data)
    finally:
        rl.shutdown()


def test_tied_weight_update_keeps_logprob_parity_on_gpu(ray_gpu, gpu_model, gpu_tokenizer, task_data):
    """Trainer (bf16, DeepSpeed) -> HF rollout engine on the GPU: after a step and a sync, the engine's
    sampled-token logprobs match the trainer's recomputation within bf16 tolerance."""
    import ray

    from alignflow.config import GenerationConfig, Placement
    from engines.batches import sft_tensors, shard, take
    from engines.rl import experience
    from engines.rollout.actors import start_engines
    from engines.rollout.base import Sampling
    from engines.train import objectives
    from engines.transport.sync import WeightSync

    group = _gpu_engine(gpu_model, "causal", lr=3e-3, share=0.5)
    engines = start_engines(GenerationConfig(backend="hf", placement=Placement(num_gpus=gpus(0.5))), str(gpu_model),
                            count=1, seeds=[0], dtype="bfloat16", torch_threads=2, max_model_len=96)
    try:
        tensors, _ = sft_tensors(gpu_tokenizer, task_data["sft"], 64, 16)
        group.train_step(shard(take(tensors, torch.arange(16)), 1), objectives.causal_lm_objective, weigh=objectives.response_tokens)
        # Trainer and engine share the GPU: CUDA IPC handles (tied: lm_head travels as the embedding).
        WeightSync(group, engines, bucket_bytes=2**20).push()
        prompts = [ids for ids, _ in _prompts(gpu_tokenizer, task_data)[:8]]
        rollouts = engines.generate(prompts, Sampling(n=2, max_new_tokens=6))
        exp = experience.from_rollouts(rollouts, gpu_tokenizer.pad_token_id)
        trainer = group.evaluate(exp.tensors(), objectives.response_logprobs)
        diff = (trainer - exp.rollout_logprobs).abs()[exp.action_mask.bool()]
        assert diff.max() < BF16_MAX_ABS and diff.mean() < BF16_MEAN_ABS, (diff.max(), diff.mean())
    finally:
        engines.shutdown()
        group.shutdown()


def test_evaluation_scorers_on_gpu(ray_gpu, gpu_model, gpu_reward_model, gpu_tokenizer, task_data):
    """The scorer actor evaluation uses: models on the GPU, CPU float32 results equal to a CPU run's."""
    import ray

    from engines.rl import experience
    from engines.rl.scoring import ScorerActor, start_scorer
    from engines.rollout.base import Rollout

    prompts = [ids for ids, _ in _prompts(gpu_tokenizer, task_data)[:4]]
    rollouts = [Rollout(i, p, p[:3], "", [0.0] * 3, True) for i, p in enumerate(prompts)]
    batch = experience.from_rollouts(rollouts, gpu_tokenizer.pad_token_id).tensors()
    gpu = start_scorer(str(gpu_model), str(gpu_reward_model), dtype="float32", torch_threads=2, num_gpus=gpus(1))
    try:
        report = ray.get(gpu.device_report.remote())
        assert report["reference"] == [DEVICE] and report["reward"] == [DEVICE]
        ref, rewards = ray.get([gpu.ref_logprobs.remote(batch), gpu.rewards.remote(batch)])
    finally:
        ray.kill(gpu)
    cpu = ScorerActor(str(gpu_model), str(gpu_reward_model), dtype="float32")
    assert ref.device.type == "cpu" and rewards.device.type == "cpu"
    assert rewards.abs().min() > 1e-3, rewards  # a score head that scores (a fresh one gives 0 everywhere)
    torch.testing.assert_close(ref, cpu.ref_logprobs(batch), rtol=0, atol=2e-3)  # TF32 matmuls on the GPU
    torch.testing.assert_close(rewards, cpu.rewards(batch), rtol=0, atol=2e-3)


def test_engine_host_builds_and_frees_engines_on_gpu(ray_gpu, tmp_path_factory):
    """evaluation.engine_lifetime: run on a GPU: engines built one after another in one process, each
    on the GPU and gone after its call. What stays allocated is the same after every engine: mostly
    torch's cuBLAS workspace (32 MiB per stream on Hopper, kept for the process's next matmul, whatever
    the model; an H200 showed 33 MiB in all). With the workspaces cleared, less than half a model stays:
    the model (31 MB in bf16) is chosen to outweigh the rest of what a CUDA process keeps."""
    import ray

    from alignflow.config import TinyModelConfig
    from engines.models import build_tiny_model, load_tokenizer
    from engines.rollout.base import Sampling
    from engines.rollout.host import EngineHost

    model = build_tiny_model(TinyModelConfig(hidden_size=512, num_layers=4, intermediate_size=2048,
                                             tie_word_embeddings=True), seed=0, out_dir=tmp_path_factory.mktemp("m"))
    tokenizer = load_tokenizer(model)
    host = ray.remote(num_cpus=1, num_gpus=gpus(1))(EngineHost).remote("hf", torch_threads=2)
    prompts = [tokenizer(t)["input_ids"] for t in ("Which digit is largest? 3 1 4", "hello")]

    def allocated(self, clear_workspaces: bool = False) -> int:
        if not torch.cuda.is_available():
            return 0
        if clear_workspaces:
            torch._C._cuda_clearCublasWorkspaces()
        return torch.cuda.memory_allocated()

    try:
        draws, kept = [], []
        for seed in (1, 1, 2):
            draws.append(ray.get(host.generate.remote("hf", str(model), prompts, Sampling(n=2, max_new_tokens=6),
                                                      seed=seed, dtype="bfloat16", on_gpu=DEVICE == "cuda")))
            kept.append(ray.get(host.__ray_call__.remote(allocated)))
        assert ray.get(host.stats.remote()) == {"engines_built": 3}
        residue = ray.get(host.__ray_call__.remote(allocated, True))
    finally:
        ray.kill(host)
    assert [r.token_ids for r in draws[0]] == [r.token_ids for r in draws[1]]  # a fresh engine per seed
    assert len(draws[2]) == 4 and all(r.token_ids for r in draws[2])
    from math import prod

    from engines.transport.wire import checkpoint_shapes

    weights = 2 * sum(prod(shape) for shape in checkpoint_shapes(str(model)).values())  # bf16 bytes
    on_gpu_only("an engine on the CPU allocates no GPU memory to give back: the engines were built, sampled "
                "and closed in one process")
    assert kept[0] == kept[1] == kept[2], f"GPU bytes kept after each engine closed: {kept} ({weights} a model)"
    assert residue < weights / 2, f"{residue} bytes on the GPU, cuBLAS workspaces cleared ({weights} a model; {kept})"


def test_a_checkpoints_random_state_replays_the_gpus_draws():
    """Resume state holds the GPU's generator too (dropout, LoRA's included, draws there): restored, a step
    draws what it drew before. On the CPU there is no GPU generator to hold."""
    from engines.train.state import restore_rng, rng_state

    device = torch.device(DEVICE)
    saved = rng_state(device)
    assert ("cuda_rng" in saved) == (DEVICE == "cuda"), sorted(saved)
    first = torch.rand(8, device=device), torch.rand(8)
    restore_rng(saved, device)
    again = torch.rand(8, device=device), torch.rand(8)
    assert all(torch.equal(x, y) for x, y in zip(first, again))
    assert not torch.equal(first[0], torch.rand(8, device=device))  # and the draws do move on
