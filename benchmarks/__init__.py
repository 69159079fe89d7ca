"""Speed tools for working on the decoder and the server, run from a checkout
(not installed with the package), each ``python -m benchmarks.NAME`` from the
repository root:

* ``overhead``: decoder time over the same forwards run bare (recorded and
  replayed by ``refusion_mlx.bench.forward_replay``), host time per step;
* ``scaling``: time per token against budget and prompt length, peak memory
  against slots decoded in parallel;
* ``profile_decoder``: cProfile of decoder runs, own time in buckets;
* ``soak``: the server under mixed traffic (report in ``soak_report``);
* ``forward_cost``, ``kernel_count``, ``matmul_rows``: a forward's cost by
  width against mlx-lm's one-token forward, its kernels per layer, and its
  linear layers' matmuls by rows in each layout (``gpu_record.sh`` runs
  them on a lent GPU).

``speed_common`` is what the first three share; ``shape-8.json`` a suite for
real-shape random checkpoints (``python -m convert.make_checkpoint``), used
with ``python -m refusion_mlx.bench --suite benchmarks/shape-8.json``. The
user-facing benchmark against autoregressive decoding is the package's
``python -m refusion_mlx.bench``. docs/benchmarks.md has every command and
its measurements.
"""

import refusion_mlx  # noqa: F401  (first: it binds an optimized BLAS before mlx.core loads)
