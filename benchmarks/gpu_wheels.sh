#!/usr/bin/env bash
# MLX's CUDA build for a lent GPU (docs/benchmarks.md, "On a lent GPU"), in
# pieces a device call can carry (64 MiB each): the wheels of mlx, mlx-cuda-13
# and mlx-lm for the device's Python, unpacked, packed again as one xz
# stream and cut in two.
#
#     benchmarks/gpu_wheels.sh                 # here (PyPI reachable): writes .whl/ and .whl2/ (git-ignored)
#     # carry .whl in one device call and .whl2 in the next (a warm machine keeps the first), there:
#     benchmarks/gpu_wheels.sh check           # call 1, no wheels needed: the Python, the GPU, the CUDA libraries, nsys
#     benchmarks/gpu_wheels.sh install         # call 2: unpacks both into $SITE (default /tmp/site), then verify
#     benchmarks/gpu_wheels.sh verify          # MLX computes on the GPU: NVRTC, cuBLASLt and cuDNN load
#     export PYTHONPATH=${SITE:-/tmp/site}:$PWD
#
# The versions are the ones the H200 record ran (2026-11-28); PYVER is the
# device's Python (3.12 there). mlx-cuda-13 is carried without its
# dependencies (nvidia-cudnn-cu13 9.*, nvidia-cublas 13.*, nvidia-cuda-nvrtc
# 13.*, nvidia-cuda-runtime 13.*, nvidia-cufft 12.*, nvidia-cusolver 12.*,
# nvidia-nccl-cu13: several hundred MiB): the machine must have their
# libraries, on its loader's path or as the device Python's nvidia packages
# (install links those where libmlx.so looks for them). check and verify
# name what is missing in one line, before a step spends the lease on it.
set -euo pipefail
cd "$(dirname "$0")/.."
MLX=${MLX:-0.32.4}
MLX_LM=${MLX_LM:-0.32.2}
PYVER=${PYVER:-3.12}
SITE=${SITE:-/tmp/site}
PART=38m
PY=${PYTHON:-python3}
# the libraries libmlx.so needs (readelf -d: NEEDED) beyond the system's own
LIBS="libcuda.so.1 libcudnn.so.9 libcublasLt.so.13 libnvrtc.so.13 libcufft.so.12 libcusolver.so.12 libnccl.so.2"
NEEDS="nvidia-cudnn-cu13 9.*, nvidia-cublas 13.*, nvidia-cuda-nvrtc 13.*, nvidia-cufft 12.*, nvidia-cusolver 12.*, nvidia-nccl-cu13"

nvidia_packages() {  # the device Python's pip-installed NVIDIA libraries (site-packages/nvidia), if any
  "$PY" -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null || true
}
found() {  # $1: a library's soname, on the loader's path or among the Python's NVIDIA packages
  local dir nv
  ldconfig -p 2>/dev/null | grep -q "^[[:space:]]*$1 " && return 0
  nv=$(nvidia_packages)
  for dir in ${LD_LIBRARY_PATH:+${LD_LIBRARY_PATH//:/ }} ${nv:+$nv/*/lib}; do
    [ -e "$dir/$1" ] && return 0
  done
  return 1
}
missing_libs() {  # what libmlx.so needs and the loader does not find (ldd where the wheels are unpacked)
  local lib
  if [ -f "$SITE/mlx/lib/libmlx.so" ] && command -v ldd >/dev/null; then
    ldd "$SITE/mlx/lib/libmlx.so" 2>/dev/null | awk '/not found/ {print $1}' | tr '\n' ' ' || true
  else
    for lib in $LIBS; do found "$lib" || printf '%s ' "$lib"; done
  fi
}
nsys_path() {
  command -v nsys 2>/dev/null || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1
}
verify() {  # MLX computes on the GPU, each CUDA library it loads on first use loaded once
  local missing out
  missing=$(missing_libs)
  if [ -n "$missing" ]; then
    echo "mlx-cuda-13 cannot load here: ${missing% } not found (it needs $NEEDS, not carried)" >&2
    return 1
  fi
  if ! out=$(PYTHONPATH="$SITE:$PWD" "$PY" - 2>&1 <<'PY'
import sys

import mlx.core as mx

stage = "MLX on the GPU (the CUDA driver and runtime)"
try:
    assert mx.default_device() == mx.gpu, f"mlx computes on {mx.default_device()}, not a GPU"
    mx.zeros(1).item()
    # imported as the commands import it (refusion_mlx._startup): transformers leaves PyTorch out (~2 s)
    stage = "mlx-lm (and transformers, which it imports)"
    sys.modules.setdefault("torch", None)
    import mlx_lm  # noqa: F401
    stage = "NVRTC (libnvrtc.so.13: kernels compiled on first use)"
    mx.eval(mx.compile(lambda a: mx.exp(a) * 2 + 1)(mx.ones((4, 64))))
    stage = "cuBLASLt (libcublasLt.so.13: bf16 matmuls of 2 rows or more)"
    a = mx.ones((2, 64), dtype=mx.bfloat16)
    mx.eval(a @ a.T)
    stage = "cuDNN (libcudnn.so.9: fused attention of several query rows)"
    q = mx.ones((1, 2, 4, 64), dtype=mx.bfloat16)
    mx.eval(mx.fast.scaled_dot_product_attention(q, q, q, scale=0.125, mask="causal"))
except Exception as e:  # one line: which library, and MLX's first line about it
    raise SystemExit(f"{stage} fails: {(str(e) or type(e).__name__).splitlines()[0]}")
print("mlx", mx.__version__, mx.default_device(), "computes here (NVRTC, cuBLASLt and cuDNN loaded)")
PY
  ); then
    out=$(tail -2 <<<"$out" | tr '\n' ' ')
    echo "mlx's CUDA build fails here: ${out% }" >&2
    return 1
  fi
  echo "$out"
}

case ${1:-prepare} in
  prepare)
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    py=${PYTHON:-python3}
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
      --platform manylinux_2_35_x86_64 -d "$work/wheels" "mlx==$MLX" "mlx-cuda-13==$MLX" "mlx-lm==$MLX_LM"
    mkdir -p "$work/site"
    for w in "$work"/wheels/*.whl; do
      "$py" -m zipfile -e "$w" "$work/site"
    done
    rm -rf .whl .whl2
    mkdir -p .whl .whl2
    tar -C "$work/site" -cf - . | xz -9e -T0 | split -b "$PART" - "$work/mlxpart."
    parts=("$work"/mlxpart.*)
    if [ "${#parts[@]}" -ne 2 ]; then
      echo "expected 2 pieces of $PART, got ${#parts[@]}: change PART" >&2
      exit 1
    fi
    mv "${parts[0]}" .whl/
    mv "${parts[1]}" .whl2/
    ls -l .whl .whl2 ;;
  check|install)
    have=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if [ "$have" != "$PYVER" ]; then
      echo "these wheels are for Python $PYVER; $PY here is $have (PYVER=$have, then prepare again)" >&2
      exit 1
    fi
    if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
      echo "no NVIDIA GPU here (nvidia-smi finds none): MLX's CUDA build is for a lent GPU" >&2
      exit 1
    fi
    if [ "$1" = check ]; then
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
      echo "Python $have; nsys: $(nsys_path || true)"
      missing=$(missing_libs)
      if [ -n "$missing" ]; then
        echo "not found here: ${missing% } (mlx-cuda-13 needs $NEEDS)" >&2
        exit 1
      fi
      echo "the CUDA libraries mlx-cuda-13 needs are here ($LIBS)"
      exit 0
    fi
    mkdir -p "$SITE"
    cat .whl/mlxpart.* .whl2/mlxpart.* | xz -d | tar -x -C "$SITE"
    nv=$(nvidia_packages)  # libmlx.so looks in $SITE/nvidia/*/lib (its RPATH) before the loader's path
    if [ -n "$nv" ] && [ ! -e "$SITE/nvidia" ]; then ln -s "$nv" "$SITE/nvidia"; fi
    verify ;;
  verify) verify ;;
  *)
    echo "usage: benchmarks/gpu_wheels.sh [prepare|check|install|verify]" >&2
    exit 2 ;;
esac
