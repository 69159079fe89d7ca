#!/usr/bin/env bash
# The measurements of a GPU record for issue 49 (docs/benchmarks.md, "On a
# lent GPU"), run from a checkout with mlx (its CUDA backend), mlx-lm and
# pytest importable:
#
#     benchmarks/gpu_record.sh [--force] [--budget SECONDS] OUT [STEP ...]
#     benchmarks/gpu_record.sh --plan [STEP ...]      # each step's device time, estimated; nothing runs
#
# Each step writes into OUT (a step that fails is logged and the next one
# runs). The steps, in the order issue 49 needs them (STEPS below, with what
# each one costs at refusion-8b, estimated from the H200 run of 2026-11-28:
# docs/benchmarks.md, "What each step costs"):
#   the instrument (forward cost by width, bf16 and 4-bit, AR's rows beside);
#   bench --shape against mlx-lm AR (1.5/2/2.5/3 tokens per forward; in bf16
#   also 8 requests' forwards replayed in one batch, not the server); the golden cases in float32 as the runtime attends; then
#   the candidates' runs (bucketed attention, the 4-bit padding off/on,
#   REFUSION_MLX_OVERLAP=on) and the golden cases under them; last, where
#   nsys is installed, a trace of MLX's own NVTX ranges (nsys_*.csv).
# On a lent GPU run a few steps a call, as the docs' calls do: a call's
# files come back when it ends. Steps estimated past one call's 540 s (a
# command stops at 10 minutes) are refused unless --force; --budget SECONDS
# instead skips each step that would end past SECONDS (the estimate against
# the time left), so a last call runs what the lease still holds.
# Then python -m benchmarks.gpu_record OUT [OUT ...] (each call's folder) makes benchmarks/records/<device>-<date>.json
# and prints, for each switch measured on and off, what the forwards say of it.
# SHAPE=tiny runs every step at a toy shape: a dry run on any machine (about 3 minutes on a CPU;
# REFUSION_MLX_PATHS=gpu takes the GPU paths there). The estimates are refusion-8b's. Any other shape
# is refused where MLX's default device is not a GPU (--plan runs nothing, so it runs anywhere).
# The exit status is the number of steps that failed (0: all ran; 2: bad arguments), each also said where it
# failed; everything it prints also goes to OUT/log.txt (appended), so no tee is needed. OUT/run.json
# stamps the run's UTC day and the files it measured (benchmarks.run_stamp), which the record takes.
set -u
# name                seconds  what (seconds: device time at refusion-8b on an H200, a fresh process each)
STEPS_TABLE="\
fc-bf16              120  forward cost by width, bf16: runtime's attention and bucketed, 3 phases, 1-32 tokens, 256/1k/4k rows, AR
fc-q4                150  the same, 4-bit, plan and infill, 1-32 tokens, 256/4k rows (a machine's first 4-bit process: ~100 s of compiles)
shape-bf16            85  bench --shape, bf16, runtime's attention: 1.5-3 tokens/forward against mlx-lm AR, 8 replayed in a batch
shape-q4              55  bench --shape, 4-bit, runtime's attention
golden                50  golden cases, float32, runtime's attention, alone and in one batch
shape-bf16-bucketed   55  bench --shape, bf16, bucketed attention
golden-bucketed       55  golden cases, float32, bucketed attention
fc-q4-pad             60  4-bit plan passes of 1-8 tokens, REFUSION_MLX_QMM_PAD=off and =on (two processes)
shape-q4-bucketed     55  bench --shape, 4-bit, bucketed attention
fc-overlap            35  whole forwards with REFUSION_MLX_OVERLAP=on, both attentions
golden-cpu            30  golden cases, float32, the CPU paths on the device
nsys                  60  MLX's NVTX ranges and CUDA kernels over a few bf16 forwards, under nsys (0 s without nsys)"
ALL_STEPS=$(awk '{print $1}' <<<"$STEPS_TABLE" | tr '\n' ' ')
CALL_SECONDS=540
usage="usage: benchmarks/gpu_record.sh [--force] [--budget SECONDS] OUT [STEP ...] | --plan [STEP ...]"
estimate() { awk -v s="$1" '$1 == s {print $2}' <<<"$STEPS_TABLE"; }

ARGS=("$@")
FORCE="" BUDGET="" PLAN=""
while [ $# -gt 0 ]; do
  case $1 in
    --force) FORCE=1; shift ;;
    --plan) PLAN=1; shift ;;
    --budget)
      [[ ${2:-} =~ ^[0-9]+$ ]] || { echo "--budget takes whole seconds ($usage)" >&2; exit 2; }
      BUDGET=$2; shift 2 ;;
    --help|-h) echo "$usage"; echo "$STEPS_TABLE"; exit 0 ;;
    --*) echo "unknown option $1 ($usage)" >&2; exit 2 ;;
    *) break ;;
  esac
done
if [ -z "$PLAN" ]; then
  [ $# -gt 0 ] || { echo "$usage" >&2; exit 2; }
  OUT=$1
  shift
fi
STEPS=${*:-$ALL_STEPS}
TOTAL=0
for s in $STEPS; do  # every name checked before any step runs: a typo costs no device time
  case " $ALL_STEPS " in
    *" $s "*) TOTAL=$((TOTAL + $(estimate "$s"))) ;;
    *) echo "unknown step $s (steps: $ALL_STEPS)" >&2; exit 2 ;;
  esac
done
SHAPE=${SHAPE:-refusion-8b}
if [ -n "$PLAN" ]; then
  for s in $STEPS; do grep "^$s " <<<"$STEPS_TABLE"; done
  echo "total: about $TOTAL s at refusion-8b (one call holds $CALL_SECONDS s: a command stops at 600)"
  exit 0
fi
if [ "$SHAPE" = refusion-8b ] && [ $TOTAL -gt $CALL_SECONDS ] && [ -z "$FORCE$BUDGET" ]; then
  echo "steps $(echo $STEPS) take about $TOTAL s at refusion-8b, more than one call's $CALL_SECONDS s (a command" \
       "stops at 10 minutes): run them in the calls of docs/benchmarks.md (\"On a lent GPU\"), or pass --budget" \
       "SECONDS or --force" >&2
  exit 2
fi
PY=${PYTHON:-python3}
# refusion-8b off a GPU builds 8B bf16 weights on the CPU (killed for memory, or hours a step): refused
# (an mlx that does not import is said below, by the import check)
if [ "$SHAPE" != tiny ]; then
  $PY -c "import mlx.core as mx; raise SystemExit(3 * (mx.default_device().type != mx.DeviceType.gpu))" 2>/dev/null
  if [ $? -eq 3 ]; then
    echo "MLX's default device here is not a GPU, and the steps at $SHAPE need one: off a GPU run the dry" \
         "run, SHAPE=tiny benchmarks/gpu_record.sh OUT [STEP ...] (REFUSION_MLX_PATHS=gpu takes the GPU paths)" >&2
    exit 2
  fi
fi
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" || exit 1
if [ -z "${GPU_RECORD_LOGGING:-}" ]; then  # its own log, OUT/log.txt (appended), and its own exit status
  GPU_RECORD_LOGGING=1 bash "$0" "${ARGS[@]}" 2>&1 | tee -a "$OUT/log.txt"
  exit "${PIPESTATUS[0]}"
fi
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."  # the checkout's root: its benchmarks and tests, wherever this was started
# mlx.core loaded (a CUDA wheel without its libraries fails here); mlx_lm found, not imported: its
# transformers imports PyTorch wherever that is installed (~2 s here, for nothing)
if ! $PY -c "import importlib.util, mlx.core, pytest; assert importlib.util.find_spec('mlx_lm')" 2>/dev/null; then
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
  REFUSION_MLX_ATTENTION=$mode $PY -m refusion_mlx.bench --shape "$SHAPE" --dtype bfloat16 "$@" \
    --json "$OUT/shape-$label-$mode.json" || failed $?
}
nsys_path() {
  command -v nsys 2>/dev/null || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1
}
golden() {  # $1: the label; then the environment: the golden cases in float32, alone and in one batch
  step "golden cases, float32 ($1)"
  shift
  local log
  log=$(env "$@" $PY -m pytest -q -p no:cacheprovider tests/test_golden.py -k token_exact \
        "tests/test_batch.py::test_every_golden_case_in_one_batch_is_token_exact" 2>&1)
  local rc=$?
  echo "$log" | tail -3
  [ $rc -eq 0 ] || failed $rc
}

step "device"
$PY -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), mx.device_info())"
$PY -m benchmarks.run_stamp "$OUT" || echo "no run.json: the record will not know the day or the tree measured"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
echo "nsys: $(nsys_path || true)"

for s in $STEPS; do
  if [ -n "$BUDGET" ] && [ $((SECONDS + $(estimate "$s"))) -gt "$BUDGET" ]; then
    echo "== skipped $s: about $(estimate "$s") s, $((BUDGET - SECONDS)) s left of --budget $BUDGET"
    continue
  fi
  case $s in
    fc-bf16)
      step "forward cost, bfloat16"
      fc --attention auto,bucketed --widths 1,2,4,8,16,32 --kv 256,1024,4096 --json "$OUT/fc-bf16.json" ;;
    fc-q4)
      step "forward cost, 4-bit"
      fc --q-bits 4 --attention auto,bucketed --phases plan,infill --widths 1,4,8,16,32 --kv 256,4096 \
        --json "$OUT/fc-q4.json" ;;
    shape-bf16) bench_shape bf16 auto --batch 8 ;;
    shape-q4) bench_shape q4 auto --q-bits 4 ;;
    golden) golden "attention auto" REFUSION_MLX_ATTENTION=auto ;;
    shape-bf16-bucketed) bench_shape bf16 bucketed ;;
    golden-bucketed) golden "attention bucketed" REFUSION_MLX_ATTENTION=bucketed ;;
    fc-q4-pad)
      for pad in off on; do
        step "forward cost, 4-bit, narrow passes (REFUSION_MLX_QMM_PAD=$pad)"
        REFUSION_MLX_QMM_PAD=$pad fc --q-bits 4 --attention bucketed --phases plan --widths 1,2,4,7,8 \
          --kv 1024 --no-ar --no-split --json "$OUT/fc-q4-pad-$pad.json"
      done ;;
    shape-q4-bucketed) bench_shape q4 bucketed --q-bits 4 ;;
    fc-overlap)
      step "forward cost, bfloat16, REFUSION_MLX_OVERLAP=on"
      REFUSION_MLX_OVERLAP=on fc --attention auto,bucketed --phases plan,infill --widths 1,16,32 --kv 1024,4096 \
        --no-split --no-ar --json "$OUT/fc-bf16-overlap.json" ;;
    golden-cpu) golden "the CPU paths, on the device" REFUSION_MLX_PATHS=cpu ;;
    nsys)  # MLX's CUDA backend names each op's host work in an NVTX range; its Python API makes none
      NSYS=$(nsys_path || true)
      if [ -z "$NSYS" ]; then
        step "nsys: not on this machine, no NVTX trace"
        continue
      fi
      step "nsys: MLX's NVTX ranges and CUDA kernels, bfloat16 plan passes of 1 and 16 tokens and AR's"
      trace=$(mktemp -d)/trace  # the trace itself stays on the device: its summaries come back
      "$NSYS" profile --trace=cuda,nvtx --force-overwrite=true --output="$trace" $PY -m benchmarks.forward_cost \
        --shape "$SHAPE" --dtype bfloat16 --phases plan --widths 1,16 --kv 1024 --no-split --repeat 3 || failed $?
      "$NSYS" stats --report nvtx_sum,cuda_gpu_kern_sum --format csv --output "$OUT/nsys" "$trace.nsys-rep" \
        >/dev/null || failed $? ;;
  esac
done
step "done: $FAILED failed"
exit $FAILED
