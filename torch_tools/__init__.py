"""Conversion tooling that needs PyTorch: random checkpoints and the parity check.

The user entry point is ``python -m refusion_mlx.convert``; see docs/convert.md.
"""
