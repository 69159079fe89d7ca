"""``python -m refusion_mlx.bench``: ReFusion against mlx-lm's autoregressive
decoding of the same weights, in one process.

The prompt suite (``suite``, ``suite.json``), one timed run per side
(``runs``), the comparison and its report (``compare``, ``report``); the
other measurements (``modes``): ``concurrency``, ``serving`` (``--http``,
``--conversation``), ``layouts`` and ``shapes`` (``--shape``, which replays
recorded forwards with ``forward_replay``).

The decoder's and the server's speed tools for developers (overhead,
scaling, profiler, soak) are not installed: they live in the repository's
``benchmarks/``, each ``python -m benchmarks.NAME`` from a checkout.
"""

from .compare import format_report, run_benchmark

__all__ = ["format_report", "main", "run_benchmark"]


def main(argv=None) -> int:
    """``python -m refusion_mlx.bench`` from Python (the command is ``__main__``'s)."""
    from .__main__ import main as command

    return command(argv)
