"""ReFusion on MLX: slot-level plan-and-infill decoding with full KV-cache reuse."""

from . import _hf_index, _startup  # first: _blas and what follows take a while to import

if _startup.starting():  # python -m refusion_mlx.<command> or refusion-<command>, while it imports: Ctrl-C is a
    _startup.quiet_interrupts()  # quiet exit 130
    _startup.leave_out_torch()  # the tokenizer's transformers would import PyTorch (~1.5 s) for nothing
    _hf_index.install()  # and would read its 2,600 model files for a table it had last time (0.4 s)

from . import _blas, _malloc  # noqa: E402

_blas.preload()  # must run before mlx.core is imported
_malloc.keep_buffers()  # Linux: MLX's CPU arrays are malloc'd; a large one was mapped afresh at every op

from ._version import __version__  # noqa: E402

_EXPORTS = {
    "load": "models.loading",
    "convert": "convert.converter",
    "generate": "decode.stream",
    "stream_generate": "decode.stream",
    "batch_generate": "decode.batch",
    "stream_batch": "decode.batch",
    "BatchGenerator": "decode.batch",
    "chat_prompt": "decode.stream",
    "GenerationResponse": "decode.stream",
    "RefusionParams": "decode.params",
    "make_params": "decode.params",
    "RefusionDecoder": "decode.decoder",
    "DecodeStats": "decode.stats",
    "CommittedCache": "decode.cache",
    "RefusionError": "errors",
    "PRESETS": "decode.presets",
    "Constraint": "decode.grammar",
}

__all__ = ["__version__", *_EXPORTS]


def __dir__():
    return sorted({*globals(), *_EXPORTS})


def __getattr__(name):
    """Import on first use, so ``python -m refusion_mlx.generate`` runs one copy."""
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'refusion_mlx' has no attribute {name!r}")
