#!/usr/bin/env bash
# The measurements of a GPU record (docs/benchmarks.md, "A wide forward on
# the H200"), run from a checkout with mlx (its CUDA backend), mlx-lm and
# pytest importable:
#
#     benchmarks/gpu_record.sh OUT
#
# In order of what they decide, each step writing into OUT (a step that
# fails is logged and the next one runs):
#   1. the cost of a forward by width in bfloat16 at ReFusion-8B's shape,
#      attention fused (the old way) and unfused, against mlx-lm's one-token
#      forward (benchmarks.forward_cost);
#      and once more at a fixed cache length (cuDNN's graphs planned once);
#   2. bench --shape refusion-8b in bfloat16, attention fused ("before"),
#      then as the runtime chooses ("after") with 8 requests at once;
#   3. the golden cases in float32, alone and in one batch;
#   4. steps 1 and 2 with 4-bit weights.
# Then python -m benchmarks.gpu_record OUT makes benchmarks/records/<device>-<date>.json.
set -u
OUT=${1:?usage: benchmarks/gpu_record.sh OUT}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
step() { echo "== $(date +%T) $*"; }
bench_shape() {  # $1: label, $2: attention mode, then extra flags
  local label=$1 mode=$2
  shift 2
  step "bench --shape refusion-8b $label (attention $mode)"
  REFUSION_MLX_ATTENTION=$mode $PY -m refusion_mlx.bench --shape refusion-8b --dtype bfloat16 "$@" \
    --json "$OUT/shape-$label-$mode.json" || echo "step failed: $?"
}

step "device"
$PY -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), mx.device_info())"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

step "forward cost, bfloat16"
$PY -m benchmarks.forward_cost --shape refusion-8b --dtype bfloat16 --attention fused,unfused \
  --json "$OUT/fc-bf16.json" || echo "step failed: $?"
step "forward cost, bfloat16, fused attention at one cache length (what cuDNN costs once planned)"
$PY -m benchmarks.forward_cost --shape refusion-8b --dtype bfloat16 --attention fused,unfused --fixed-kv \
  --phases plan,infill --widths 1,4,16,32 --kv 1024 --no-ar --no-split || echo "step failed: $?"
bench_shape bf16 fused
bench_shape bf16 auto --batch 8

step "golden cases, float32"
$PY -m pytest -q -p no:cacheprovider tests/test_golden.py -k token_exact \
  "tests/test_batch.py::test_every_golden_case_in_one_batch_is_token_exact" 2>&1 | tail -3

step "forward cost, 4-bit"
$PY -m benchmarks.forward_cost --shape refusion-8b --dtype bfloat16 --q-bits 4 \
  --json "$OUT/fc-q4.json" || echo "step failed: $?"
bench_shape q4 fused --q-bits 4
bench_shape q4 auto --q-bits 4 --batch 8

step "forward cost, 4-bit, narrow passes not padded (REFUSION_MLX_QMM_PAD=off: the width policy's before)"
REFUSION_MLX_QMM_PAD=off $PY -m benchmarks.forward_cost --shape refusion-8b --dtype bfloat16 --q-bits 4 \
  --widths 1,2,4,7,8 --kv 1024 --no-ar --no-split --json "$OUT/fc-q4-unpadded.json" || echo "step failed: $?"
step "done"
