#!/usr/bin/env bash
# TRL's wheels for bench/step/vs_trl.py on the lent GPU machine (Python 3.12, no package registry), into
# .gpu/whl beside what ../shared/gpu/stage.sh put there; run after it, in the project root:
#
#   ../shared/gpu/stage.sh && bash bench/stage_trl.sh
#
# Wheels for 3.12 only, and no fallback to this machine's Python: .gpu/activate.sh installs every wheel in
# one pip call, so one wheel of another Python would leave out pydantic and DeepSpeed as well.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[[ -d .gpu/whl ]] || { echo "stage_trl.sh: no .gpu/whl: run ../shared/gpu/stage.sh first" >&2; exit 1; }
trl=$(sed -n 's/^bench = \["trl==\([0-9.]*\)"\].*/\1/p' pyproject.toml)
[[ -n "$trl" ]] || { echo "stage_trl.sh: pyproject.toml's bench extra names no trl==VERSION" >&2; exit 1; }
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/whl "trl==$trl" "datasets==5.2.0" "dill==0.4.1" "multiprocess==0.70.19" "xxhash==4.1.0"  # datasets'
#   pins: dill<0.4.2, multiprocess<0.70.20
ls .gpu/whl | grep -E '^(trl|datasets|dill|multiprocess|xxhash)-' | grep -v -E 'py3-none|cp312|py312' && {
  echo "stage_trl.sh: a wheel above is not for Python 3.12" >&2; exit 1; }
du -sh .gpu
