"""Kernels per layer of a forward on the GPU paths, counted in its graph,
against mlx-lm's one-token forward.

    python -m benchmarks.kernel_count                      # qwen3-0.6b shape, bfloat16, widths 1 and 16
    python -m benchmarks.kernel_count --shape refusion-8b --widths 1,4,16 --q-bits 4 --json kernels.json

On MLX's CUDA backend a forward of a real model is bound by the host work
per op (docs/benchmarks.md, "A wide forward on the H200"), so the number of
ops a forward launches is a cost of its own, and it can be counted on any
machine: the lazy graph of one forward (``mx.export_to_dot``) holds every
op it will run. Each ``mx.fast`` call (RMSNorm, RoPE, attention) is counted
as the one kernel it is on a GPU -- on the CPU MLX splits it into its
reference ops -- by standing in a single op for it while the graph is built
(nothing is evaluated). Ops that only make views (reshape, transpose,
slice, broadcast, split...) launch no kernel and are counted apart.

``build ms``: the host's time to build that graph (median of 21 builds from
the same cache, the fused ops standing in as one node each as on a GPU):
Python's part of a forward, which runs before the device starts unless
``REFUSION_MLX_OVERLAP`` hides it, comparable between the runtime and mlx-lm
on any machine (``forward_cost``'s ``build`` column is not, on a CPU).
"""

from __future__ import annotations

import collections
import contextlib
import io
import re
import sys
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import mlx.core as mx

from refusion_mlx.bench.report import format_table
from refusion_mlx.cli import OneLineParser, positive_ints, run
from refusion_mlx.decode.runner import Runner
from refusion_mlx.models import backend

from .forward_timing import PHASES, SLOT_SIZE, Filled
from .speed_common import check_json_path, shape_flags, write_json

BUILDS = 21  # graphs built per forward timed (the median is reported)

# primitives that make a view of their input (no kernel on a GPU)
VIEWS = frozenset({"Reshape", "Transpose", "Slice", "Broadcast", "ExpandDims", "Squeeze", "Split", "AsStrided",
                   "Unflatten", "Flatten", "StopGradient", "Depends"})


@contextlib.contextmanager
def fast_ops_as_one() -> Iterator[None]:
    """While the block builds a graph: each ``mx.fast`` op one node that
    depends on all of its inputs, as its one GPU kernel does."""
    saved = {name: getattr(mx.fast, name) for name in ("rms_norm", "rope", "scaled_dot_product_attention")}

    def one(x, *inputs):  # ArcTanh: a primitive no model here uses, reported as FAST
        return mx.depends([mx.arctanh(x)], [a for a in inputs if isinstance(a, mx.array)])[0]

    mx.fast.rms_norm = lambda x, weight, eps, **_: one(x, weight)
    mx.fast.rope = lambda x, *args, offset=None, freqs=None, **_: one(x, offset, freqs)
    mx.fast.scaled_dot_product_attention = lambda q, k, v, *, scale, mask=None, **_: one(q, k, v, mask)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(mx.fast, name, fn)


FAST = "mx.fast"  # how the stand-ins are reported


def ops_of(*outputs: mx.array) -> collections.Counter:
    """Every op in the graph of ``outputs``, by primitive."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    names = re.findall(r'label ="([^"]*)", shape=rectangle', dot.getvalue())
    return collections.Counter(FAST if name == "ArcTanh" else name.split(" ")[0] for name in names)


def kernels(ops: collections.Counter) -> int:
    return sum(n for name, n in ops.items() if name not in VIEWS)


def built(build: Callable[[], mx.array], reset: Callable[[], None], repeat: int) -> Tuple[mx.array, float]:
    """One graph ``build`` makes (fused ops as one node each) and the median
    ms the host took to build it, over ``repeat`` builds from the same state
    (``reset`` restores it; the last graph is freed outside the timed part;
    ``repeat`` 0: the first build alone)."""
    times, out = [], None
    for _ in range(repeat + 1):
        out = None  # the last graph goes before the clock starts
        reset()
        with fast_ops_as_one():
            start = time.perf_counter()
            out = build()
            times.append(time.perf_counter() - start)
    return out, 1000 * sorted(times[1:] or times)[repeat // 2]


def _stores(stores) -> Callable[[], None]:
    """A reset that puts the stores' (evaluated) arrays back as they are now.
    A write into a store updates its array objects in place (``a[i:j] = b``),
    so each reset gives them fresh objects holding the saved values."""
    saved = [(store, dict(vars(store))) for store in stores]

    def reset():
        for store, state in saved:
            fresh = {k: mx.array(v) for k, v in state.items() if isinstance(v, mx.array)}
            mx.eval(list(fresh.values()))
            vars(store).update({**state, **fresh})
    return reset


def forward_ops(model, filled: Filled, phase: str, width: int, repeat: int = BUILDS
                ) -> Tuple[collections.Counter, float]:
    """The ops of one decoding forward of ``width`` tokens (LM head on every
    row), and the ms its graph took to build."""
    write = filled.write(phase, width)
    start = len(filled.cache)
    tokens, positions = mx.zeros((width,), mx.int32), mx.arange(start, start + width, dtype=mx.int32)
    out, ms = built(lambda: model.head(Runner.of(model).hidden(tokens, positions, write)),
                    _stores([s for s in filled.cache.stores if s is not None]), repeat)
    ops = ops_of(out)
    filled.cache.free()  # the graph was never evaluated: the next forward starts from fresh stores
    return ops, ms


def ar_ops(ar_model, kv_len: int, repeat: int = BUILDS) -> Tuple[collections.Counter, float]:
    """The ops of mlx-lm's one-token forward after ``kv_len`` cached rows (no
    growth step), and the ms its graph took to build."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(ar_model)
    args = ar_model.args
    kv = mx.zeros((1, args.num_key_value_heads, kv_len, args.head_dim), ar_model.model.norm.weight.dtype)
    for c in cache:
        c.update_and_fetch(kv, kv)
    mx.eval([c.state for c in cache])
    token = mx.array([[1]], dtype=mx.int32)
    out, ms = built(lambda: ar_model(token, cache=cache), _stores(cache), repeat)
    return ops_of(out), ms


def count(model, ar_model, phases: List[str], widths: List[int], kv_len: int, repeat: int = BUILDS) -> List[dict]:
    """One row per forward counted: kernels and views per layer, the kernels
    by primitive, and the ms its graph took to build (median of ``repeat``)."""
    layers = len(model.layers)
    rows = []
    with backend.setting(backend.ENV, "gpu"):  # the GPU paths' graph, whatever device this is
        # one forward evaluated first: what a model makes once (joined norm weights) is then made
        warm = Filled(model, kv_len, 8)
        mx.eval(model.head(Runner.of(model).hidden(mx.zeros((2,), mx.int32), mx.arange(kv_len, kv_len + 2,
                                                                                       dtype=mx.int32),
                                                   warm.write("plan", 2))))
        for phase in phases:
            for width in widths:
                filled = Filled(model, kv_len, 4 * SLOT_SIZE * max(widths) + 8)
                rows.append(_row(phase, width, *forward_ops(model, filled, phase, width, repeat), layers))
        if ar_model is not None:
            rows.append(_row("ar", 1, *ar_ops(ar_model, kv_len + 1, repeat), layers))
    return rows


def _row(phase: str, width: int, ops: collections.Counter, build_ms: float, layers: int) -> dict:
    kernel_ops: Dict[str, int] = {k: v for k, v in ops.most_common() if k not in VIEWS}
    return {"phase": phase, "width": width, "kernels": kernels(ops), "ops": sum(ops.values()),
            "kernels_per_layer": round(kernels(ops) / layers, 2), "build_ms": round(build_ms, 3),
            "by_primitive": kernel_ops}


def main(argv: Optional[List[str]] = None) -> int:
    parser = OneLineParser(prog="python -m benchmarks.kernel_count",
                           description="Kernels per layer of a GPU-paths forward, against mlx-lm's one-token one.")
    shape_flags(parser, dtype="bfloat16")
    parser.add_argument("--q-bits", type=int, choices=[4, 8], help="quantize the weights (group size 64)")
    parser.add_argument("--widths", type=positive_ints, default=[1, 16], help="tokens per forward (default 1,16)")
    parser.add_argument("--kv", type=int, default=256, help="cached rows before the pass (default 256)")
    parser.add_argument("--json", metavar="OUT", help="write the rows to this JSON file")
    args = parser.parse_args(argv)
    if args.kv < 1:
        parser.error("--kv must be positive")
    for w in args.widths:
        if w % SLOT_SIZE and w > SLOT_SIZE:
            parser.error(f"--widths: an infill pass of {w} tokens is not whole slots of {SLOT_SIZE}")

    def body() -> int:
        from refusion_mlx.bench.shapes import build_models

        check_json_path(args.json)
        model, ar_model = build_models(args.shape, args.dtype, args.q_bits)
        rows = count(model, ar_model, list(PHASES), args.widths, args.kv)
        print(f"{args.shape} ({args.dtype}{f', {args.q_bits}-bit' if args.q_bits else ''}), GPU paths, attention "
              f"{backend.attention_mode()} (REFUSION_MLX_ATTENTION), {args.kv} cached rows; {FAST}: each fused "
              "op counted as its one kernel")
        print(format_table(["phase", "width", "kernels / layer", "kernels", "all ops", "build ms", "most launched"],
                           [[r["phase"], r["width"], f"{r['kernels_per_layer']:.1f}", r["kernels"], r["ops"],
                             f"{r['build_ms']:.2f}",
                             ", ".join(f"{k} {v}" for k, v in list(r["by_primitive"].items())[:4])]
                            for r in rows], left=[0, 6]))
        write_json(args.json, {"shape": args.shape, "dtype": args.dtype, "q_bits": args.q_bits, "kv_len": args.kv,
                               "attention": backend.attention_mode(), "rows": rows})
        return 0

    return run(body)


if __name__ == "__main__":
    sys.exit(main())
