"""The GPU suite (tests/gpu) run on the CPU, as CI has no GPU.

Its tests call the engines as a user's GPU run does: bf16 training at every ZeRO stage with
micro-batches, the reward model with a margin, PPO and GRPO rounds that must move the policy,
colocation with sleep and wake, the tied-embedding weight update, the evaluation scorers. Run with
ALIGNFLOW_GPU_TESTS_DEVICE=cpu, everything but the device is theirs: a GPU test that drifted from
the engines' API, or whose round had nothing to learn from, fails here on every CI run, not first on
the rare machine with a GPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_suite_passes_on_the_cpu():
    env = {**os.environ, "ALIGNFLOW_GPU_TESTS_DEVICE": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/gpu"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    # Every test ran and passed, none deselected, and none skipped (as they are without the variable) but the
    # one vLLM test that needs a GPU's sleep mode (on the CPU the gpu-small e2e runs colocated vLLM rounds).
    summary = re.search(r"^(\d+) passed(, 1 skipped)?(, \d+ warnings?)? in [\d.]+s", out, re.M)
    assert summary and int(summary.group(1)) >= 15, out[-3000:]
    skipped = re.findall(r"^SKIPPED \[\d+\] (.*)$", out, re.M)
    assert all("vLLM sleeps only on GPUs" in s for s in skipped) and len(skipped) == bool(summary.group(2)), skipped
