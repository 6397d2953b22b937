"""Training state <-> safetensors + JSON skeleton, without pickles."""

from __future__ import annotations

import enum
import json
from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file

from engines.train.state import load_state, save_state


class Phase(enum.IntEnum):
    WARMUP = 1
    DECAY = 2


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "optimizer": {
            "state": {
                0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(3, 4, generator=g),
                    "exp_avg_sq": torch.rand(3, 4, generator=g)},
                1: {"step": torch.tensor(7.0), "exp_avg": torch.randn(5, generator=g, dtype=torch.float64),
                    "exp_avg_sq": torch.rand(5, generator=g, dtype=torch.float64)},
            },
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                              "amsgrad": False, "maximize": False, "foreach": None, "params": [0, 1]}],
        },
        "scheduler": {"last_epoch": 12, "base_lrs": [0.003], "_last_lr": [0.0027], "phase": Phase.DECAY},
        "step": 12,
        "loss": 0.125,
        "nothing": None,
        "name": "sft",
        "torch_rng": torch.get_rng_state(),
        "mask": torch.tensor([True, False, True]),
        "ids": torch.arange(6, dtype=torch.long).reshape(2, 3),
        "half": torch.ones(2, dtype=torch.bfloat16),
        "empty": [],
        "nested_tuple": (1, (2.5, None), [torch.zeros(1)]),
    }


def _assert_same(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict), path
        assert list(a) == list(b), path  # same keys, same types (int stays int), same order
        assert [type(k) for k in a] == [type(k) for k in b], path
        for k in a:
            _assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b), f"{path}: {type(a).__name__} became {type(b).__name__}"
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b and type(a) is type(b), f"{path}: {a!r} != {b!r}"


def test_round_trip(tmp_path):
    state = _state()
    save_state(state, tmp_path, "trainer-rank0")
    out = load_state(tmp_path, "trainer-rank0")
    expected = dict(state)
    expected["scheduler"] = {**state["scheduler"], "phase": int(Phase.DECAY)}  # enums come back as their value
    _assert_same(expected, out)
    assert out["scheduler"]["phase"] == Phase.DECAY


def test_files_written_are_safetensors_and_json_only(tmp_path):
    save_state(_state(), tmp_path, "trainer-rank3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trainer-rank3.json", "trainer-rank3.safetensors"]
    json.loads((tmp_path / "trainer-rank3.json").read_text())  # plain JSON
    tensors = load_file(str(tmp_path / "trainer-rank3.safetensors"))
    # optimizer: 2 params x (step, exp_avg, exp_avg_sq); rng, mask, ids, half, the zeros in the tuple
    assert len(tensors) == 6 + 5
    assert b"\x80\x04" not in (tmp_path / "trainer-rank3.json").read_bytes()  # no pickle protocol header


def test_real_optimizer_state_restores_training_exactly(tmp_path):
    def make():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), torch.randn(8, 2)

    def step(model, opt):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    model, opt = make()
    for _ in range(3):
        step(model, opt)
    save_state({"optimizer": opt.state_dict(), "model": model.state_dict()}, tmp_path, "s")
    step(model, opt)

    restored_model, restored_opt = make()
    st = load_state(tmp_path, "s")
    restored_model.load_state_dict(st["model"])
    restored_opt.load_state_dict(st["optimizer"])
    step(restored_model, restored_opt)
    for a, b in zip(model.parameters(), restored_model.parameters()):
        assert torch.equal(a, b)


def test_shared_and_non_contiguous_tensors(tmp_path):
    base = torch.arange(12.0).reshape(3, 4)
    state = {"a": base, "view": base[:, 1], "t": base.t(), "again": base}
    save_state(state, tmp_path, "s")
    out = load_state(tmp_path, "s")
    for k, v in state.items():
        assert torch.equal(out[k], v)
    out["a"][0, 0] = 100.0
    assert out["again"][0, 0] == 0.0  # stored separately, not aliased


def test_namedtuple_and_dataclass_are_stored_as_their_fields(tmp_path):
    Point = namedtuple("Point", "x y")

    @dataclass
    class Cfg:
        lr: float
        w: torch.Tensor

    save_state({"p": Point(1, 2), "c": Cfg(0.5, torch.ones(2))}, tmp_path, "s")
    out = load_state(tmp_path, "s")
    assert out["p"] == {"x": 1, "y": 2}
    assert out["c"]["lr"] == 0.5 and torch.equal(out["c"]["w"], torch.ones(2))


@pytest.mark.parametrize(
    "state, path",
    [
        ({"optimizer": {"state": {0: {"fn": object()}}}}, "s.optimizer.state.0.fn"),
        ({"a": [1, {"b": {1, 2}}]}, "s.a[1].b"),
        ({"a": (1, b"bytes")}, "s.a[1]"),
        ({"a": {1.5: "float key"}}, "s.a"),
    ],
)
def test_non_storable_object_raises_naming_the_path(tmp_path, state, path):
    with pytest.raises(TypeError) as err:
        save_state(state, tmp_path, "s")
    assert f"state at {path}:" in str(err.value)


def test_string_keys_that_look_like_markers_survive(tmp_path):
    state = {"__tensor__": "not a tensor", "__tuple__": [1], "__dict__": 3, "x": {"__tensor__": 1}}
    save_state(state, tmp_path, "s")
    assert load_state(tmp_path, "s") == state


ZERO_RESTORE = """
import json, sys, torch, deepspeed
deepspeed.init_distributed("gloo")
from engines.train.state import load_optimizer_state, load_state, optimizer_state, save_state
stage, directory = int(sys.argv[1]), sys.argv[2]
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
          "zero_optimization": {"stage": stage}}

def engine():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return deepspeed.initialize(model=model, optimizer=opt, config=config)[0]

def step(e, seed):
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(seed))
    e.backward(e(x).pow(2).mean())
    e.step()

def moments(e):
    return [t.flatten().tolist() for s in e.optimizer.optimizer.state.values() for t in (s["exp_avg"], s["exp_avg_sq"])]

first = engine()
for seed in range(3):
    step(first, seed)
save_state({"optimizer": optimizer_state(first, stage)}, directory, "trainer-rank0")
resumed = engine()
resumed.module.load_state_dict(first.module.state_dict())  # the model's weights: a checkpoint's other file
# Saved by a group of two: only trainer-rank0 is in the directory; rank 0 restores from its own file.
load_optimizer_state(resumed, stage, 0, 2, directory, load_state(directory, "trainer-rank0")["optimizer"])
same = moments(resumed) == moments(first)
step(first, 3)
step(resumed, 3)
after = [p.detach().flatten().tolist() for p in first.module.parameters()] == \\
    [p.detach().flatten().tolist() for p in resumed.module.parameters()]
print(json.dumps({"moments": same, "after_a_step": after, "elastic": first.optimizer.elastic_checkpoint}))
"""


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_restores_a_rank_from_its_own_file_alone(stage, tmp_path):
    """DeepSpeed's rigid ZeRO checkpoints (its default) restore a rank from its own partition: restoring reads
    no other rank's file, each of which holds a share of the fp32 masters and Adam moments (read on every rank,
    they would put the whole optimizer state in each rank's host memory). A real ZeRO engine in a gloo group of
    one, in a process of its own, restored as rank 0 of two from a directory holding trainer-rank0 alone: its
    moments are the saved ones, and the next step matches the engine's that never stopped."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from alignflow.net import free_port

    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    out = subprocess.run([sys.executable, "-c", ZERO_RESTORE, str(stage), str(tmp_path)], capture_output=True, text=True,
                         timeout=300, env=env, cwd=Path(__file__).resolve().parents[3])
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"moments": True, "after_a_step": True,
                                                               "elastic": False}


@pytest.mark.parametrize("shard", ["40KB", None])
def test_load_weights_reads_a_model_saved_whole_or_in_shards(tiny_model, tmp_path, shard):
    """A model saved past save_pretrained's max_shard_size is several files and an index: a resume reads every
    shard. Loaded into a model of other weights (ZeRO-0), every parameter is the saved one."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engines.train.state import load_weights, weight_files

    saved = AutoModelForCausalLM.from_pretrained(tiny_model)
    saved.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    files = set(weight_files(tmp_path).values())
    assert len(files) > 2 if shard else files == {tmp_path / "model.safetensors"}
    torch.manual_seed(1)
    fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model))
    assert not all(torch.equal(a, b) for a, b in zip(fresh.parameters(), saved.parameters()))
    load_weights(fresh, 0, tmp_path)
    for (name, a), b in zip(fresh.state_dict().items(), saved.state_dict().values()):
        assert torch.equal(a, b), name


def test_load_weights_names_a_missing_weight(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from engines.train.state import load_weights

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    model.save_pretrained(tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    dropped = sorted(weights)[-1]  # a layer's, not the tied output layer's
    save_file({k: v for k, v in weights.items() if k != dropped}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match=f"missing=\\['{dropped}'\\]"):
        load_weights(model, 0, tmp_path)


def test_an_untied_output_layer_missing_from_the_files_is_named(tmp_path):
    """Qwen2's class names lm_head tied whether or not the model ties it: only a head that *is* the embedding
    may be absent from the files; an untied one left out would keep the base model's head on resume."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from engines.train.state import load_weights

    for tie in (True, False):
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tie))
        model.save_pretrained(tmp_path / str(tie))
        weights = load_file(str(tmp_path / str(tie) / "model.safetensors"))
        save_file({k: v for k, v in weights.items() if k != "lm_head.weight"},
                  str(tmp_path / str(tie) / "model.safetensors"), metadata={"format": "pt"})
        if tie:
            load_weights(model, 0, tmp_path / str(tie))
        else:
            with pytest.raises(RuntimeError, match=r"missing=\['lm_head.weight'\]"):
                load_weights(model, 0, tmp_path / str(tie))
