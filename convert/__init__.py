"""Conversion tooling that needs PyTorch or the repository's test fixtures,
run from the repository root as ``python -m convert.NAME``:

* ``make_checkpoint``: random checkpoints of real Qwen3 shapes (torch);
* ``parity``: logits of a converted folder against transformers (torch);
* ``convert_memory``: the converter's peak memory against checkpoint size
  (generates its checkpoint with ``make_checkpoint`` unless given ``--hf-path``);
* ``convert_quality``: each conversion of the demo model against the golden
  fixtures of ``tests/fixtures``.

Never imported by ``refusion_mlx`` and not installed with it. The user entry
point is ``python -m refusion_mlx.convert``; see docs/convert.md.
"""
