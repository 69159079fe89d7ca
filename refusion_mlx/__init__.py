"""ReFusion on MLX: slot-level plan-and-infill decoding with full KV-cache reuse."""

from . import _blas

_blas.preload()  # must run before mlx.core is imported

__version__ = "0.1.0"

_EXPORTS = {
    "load": "utils",
    "generate": "generate",
    "stream_generate": "generate",
    "chat_prompt": "generate",
    "GenerationResponse": "generate",
    "RefusionParams": "decoder",
    "RefusionDecoder": "decoder",
    "DecodeStats": "decoder",
    "CommittedCache": "cache",
    "RefusionError": "errors",
    "PRESETS": "presets",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name):
    """Import on first use, so ``python -m refusion_mlx.generate`` runs one copy."""
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'refusion_mlx' has no attribute {name!r}")
