"""Maintainers' measuring scripts, run from the repository root as
``python -m benchmarks.NAME`` (see docs/benchmarks.md). The user-facing
benchmark is ``python -m refusion_mlx.bench``."""
