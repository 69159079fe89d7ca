"""PyTorch checkpoint -> MLX folder (``python -m refusion_mlx.convert``).

Steps, one file each: read and check the checkpoint (``checkpoint``), plan
the quantization (``quant_plan``), write size-bounded shards (``shards``)
into a folder that appears atomically (``staging``); ``converter`` runs them.
``refusion_mlx.convert.convert(hf_path, mlx_path, ...)`` is the function.
"""

from .._callable import make_callable
from .converter import Summary, convert, format_summary, resolve_source

__all__ = ["Summary", "convert", "format_summary", "main", "resolve_source"]


def main(argv=None) -> int:
    """``python -m refusion_mlx.convert`` from Python (the command is ``__main__``'s)."""
    from .__main__ import main as command

    return command(argv)


make_callable(__name__, convert)
