#!/usr/bin/env bash
# The measurements of a GPU record (docs/benchmarks.md, "A wide forward on
# the H200"), run from a checkout with mlx (its CUDA backend), mlx-lm and
# pytest importable:
#
#     benchmarks/gpu_record.sh OUT [STEP ...]      # default: every step, in this order
#
# Each step writes into OUT (a step that fails is logged and the next one
# runs). The steps, in order of what they decide; on a lent GPU run one or
# two a call (docs/benchmarks.md, "On a lent GPU"), so that each call's files
# come back even if a later call's machine is lost:
#   fc-bf16     the cost of a forward by width in bfloat16 at ReFusion-8B's
#               shape, attention as the runtime takes it on CUDA (unfused for
#               several query rows) and bucketed (fused at a few padded
#               shapes), against mlx-lm's one-token forward (benchmarks.forward_cost);
#               then whole forwards with REFUSION_MLX_OVERLAP=on (the first
#               layers computing while Python builds the rest)
#   golden      the golden cases in float32, alone and in one batch, as the
#               runtime attends and bucketed, then on the CPU paths
#   shape-bf16  bench --shape refusion-8b in bfloat16 with 8 requests at once:
#               the runtime's attention, then bucketed
#   fc-q4       the forward cost with 4-bit weights (both attentions), and narrow
#               widths with the 4-bit padding off (REFUSION_MLX_QMM_PAD=off,
#               the width policy's before) and on
#   shape-q4    bench --shape refusion-8b with 4-bit weights, both attentions
# Then python -m benchmarks.gpu_record OUT [OUT ...] (each call's folder) makes benchmarks/records/<device>-<date>.json
# and prints, for each switch measured on and off, what the forwards say of it.
# SHAPE=tiny runs every step at a toy shape: a dry run on any machine (about 2 minutes on a CPU).
# The exit status is the number of steps that failed (0: all ran), each also said where it failed;
# everything it prints also goes to OUT/log.txt (appended), so no tee is needed.
set -u
OUT=${1:?usage: benchmarks/gpu_record.sh OUT [fc-bf16 golden shape-bf16 fc-q4 shape-q4]}
shift
ALL_STEPS="fc-bf16 golden shape-bf16 fc-q4 shape-q4"
STEPS=${*:-$ALL_STEPS}
for s in $STEPS; do  # every name checked before any step runs: a typo costs no device time
  case " $ALL_STEPS " in
    *" $s "*) ;;
    *) echo "unknown step $s (steps: $ALL_STEPS)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
SHAPE=${SHAPE:-refusion-8b}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" || exit 1
if [ -z "${GPU_RECORD_LOGGING:-}" ]; then  # its own log, OUT/log.txt (appended), and its own exit status
  GPU_RECORD_LOGGING=1 bash "$0" "$OUT" "$@" 2>&1 | tee -a "$OUT/log.txt"
  exit "${PIPESTATUS[0]}"
fi
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."  # the checkout's root: its benchmarks and tests, wherever this was started
if ! $PY -c "import mlx.core, mlx_lm, pytest" 2>/dev/null; then
  echo "$PY cannot import mlx, mlx_lm and pytest (on a lent GPU: benchmarks/gpu_wheels.sh install, then" \
       "export PYTHONPATH=/tmp/site:\$PWD)" >&2
  exit 1
fi
FAILED=0
step() { echo "== $(date +%T) $*"; }
failed() { echo "step failed: $1"; FAILED=$((FAILED + 1)); }
fc() { $PY -m benchmarks.forward_cost --shape "$SHAPE" --dtype bfloat16 "$@" || failed $?; }
bench_shape() {  # $1: label, $2: attention mode, then extra flags
  local label=$1 mode=$2
  shift 2
  step "bench --shape $SHAPE $label (attention $mode)"
  REFUSION_MLX_ATTENTION=$mode $PY -m refusion_mlx.bench --shape "$SHAPE" --dtype bfloat16 --batch 8 "$@" \
    --json "$OUT/shape-$label-$mode.json" || failed $?
}
golden() {  # the golden cases in float32, alone and in one batch, under the environment given
  local log
  log=$(env "$@" $PY -m pytest -q -p no:cacheprovider tests/test_golden.py -k token_exact \
        "tests/test_batch.py::test_every_golden_case_in_one_batch_is_token_exact" 2>&1)
  local rc=$?
  echo "$log" | tail -3
  [ $rc -eq 0 ] || failed $rc
}

step "device"
$PY -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), mx.device_info())"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

for s in $STEPS; do
  case $s in
    fc-bf16)
      step "forward cost, bfloat16"
      fc --attention auto,bucketed --widths 1,2,4,8,16,32 --kv 256,1024,4096 --json "$OUT/fc-bf16.json"
      step "forward cost, bfloat16, REFUSION_MLX_OVERLAP=on"
      REFUSION_MLX_OVERLAP=on fc --attention auto,bucketed --phases plan,infill --widths 1,16,32 --kv 1024,4096 \
        --no-split --no-ar --json "$OUT/fc-bf16-overlap.json" ;;
    golden)
      for mode in auto bucketed; do
        step "golden cases, float32 (attention $mode)"
        golden REFUSION_MLX_ATTENTION=$mode
      done
      step "golden cases, float32 (the CPU paths, on the device)"
      golden REFUSION_MLX_PATHS=cpu ;;
    shape-bf16)
      bench_shape bf16 auto
      bench_shape bf16 bucketed ;;
    fc-q4)
      step "forward cost, 4-bit"
      fc --q-bits 4 --attention auto,bucketed --phases plan,infill --widths 1,4,8,16,32 --kv 256,4096 \
        --json "$OUT/fc-q4.json"
      for pad in off on; do
        step "forward cost, 4-bit, narrow passes (REFUSION_MLX_QMM_PAD=$pad)"
        REFUSION_MLX_QMM_PAD=$pad fc --q-bits 4 --attention bucketed --phases plan --widths 1,2,4,7,8 \
          --kv 1024 --no-ar --no-split --json "$OUT/fc-q4-pad-$pad.json"
      done ;;
    shape-q4)
      bench_shape q4 auto --q-bits 4
      bench_shape q4 bucketed --q-bits 4 ;;
  esac
done
step "done: $FAILED failed"
exit $FAILED
