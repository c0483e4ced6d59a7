#!/usr/bin/env bash
# One prepared check for a lent GPU (one CUDA device, no network, torch with CUDA and Triton
# installed, nothing else installable), within 6 minutes in all:
#   1. the CUDA-marked tests (kernels vs references on the GPU, xformers, MegaBlocks adapter);
#   2. bench_kernels.py, bench_moe.py, bench_blocks.py in bf16;
#   3. bench_train.py at two shapes (8 layers d 1024; GPT-2 small with its 50304 vocabulary),
#      eager and compiled, and profile_step.py (syncs, kernels, busy share) at the first;
#   4. step_launches.py --cuda: the kernels of one compiled step per preset by the CUDA
#      profiler, to set beside the CPU proxy's count (results/launches.json);
#   5. gpu_verdicts.py: every target of the GPU-step issue with its verdict (verdicts.json).
# Every JSON (and each step's log) goes under $OUT (default benchmarks/results/gpu/).
#
#   bash benchmarks/gpu_check.sh            # on the GPU machine, from the repository root
#   bash benchmarks/gpu_check.sh --cpu-try  # the same steps on CPU at small sizes (catches typos)
#
# Pure-Python dependencies the GPU machine lacks (omegaconf, pytest, ...) can travel with the
# tree: `make gpu-deps` installs them into .gpu_deps/, which this script puts on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
[ -x "$ROOT/.venv/bin/python" ] && [ -z "${PYTHON:-}" ] && [ "${1:-}" = "--cpu-try" ] && PY="$ROOT/.venv/bin/python"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
[ -d "$ROOT/.gpu_deps" ] && export PYTHONPATH="$PYTHONPATH:$ROOT/.gpu_deps"
OUT=${OUT:-$ROOT/benchmarks/results/gpu}
mkdir -p "$OUT"
export MODE_BENCH_RESULTS="$OUT"

if [ "${1:-}" = "--cpu-try" ]; then
  DEVICE=cpu
  KERNELS_ARGS="--device cpu --small --interpret-smoke --repeats 2 --warmup 1"
  MOE_ARGS="--device cpu --tokens 1024 --d-model 256 --d-ff 256 --repeats 2 --warmup 1"
  BLOCKS_ARGS="--device cpu --seq 256 --batch 2 --d-model 256 --n-heads 4 --capacities 0.125 --repeats 2 --warmup 1"
  TRAIN_ARGS="--device cpu --modes bf16_eager --presets dense mod --batch 2 --seq 128 --layers 2 --repeats 2 --warmup 1"
  GPT2_ARGS="--device cpu --modes bf16_eager --presets dense nanogpt --batch 2 --seq 64 --layers 2 --d-model 64"
  GPT2_ARGS="$GPT2_ARGS --n-heads 2 --vocab 512 --repeats 2 --warmup 1"
  PROFILE_ARGS="--device cpu --presets dense mod --batch 2 --seq 64 --layers 2 --d-model 64 --n-heads 2"
  LAUNCH_ARGS="--presets dense mod --layers 2 --d-model 64"
  LIMITS=(300 300 300 300 300 300 300 600)
else
  DEVICE=cuda
  KERNELS_ARGS="--device cuda --repeats 7"
  MOE_ARGS="--device cuda --tokens 32768 --d-model 2048 --d-ff 1408 --repeats 5"
  BLOCKS_ARGS="--device cuda --seq 4096 --batch 8 --d-model 2048 --n-heads 16 --repeats 5"
  TRAIN_ARGS="--device cuda --modes bf16_eager bf16_compiled --presets dense mod mod_random moe mode_staged"
  TRAIN_ARGS="$TRAIN_ARGS mode_integrated --batch 16 --seq 1024 --layers 8 --d-model 1024 --n-heads 16 --repeats 5"
  GPT2_ARGS="--device cuda --modes bf16_eager bf16_compiled --presets dense nanogpt dense_norope mod mod_random moe"
  GPT2_ARGS="$GPT2_ARGS --gpt2-small --vocab 50304 --repeats 5"
  PROFILE_ARGS="--device cuda --presets dense nanogpt mod moe --batch 16 --seq 1024 --layers 8 --d-model 1024"
  PROFILE_ARGS="$PROFILE_ARGS --n-heads 16 --steps 3 --warmup 2 --top 6"
  LAUNCH_ARGS="--cuda --label cuda"
  LIMITS=(30 25 40 25 90 85 35 30)  # seconds per step: 360 in all, the 6-minute budget
fi

status=0
step() {  # step NAME LIMIT_SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "== $name: exit $rc after $((SECONDS - t0))s"
  [ "$rc" -ne 0 ] && status=1
  return 0
}

"$PY" - <<'EOF' | tee "$OUT/environment.txt"
import importlib.util, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)")
for name in ("triton", "omegaconf", "pytest", "hypothesis", "xformers", "grouped_gemm", "matplotlib"):
    spec = importlib.util.find_spec(name)
    print(f"{name}: {'present' if spec else 'MISSING'}")
EOF
if [ "$DEVICE" = cuda ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device visible: run with --cpu-try on a machine without a GPU" >&2
  exit 2
fi

step cuda-tests "${LIMITS[0]}" "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/
step bench-kernels "${LIMITS[1]}" "$PY" -m benchmarks.bench_kernels --dtype bfloat16 $KERNELS_ARGS
step bench-moe "${LIMITS[2]}" "$PY" -m benchmarks.bench_moe --dtypes bfloat16 $MOE_ARGS
step bench-blocks "${LIMITS[3]}" "$PY" -m benchmarks.bench_blocks --dtype bfloat16 $BLOCKS_ARGS
step bench-train "${LIMITS[4]}" "$PY" -m benchmarks.bench_train $TRAIN_ARGS --label d1024
step bench-train-gpt2 "${LIMITS[5]}" "$PY" -m benchmarks.bench_train $GPT2_ARGS --label gpt2-small
step profile "${LIMITS[6]}" "$PY" -m benchmarks.profile_step $PROFILE_ARGS
step launches "${LIMITS[7]}" "$PY" -m benchmarks.step_launches $LAUNCH_ARGS
"$PY" -m benchmarks.gpu_verdicts "$OUT" >"$OUT/verdicts.txt" 2>&1 || status=1
cat "$OUT/verdicts.txt"
echo "results in $OUT:"
ls "$OUT"
exit $status
