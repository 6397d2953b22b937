"""bench/step/rl_step.py with a pipeline config, as the README's GPU command runs it: the round of
configs/gpu-small.yaml (PPO with a critic, every model colocated, bf16) on a small shape and no GPU.
Every phase prints its time and tokens/s, and the bench leaves no temporary directory behind."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.engine
# Minutes of both cores under the suite's two workers, for what the rest of the suite mostly covers: runs where
# asked (ALIGNFLOW_LONG_TESTS=1: before a release, or after a change to what it checks); skipped, saying so, in CI.
@pytest.mark.skipif(os.environ.get("ALIGNFLOW_LONG_TESTS") != "1",
                    reason="a long test: runs where asked (ALIGNFLOW_LONG_TESTS=1)")
def test_the_bench_runs_the_gpu_configs_round_and_prints_tokens_per_second(gpu_config_on_cpu, tmp_path):
    config = gpu_config_on_cpu(tmp_path)
    # A temporary directory of its own (short: Ray's socket paths live under it), so that what other
    # processes make beside it (a concurrent test's) is not counted.
    tmp = Path(tempfile.mkdtemp(prefix="afb-", dir="/tmp"))
    made = lambda: {p.name for p in tmp.glob("alignflow-*")}  # noqa: E731
    before = made()
    try:
        res = subprocess.run([sys.executable, "bench/step/rl_step.py", "--config", str(config), "--runs", "1", "--steps",
                              "1"], cwd=REPO, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "TMPDIR": str(tmp)})
        left = made() - before
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {line.split()[0]: line for line in res.stdout.splitlines() if re.match(r"  \w+ +\d+\.\d+ s", line)}
    assert f"config {config}" in res.stdout
    for phase in ("generate", "score", "reference", "old_logprobs", "critic", "train"):  # PPO: a critic, a reward model
        assert re.search(r"\d+\.\d+ s +\d+ tokens/s", rows[phase]), rows.get(phase)
    assert left == set()  # the copied tree and the built model are gone
