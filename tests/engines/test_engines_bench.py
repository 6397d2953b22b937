"""bench/rl_step.py with a pipeline config, as the README's GPU command runs it: the round of
configs/gpu-small.yaml (PPO with a critic, every model colocated, bf16) on a small shape and no GPU.
Every phase prints its time and tokens/s, and the bench leaves no temporary directory behind."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHAPE = re.compile(r"hidden_size: \d+, num_layers: \d+, num_heads: \d+, num_kv_heads: \d+, intermediate_size: \d+")


@pytest.mark.engine
def test_the_bench_runs_the_gpu_configs_round_and_prints_tokens_per_second(tmp_path):
    text = (REPO / "configs" / "gpu-small.yaml").read_text()
    assert SHAPE.search(text) and text.count("num_gpus: 1") == 8, "configs/gpu-small.yaml changed shape: update this test"
    small = SHAPE.sub("hidden_size: 128, num_layers: 2, num_heads: 2, num_kv_heads: 1, intermediate_size: 256", text)
    config = tmp_path / "gpu-small-on-cpu.yaml"
    config.write_text(small.replace("num_gpus: 1", "num_gpus: 0"))
    made = lambda: {p.name for p in Path(tempfile.gettempdir()).glob("alignflow-*")}  # noqa: E731
    before = made()

    res = subprocess.run([sys.executable, "bench/rl_step.py", "--config", str(config), "--runs", "1", "--steps", "1"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {line.split()[0]: line for line in res.stdout.splitlines() if re.match(r"  \w+ +\d+\.\d+ s", line)}
    assert f"config {config}" in res.stdout
    for phase in ("generate", "score", "reference", "old_logprobs", "critic", "train"):  # PPO: a critic, a reward model
        assert re.search(r"\d+\.\d+ s +\d+ tokens/s", rows[phase]), rows.get(phase)
    assert made() - before == set()  # the copied tree and the built model are gone
