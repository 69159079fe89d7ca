"""``python -m refusion_mlx.bench``: ReFusion against mlx-lm's autoregressive
decoding of the same weights, in one process.

The prompt suite (``suite``, ``suite.json``), one timed run per side
(``runs``), the comparison and its report (``compare``, ``report``).

The decoder's speed scripts, each ``python -m refusion_mlx.bench.NAME``:
``overhead`` (decoder time over the same forwards run bare, recorded and
replayed by ``forward_replay``), ``scaling`` (budget, prompt length, slots)
and ``profile_decoder`` (cProfile buckets); ``speed_common`` is what they
share, ``shape-8.json`` the suite for real-shape random checkpoints.
"""

from .compare import format_report, run_benchmark

__all__ = ["format_report", "main", "run_benchmark"]


def main(argv=None) -> int:
    """``python -m refusion_mlx.bench`` from Python (the command is ``__main__``'s)."""
    from .__main__ import main as command

    return command(argv)
