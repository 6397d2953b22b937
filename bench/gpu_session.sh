#!/usr/bin/env bash
# Issue 38's checks on a lent GPU, as one run (the device tool's 10 minutes): from the project root, with
# .gpu/ carried (../shared/gpu/stage.sh, plus the trl, datasets, dill and multiprocess wheels in .gpu/whl):
#
#   source .gpu/activate.sh && bash bench/gpu_session.sh
#
# Each part has a time limit of its own and writes its log under $OUT, so a part that hangs costs only
# its own share. In order of what matters: vs TRL at 32x8x32, the colocated GPU tests (the resident
# round and the IPC weight update), vs TRL at 64x8x128, the shared-prefix forward against the plain one, and
# what one training micro-batch asks of the GPU (kernels and host syncs, bench/step/launches.py).
set -u
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
MODEL=$(python3 -c "import sys; sys.path.insert(0, 'bench/step'); from rl_step import build_model; print(build_model('configs/gpu-small.yaml'))" 2>"$OUT/build.err" | tail -1)
echo "model: $MODEL"
quiet() { grep -v -E "Loading weights|Writing model|it/s\]|^\s*$"; }
timeout 230 python3 bench/step/vs_trl.py --device cuda --model "$MODEL" --runs 2 --steps 3 2>&1 | quiet | tee "$OUT/small.log"
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu -rs \
  -k "colocated_grpo_stays or colocated_ppo_sleeps" 2>&1 | tail -25 | tee "$OUT/tests.log"
timeout 150 python3 bench/step/vs_trl.py --device cuda --model "$MODEL" --prompts 64 --new-tokens 128 --runs 1 --steps 2 \
  --set '{"actor.micro_batch_tokens": null}' \
  2>&1 | quiet | tee "$OUT/large.log"
(cd bench/step && timeout 60 python3 shared_prefix.py --device cuda --model "$MODEL" --repeats 8 2>&1 | quiet | tee "$OUT/prefix.log")
(cd bench/step && timeout 60 python3 launches.py --device cuda --model "$MODEL" 2>&1 | quiet | tee "$OUT/launches.log")
