#!/usr/bin/env bash
# Issue 38's checks on a lent GPU, in two device calls that each fit the device tool's 10 minutes a
# command (and, with the machine's start, its 15 minutes a session). Here, first:
#
#   ../shared/gpu/stage.sh && bash bench/stage_trl.sh     # .gpu/: Ray, DeepSpeed, pydantic; TRL's wheels
#
# then on the device, from the project root, with carry [".gpu"], one call each (timeout_s 450 and 330):
#
#   source .gpu/activate.sh && bash bench/gpu_session.sh 1   # vs TRL at 32x8x32, the colocated GPU tests,
#                                                            # one micro-batch's kernels (launches.py)
#   source .gpu/activate.sh && bash bench/gpu_session.sh 2   # vs TRL at 64x8x128, the shared-prefix forward
#
# Each part has a time limit of its own (timeout -k: a Ray driver still in its finally block is killed
# too, not left holding the GPU for the next part) and writes its log under $OUT as it goes, so a part
# that hangs costs only its own share; vs_trl.py prints each side's run as it ends.
set -u
PART=${1:-1}
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -c "import datasets, trl; from trl import GRPOTrainer; print('trl', trl.__version__)" >"$OUT/trl.txt" 2>&1 || {
  echo "no TRL here (bench/stage_trl.sh stages it): vs_trl.py runs alignflow's side alone"; cat "$OUT/trl.txt"; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
MODEL=$(cat /tmp/alignflow-gpu-model 2>/dev/null)  # part 2 on the machine part 1 left warm: built already
if [[ -z "$MODEL" || ! -d "$MODEL" ]]; then
  MODEL=$(python3 -c "import sys; sys.path.insert(0, 'bench/step'); from rl_step import build_model; print(build_model('configs/gpu-small.yaml'))" 2>"$OUT/build.err" | tail -1)
  [[ -d "$MODEL" ]] && echo "$MODEL" >/tmp/alignflow-gpu-model
fi
echo "model: $MODEL"
quiet() { grep --line-buffered -v -E "Loading weights|Writing model|it/s\]|^\s*$"; }
sides=$(grep -q '^trl ' "$OUT/trl.txt" && echo alignflow,trl || echo alignflow)
if [[ "$PART" == 1 ]]; then
  timeout -k 10 200 python3 bench/step/vs_trl.py --device cuda --model "$MODEL" --runs 2 --steps 3 --sides "$sides" \
    2>&1 | quiet | tee "$OUT/small.log"
  timeout -k 10 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu -rs \
    -k "colocated_grpo_stays or colocated_ppo_sleeps" >"$OUT/tests.log" 2>&1; tail -25 "$OUT/tests.log"
  (cd bench/step && timeout -k 10 60 python3 launches.py --device cuda --model "$MODEL" 2>&1 | quiet \
    | tee "$OUT/launches.log")
else
  timeout -k 10 220 python3 bench/step/vs_trl.py --device cuda --model "$MODEL" --prompts 64 --new-tokens 128 \
    --runs 1 --steps 2 --sides "$sides" --set '{"actor.micro_batch_tokens": null}' 2>&1 | quiet | tee "$OUT/large.log"
  (cd bench/step && timeout -k 10 60 python3 shared_prefix.py --device cuda --model "$MODEL" --repeats 8 2>&1 \
    | quiet | tee "$OUT/prefix.log")
fi
