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


@pytest.mark.engine
def test_vs_trl_runs_alignflows_side_and_keeps_it_when_the_other_side_fails():
    """bench/step/vs_trl.py, the first thing a lent GPU runs (bench/gpu_session.sh), at its smallest on the CPU:
    its alignflow side had been failing since the rounds' rewards read each prompt row's text (the bench gave
    none), unseen until this test. TRL is not installed here, so its side fails: said, and the table keeps the
    side that ran. Where TRL is installed, both sides run."""
    import importlib.util

    res = subprocess.run([sys.executable, "bench/step/vs_trl.py", "--device", "cpu", "--runs", "1", "--steps", "1",
                          "--prompts", "4", "--samples", "2", "--new-tokens", "4", "--micro-rows", "8"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    assert re.search(r"^run 1/1 alignflow: step \d+\.\d+ s; \{", res.stdout, re.M), res.stdout[-3000:]
    assert re.search(r"^step +\d+\.\d+s", res.stdout, re.M) and "alignflow Ray calls per step" in res.stdout
    if importlib.util.find_spec("trl") is None:
        assert "run 1/1 trl: FAILED" in res.stdout and "No module named 'trl'" in res.stdout, res.stdout[-3000:]
