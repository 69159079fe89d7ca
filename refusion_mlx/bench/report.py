"""What a benchmark prints besides its numbers: the environment it ran in
(BLAS, dtype, device, versions, model shape) and plain-text tables.

Timings mean little without the environment: on Linux the BLAS library alone
changes matmul speed ~50x, so every benchmark states which one it used.
"""

from __future__ import annotations

import os
import platform
from importlib import metadata
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from .._blas import blas_in_use, reference_warning, threads
from .._version import __version__


def blas_threads() -> Optional[int]:
    """The BLAS library's thread count (OpenBLAS or MKL), None for the reference one.

    It matters on small models: idle BLAS workers spin between small matmuls
    and compete with MLX and Python for the cores."""
    return threads()


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo, else platform's guess)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_description() -> str:
    device = mx.default_device()
    kind = "gpu" if device == mx.gpu else "cpu"
    if kind == "cpu":
        return f"cpu ({cpu_name()}, {os.cpu_count()} cores)"
    try:
        name = mx.device_info().get("device_name", "")
    except Exception:  # not every backend describes itself
        name = ""
    return f"gpu ({name})" if name else "gpu"


def logical_parameters(model) -> int:
    """The model's parameters as the checkpoint counts them: a quantized
    weight's packed uint32 elements unpacked (x 32 / bits), its scales and
    biases left out (the converter's count)."""
    bits = {name: m.bits for name, m in model.named_modules() if hasattr(m, "bits") and hasattr(m, "scales")}
    total = 0
    for key, v in tree_flatten(model.parameters()):
        owner, _, leaf = key.rpartition(".")
        if owner in bits:
            total += v.size * 32 // bits[owner] if leaf == "weight" else 0
        else:
            total += v.size
    return total


def format_parameters(n: int) -> str:
    """A parameter count as every report prints it (3.57M, 8.19B)."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def model_shape(model) -> Dict[str, Any]:
    """The architecture numbers that decide speed, plus the parameter count."""
    a = model.args
    params = logical_parameters(model)
    return {
        "model_type": a.model_type,
        "hidden_size": a.hidden_size,
        "num_hidden_layers": a.num_hidden_layers,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads,
        "head_dim": a.head_dim,
        "intermediate_size": a.intermediate_size,
        "vocab_size": a.vocab_size,
        "tie_word_embeddings": a.tie_word_embeddings,
        "parameters": int(params),
        "dtype": str(model.model.norm.weight.dtype).replace("mlx.core.", ""),
        "quantized": any(k.endswith(".scales") for k, _ in tree_flatten(model.parameters())),
    }


def environment(model, model_label: str) -> Dict[str, Any]:
    """Everything a reader needs to reproduce or discount the timings."""
    return {
        "blas": blas_in_use(),
        "blas_threads": blas_threads(),
        "dtype": model_shape(model)["dtype"],
        "device": device_description(),
        "mlx": package_version("mlx"),
        "mlx_lm": package_version("mlx-lm"),
        "refusion_mlx": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "model": model_label,
        "model_shape": model_shape(model),
    }


def header_lines(env: Dict[str, Any]) -> List[str]:
    s = env["model_shape"]
    lines = [
        f"model: {env['model']} ({s['model_type']}: hidden {s['hidden_size']}, "
        f"{s['num_hidden_layers']} layers, {s['num_attention_heads']} heads / "
        f"{s['num_key_value_heads']} KV heads, head_dim {s['head_dim']}, intermediate "
        f"{s['intermediate_size']}, vocab {s['vocab_size']}; {format_parameters(s['parameters'])} parameters"
        f"{', quantized' if s['quantized'] else ''})",
        f"BLAS: {env['blas']} | dtype: {env['dtype']} | "
        f"device: {env['device']}",
        f"versions: mlx {env['mlx']}, mlx-lm {env['mlx_lm']}, refusion-mlx {env['refusion_mlx']}, "
        f"Python {env['python']}",
    ]
    if "reference BLAS" in env["blas"]:
        fix = reference_warning() or "slow reference BLAS in use"
        lines.append(f"WARNING: {fix}; timings do not represent this machine")
    return lines


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
                 left: Optional[Sequence[int]] = None) -> str:
    """A plain aligned table; columns in ``left`` are left-aligned, others right."""
    left = set(left or [0])
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells if i < len(r)]) for i, h in enumerate(headers)]

    def line(values):
        out = []
        for i, v in enumerate(values):
            out.append(v.ljust(widths[i]) if i in left else v.rjust(widths[i]))
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule] + [line(r) if r else rule for r in cells])


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"
    return str(value)
