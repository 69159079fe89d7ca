#!/usr/bin/env bash
# MLX's CUDA build for a lent GPU (docs/benchmarks.md, "On a lent GPU"), in
# pieces a device call can carry (64 MiB each): the wheels of mlx, mlx-cuda-13
# and mlx-lm for the device's Python, unpacked, packed again as one xz
# stream and cut in two.
#
#     benchmarks/gpu_wheels.sh                 # here (PyPI reachable): writes .whl/ and .whl2/ (git-ignored)
#     # carry .whl in one device call and .whl2 in the next (a warm machine keeps the first), then there:
#     benchmarks/gpu_wheels.sh install         # unpacks both into $SITE (default /tmp/site)
#     export PYTHONPATH=${SITE:-/tmp/site}:$PWD
#
# The versions are the ones the H200 record ran (2026-11-28); PYVER is the
# device's Python (3.12 there).
set -euo pipefail
cd "$(dirname "$0")/.."
MLX=${MLX:-0.32.4}
MLX_LM=${MLX_LM:-0.32.2}
PYVER=${PYVER:-3.12}
SITE=${SITE:-/tmp/site}
PART=38m

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
  install)
    have=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if [ "$have" != "$PYVER" ]; then
      echo "these wheels are for Python $PYVER; python3 here is $have (PYVER=$have, then prepare again)" >&2
      exit 1
    fi
    if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
      echo "no NVIDIA GPU here (nvidia-smi finds none): MLX's CUDA build is for a lent GPU" >&2
      exit 1
    fi
    mkdir -p "$SITE"
    cat .whl/mlxpart.* .whl2/mlxpart.* | xz -d | tar -x -C "$SITE"
    PYTHONPATH="$SITE:$PWD" python3 -c "import mlx.core as mx, mlx_lm; print('mlx', mx.__version__, mx.default_device())" ;;
  *)
    echo "usage: benchmarks/gpu_wheels.sh [prepare|install]" >&2
    exit 2 ;;
esac
