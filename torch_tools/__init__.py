"""Conversion tooling that needs PyTorch: random checkpoints, parity and memory checks.

The user entry point is ``python -m refusion_mlx.convert``; see README.md here.
"""
