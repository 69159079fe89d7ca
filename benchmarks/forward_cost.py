"""A forward's cost by width: what a ReFusion pass of 1 to 32 tokens costs
against a one-token autoregressive (AR) forward of the same weights.

    python -m benchmarks.forward_cost                                   # CPU: qwen3-0.6b, float32, ~1.5 min
    python -m benchmarks.forward_cost --shape refusion-8b --dtype bfloat16 --json cost.json   # a GPU
    python -m benchmarks.forward_cost --shape refusion-8b --dtype bfloat16 --q-bits 4 \\
        --attention unfused,bucketed --widths 1,4,8,16,32 --kv 256,1024,4096

ReFusion is faster than AR only if a forward that feeds several tokens
costs about what a one-token forward costs, and whether it does is decided
by the backend's kernels. For every attention mode (``--attention``: how
the GPU paths attend, ``backend.fused_attention``), decoder phase
(``--phases``: ``plan`` and ``verify`` extend the cache causally,
``infill`` writes scattered rows of slots under their block-diagonal mask,
exactly as ``CommittedCache.extend`` / ``.infill`` make them), cache length
(``--kv``) and width (``--widths``) it times, in one process, on a model of
a real shape with random weights (``bench.shapes``; ``--q-bits`` quantizes
it):

* **the whole forward**, as the decoder runs it (``Runner.hidden``, the LM
  head on every row, one evaluation): median (``ms``), fastest and slowest
  (``ms_min``, ``ms_max``, ``spread``: their difference over the median) of ``--repeat`` runs, each
  at a cache one row longer than the last, as in decoding (a backend that plans per shape pays for its
  plan every time; ``--fixed-kv``: the same length every run), and its ``build``: the host's time until
  the graph is built, before it is evaluated (Python's work per op; with
  ``REFUSION_MLX_OVERLAP=on`` or on the CPU paths it also starts the first
  layers), which only overlapping can hide;
* **its parts by op class**, each timed alone over every layer with the
  same shapes and weights: the q/k/v/o projections, the MLP, attention
  (with its K/V write), the LM head (medians); ``other`` is the whole
  minus the parts (norms, RoPE, embedding, the mask, dispatch and the host
  sync). Where the parts timed alone add up to more than the whole (a CPU
  runs ops of the whole forward side by side, or other work slowed the
  parts' timing; the parts are then shares, not a sum) ``other`` is None,
  ``split_exceeds_total`` true and the table shows ``<0``. Each part's own
  evaluation round trip (``sync_ms``, an empty evaluation) is taken out of it;
* with quantized weights, every quantized matmul of the layers again, in
  one call (``qmm``) and in calls of at most 7 rows (``qmm_rows7``: MLX's
  CUDA backend takes its mat-vec kernel below 8 rows, a tiled GEMM from 8),
  in the JSON;
* **AR's one-token forward** at the same cache length: mlx-lm's model on
  the same arrays with its own KV cache, timed right after each of the
  row's forwards (``ar_ms``), so ``x_ar`` is the median of like-for-like
  ratios, each pair taken within a second of each other whatever the other
  jobs on the machine do; its rows (``phase: "ar"``) hold every such forward
  at that cache length (``--no-ar``: skip it).

On a shared machine a timing is the device's cost plus what the other jobs
took: the run records the load average (``load``: 1, 5 and 15 minutes at
the start and the end, the highest 1-minute one between, and the cores)
and warns in one line each (``warnings``) when it exceeded the cores or
when repeats of a row differ by more than half their median
(``benchmarks.forward_cost_report``).

A table per run and ``--json`` (``forward_cost``: one row per forward
timed, AR's as ``phase: "ar"``, width 1; ``--json -``: the JSON on standard
output, the tables on standard error; the path is checked before
measuring). On CUDA, run under ``nsys`` for NVTX ranges of MLX's kernels; MLX exposes no per-op profiler to Python,
hence the parts timed alone.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from refusion_mlx._blas import blas_in_use
from refusion_mlx.bench.report import device_description, package_version
from refusion_mlx.cli import OneLineParser, positive_ints, run
from refusion_mlx.decode.cache import CommittedCache
from refusion_mlx.decode.packed import padded
from refusion_mlx.decode.runner import Runner
from refusion_mlx.errors import RefusionError
from refusion_mlx.models import backend

from .forward_cost_report import PARTS, load_now, print_tables, spread, warnings
from .speed_common import check_json_path, median, write_json

PHASES = ("plan", "verify", "infill")
SLOT_SIZE = 4


def infill_layout(width: int, slot_size: int = SLOT_SIZE) -> tuple:
    """(slots, cursor) of an infill pass ``width`` tokens wide: whole slots
    from their first token when the width allows, else one slot's last
    ``width`` tokens."""
    if width % slot_size == 0:
        return width // slot_size, 0
    if width < slot_size:
        return 1, slot_size - width
    raise RefusionError(f"an infill pass of {width} tokens is neither whole slots of {slot_size} nor part of one")


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of ``fn()`` evaluated, after one untimed call."""
    mx.eval(fn())
    times = []
    for _ in range(repeat):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return median(times)


class AROneToken:
    """mlx-lm's one-token forward after ``kv_len`` cached rows (random keys
    and values), the cache one row longer each call: the AR side of every
    row at this cache length, timed right after each of its forwards
    (:func:`forward_ms`), so that both sides of ``x_ar`` meet the machine in
    the same state. One untimed call first."""

    def __init__(self, ar_model, kv_len: int):
        from mlx_lm.models.cache import make_prompt_cache

        self.model, self.cache = ar_model, make_prompt_cache(ar_model)
        args = ar_model.args
        K, D = args.num_key_value_heads, args.head_dim
        dtype = ar_model.model.norm.weight.dtype
        for c in self.cache:
            kv = mx.random.normal((1, K, kv_len, D)).astype(dtype)
            c.update_and_fetch(kv, kv)
        mx.eval([c.state for c in self.cache])
        self.token = mx.array([[1]], dtype=mx.int32)
        self.times: List[float] = []
        self.builds: List[float] = []
        self.once(keep=False)

    def once(self, keep: bool = True) -> float:
        """Seconds of one forward (its graph built, then evaluated)."""
        mx.synchronize()
        t0 = time.perf_counter()
        best = mx.argmax(self.model(self.token, cache=self.cache)[:, -1, :], axis=-1)
        built = time.perf_counter()
        mx.eval(best)
        took = time.perf_counter() - t0
        if keep:
            self.times.append(took)
            self.builds.append(built - t0)
        return took


class Filled:
    """One sequence's cache holding ``rows`` committed rows of random keys and
    values, with room for ``extra`` more (the passes timed write after them)."""

    def __init__(self, model, rows: int, extra: int, seed: int = 0):
        self.cache = CommittedCache.for_model(model)
        self.cache.reserve(rows + extra)
        key = mx.random.key(seed)
        for store in self.cache.stores:
            if store is not None:
                shape = store.keys.shape
                store.keys = mx.random.normal(shape, key=key).astype(store.keys.dtype)
                store.values = mx.random.normal(shape, key=key).astype(store.values.dtype)
                mx.eval(store.keys, store.values)
        self.cache.commit([0] * rows, list(range(rows)))

    def grow_one(self) -> None:
        """One more committed row (a decode moves on)."""
        n = len(self.cache)
        self.cache.commit([0], [n])

    def write(self, phase: str, width: int):
        if phase == "infill":
            slots, cursor = infill_layout(width)
            return self.cache.infill(slots, SLOT_SIZE, cursor)
        return self.cache.extend(width)


def forward_ms(model, filled: Filled, phase: str, width: int, repeat: int, fixed_kv: bool,
               ar: Optional[AROneToken] = None) -> Tuple[List[float], List[float], List[float]]:
    """Seconds of ``repeat`` whole forwards of ``width`` tokens (LM head on
    every row, after one untimed), of the host's part of each before its
    evaluation: building the graph in Python (with
    ``REFUSION_MLX_OVERLAP=on``, also starting its first layers), and of
    ``ar``'s one-token forward timed right after each (none without ``ar``)."""
    runner = Runner.of(model)
    rng = np.random.default_rng(0)
    times, builds, ar_times = [], [], []
    for r in range(repeat + 1):
        write = filled.write(phase, width)
        start = len(filled.cache)
        tokens = mx.array(rng.integers(0, model.args.vocab_size, width), dtype=mx.int32)
        positions = mx.arange(start, start + width, dtype=mx.int32)
        mx.eval(tokens, positions, *([write.mask] if isinstance(write.mask, mx.array) else []),
                *([write.rows] if write.rows is not None else []))
        mx.synchronize()
        t0 = time.perf_counter()
        logits = model.head(runner.hidden(tokens, positions, write)).astype(mx.float32)
        built = time.perf_counter()
        mx.eval(logits)
        if r:
            times.append(time.perf_counter() - t0)
            builds.append(built - t0)
            if ar is not None:
                ar_times.append(ar.once())
        if not fixed_kv:
            filled.grow_one()
    return times, builds, ar_times


def parts_ms(model, filled: Filled, phase: str, width: int, repeat: int, sync_ms: float) -> Dict[str, float]:
    """Each op class of the forward timed alone over every layer (ms)."""
    args = model.args
    dtype = model.layers[0].input_layernorm.weight.dtype
    H, K, D = model.heads, model.kv_heads, args.head_dim
    x = mx.random.normal((width, args.hidden_size)).astype(dtype)
    y = mx.random.normal((width, H * D)).astype(dtype)
    q = mx.random.normal((1, H, width, D)).astype(dtype)
    kv = mx.random.normal((1, K, width, D)).astype(dtype)
    mx.eval(x, y, q, kv)
    layers = model.layers
    write = padded(filled.write(phase, width), width)  # a padded batch of one where shapes are bucketed
    mask = None if write.mask is None else model.attention_mask(write.mask, width, write.visible, dtype)

    def proj():
        return [[*a.qkv(a, x), a.o_proj(y)] for a in (layer.self_attn for layer in layers)]

    def attn():
        return [write.layer(i).attend(q, kv, kv, mask) for i in range(len(layers))]

    fns = {"proj": proj, "mlp": lambda: [layer.mlp(x) for layer in layers],
           "attn": attn, "head": lambda: model.head(x).astype(mx.float32)}
    quantized = [m for layer in layers for _, m in layer.named_modules() if isinstance(m, nn.QuantizedLinear)]
    if quantized:  # every quantized matmul of the layers: in one call, and in calls of at most 7 rows
        inputs = {}
        for m in quantized:
            k = m.scales.shape[-1] * m.group_size
            inputs.setdefault(k, mx.random.normal((width, k)).astype(dtype))
        mx.eval(list(inputs.values()))

        def matmuls(rows: int):
            def run():
                out = []
                for m in quantized:
                    xm = inputs[m.scales.shape[-1] * m.group_size]
                    out += [mx.quantized_matmul(xm[i:i + rows], m.weight, m.scales, m.get("biases"), transpose=True,
                                                group_size=m.group_size, bits=m.bits) for i in range(0, width, rows)]
                return out
            return run

        fns["qmm"] = matmuls(width)
        fns["qmm_rows7"] = matmuls(7)
    return {name: max(0.0, 1000 * timed(fn, repeat) - sync_ms) for name, fn in fns.items()}


def sync_cost_ms(repeat: int = 20) -> float:
    a = mx.zeros((1,))
    return 1000 * timed(lambda: a + 1, repeat)


def measure(model, ar_model, attention: List[str], phases: List[str], widths: List[int], kv_lens: List[int],
            repeat: int, fixed_kv: bool = False, split: bool = True, log=None) -> dict:
    """Every row (:func:`forward_ms`, split by :func:`parts_ms`), AR's
    one-token forward by cache length from the forwards timed beside the
    rows, and the machine's load average at the start, the end and its
    highest between."""
    say = log or (lambda _m: None)
    load = {"cores": os.cpu_count(), "start": load_now()}
    peak = load["start"][0] if load["start"] else None
    sync_ms = sync_cost_ms()
    rows = []
    ar_times: Dict[int, List[float]] = {kv: [] for kv in kv_lens}
    ar_builds: Dict[int, List[float]] = {kv: [] for kv in kv_lens}
    for mode in attention:
        with backend.setting(backend.ATTENTION_ENV, mode):
            for kv in kv_lens:
                filled = Filled(model, kv, (repeat + 2) * (2 + max(widths)) + 4 * SLOT_SIZE * max(widths))
                ar = AROneToken(ar_model, kv) if ar_model is not None else None
                for phase in phases:
                    for width in widths:
                        times, builds, paired = forward_ms(model, filled, phase, width, repeat, fixed_kv, ar)
                        row = {"attention": mode, "phase": phase, "width": width, "kv_len": kv, **spread(times),
                               "build_ms": round(1000 * median(builds), 4)}
                        if split:
                            parts = parts_ms(model, filled, phase, width, repeat, sync_ms)
                            row.update({k: round(v, 4) for k, v in parts.items()})
                            rest = row["ms"] - sum(parts[p] for p in PARTS)
                            row["other"] = round(rest, 4) if rest >= 0 else None
                            row["split_exceeds_total"] = rest < 0  # the parts alone took longer than the whole
                        if paired:
                            row["ar_ms"] = round(1000 * median(paired), 4)
                            row["x_ar"] = round(median([t / a for t, a in zip(times, paired)]), 3)
                        rows.append(row)
                        now = load_now()
                        peak = max(peak, now[0]) if now and peak is not None else peak
                        say(f"{mode} {phase} width {width} at {kv}: {row['ms']:.3f} ms (min {row['ms_min']:.3f})"
                            + (f", AR {row['ar_ms']:.3f} ms: {row['x_ar']:.2f}x" if paired else ""))
                if ar is not None:
                    ar_times[kv] += ar.times
                    ar_builds[kv] += ar.builds
                del filled, ar
    ar_rows = [{"phase": "ar", "width": 1, "kv_len": kv, **spread(ar_times[kv]),
                "build_ms": round(1000 * median(ar_builds[kv]), 4), "samples": len(ar_times[kv])}
               for kv in kv_lens if ar_times[kv]]
    load.update(end=load_now(), peak_1min=peak)
    return {"sync_ms": round(sync_ms, 4), "rows": rows, "ar": ar_rows, "load": load}


def record_rows(result: dict, dtype: str, q_bits: Optional[int]) -> List[dict]:
    """The rows as a benchmark record's ``forward_cost`` list."""
    out = [{**r, "dtype": dtype, "q_bits": q_bits} for r in result["rows"]]
    return out + [{**r, "attention": None, "dtype": dtype, "q_bits": q_bits} for r in result["ar"]]


def names(allowed) -> Callable[[str], List[str]]:
    """argparse type: comma-separated names of ``allowed``; the error names the choices."""
    def parse(text: str) -> List[str]:
        values = [v.strip() for v in text.split(",")]
        wrong = [v for v in values if v not in allowed]
        if "" in wrong:
            raise argparse.ArgumentTypeError(f"an empty item in {text!r}: expected names of {', '.join(allowed)}")
        if wrong:
            raise argparse.ArgumentTypeError(f"{wrong[0]!r} is not one of {', '.join(allowed)} "
                                             f"(comma-separated, e.g. {','.join(allowed[:2])})")
        return values
    return parse


def main(argv: Optional[List[str]] = None) -> int:
    from refusion_mlx.bench.shapes import HIDDEN_SHAPES, SHAPES

    on_gpu = mx.default_device() == mx.gpu
    parser = OneLineParser(prog="python -m benchmarks.forward_cost",
                           description="A forward's cost by width, split by op class, against AR's one-token forward.")
    parser.add_argument("--shape", choices=list(SHAPES) + list(HIDDEN_SHAPES), metavar="NAME",
                        default="refusion-8b" if on_gpu else "qwen3-0.6b",
                        help=f"model shape, random weights: {', '.join(SHAPES)} (default: refusion-8b on a GPU, "
                             "qwen3-0.6b on the CPU)")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                        default="bfloat16" if on_gpu else "float32",
                        help="the weights' dtype (default bfloat16 on a GPU, float32 on the CPU; on the CPU "
                             "bfloat16 is for parity, not speed: several times slower, 4-bit most)")
    parser.add_argument("--q-bits", type=int, choices=[4, 8], help="quantize the weights (group size 64)")
    parser.add_argument("--widths", type=positive_ints, default=[1, 2, 4, 8, 16, 32] if on_gpu else [1, 4, 16],
                        help="tokens per forward (default 1,2,4,8,16,32 on a GPU, 1,4,16 on the CPU)")
    parser.add_argument("--kv", type=positive_ints, default=[256, 1024, 4096] if on_gpu else [256, 1024],
                        help="cached rows before the pass (default 256,1024,4096 on a GPU, 256,1024 on the CPU)")
    parser.add_argument("--phases", type=names(PHASES), default=list(PHASES),
                        help=f"of {', '.join(PHASES)} (default all)")
    parser.add_argument("--attention", type=names(backend.ATTENTION_MODES), default=["auto"],
                        help="how the GPU paths attend, one run each: auto (as measured per backend), fused, "
                             "unfused, bucketed (fused at a few padded shapes) (default auto)")
    parser.add_argument("--repeat", type=int, default=5 if on_gpu else 3,
                        help="timed forwards per row (median, fastest, spread; default 5 on a GPU, 3 on the CPU)")
    parser.add_argument("--fixed-kv", action="store_true",
                        help="every timed forward at the same cache length (default: one row longer each time)")
    parser.add_argument("--no-split", action="store_true", help="time whole forwards only")
    parser.add_argument("--no-ar", action="store_true", help="skip AR's one-token forward")
    parser.add_argument("--json", metavar="OUT", help="write the results to this JSON file (-: standard output, "
                        "the tables then on standard error)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be positive")
    if "infill" in args.phases:
        for w in args.widths:
            if w % SLOT_SIZE and w > SLOT_SIZE:
                parser.error(f"--widths: an infill pass of {w} tokens is not whole slots of {SLOT_SIZE}")

    def body() -> int:
        from refusion_mlx.bench.shapes import build_models

        check_json_path(args.json, stdout=True)  # before the measurement, not after it
        report = sys.stderr if args.json == "-" else sys.stdout  # --json -: the JSON is standard output
        if backend.paths() == "cpu" and args.attention != ["auto"]:
            print("note: --attention chooses how the GPU paths attend; on the CPU paths every mode runs the same "
                  "code (REFUSION_MLX_PATHS=gpu runs the GPU paths on any machine)", file=sys.stderr)
        print(f"building {args.shape} ({args.dtype}{f', {args.q_bits}-bit' if args.q_bits else ''}) "
              f"with random weights on {device_description()}, {backend.paths()} paths", file=report, flush=True)
        model, ar_model = build_models(args.shape, args.dtype, args.q_bits, ar=not args.no_ar)
        if not on_gpu:  # its threads decide what a small matmul costs on a shared CPU (docs/benchmarks.md)
            print(f"BLAS: {blas_in_use()}", file=report, flush=True)
        result = measure(model, ar_model, args.attention, args.phases, args.widths, args.kv, args.repeat,
                         args.fixed_kv, not args.no_split, log=lambda m: print(m, file=sys.stderr, flush=True))
        print_tables(result, report)
        notes = warnings(result)
        for line in notes:
            print(f"warning: {line}", file=sys.stderr)
        write_json(args.json, {
            "device": device_description(), "mlx_version": package_version("mlx"), "blas": blas_in_use(),
            "shape": args.shape, "dtype": args.dtype, "q_bits": args.q_bits, "paths": backend.paths(),
            "settings": {k: v for k, v in vars(args).items() if k != "json"},
            "switches": {"overlap": backend.overlap_mode(), "qmm_pad": backend.qmm_pad_mode()},
            "sync_ms": result["sync_ms"], "load": result["load"], "warnings": notes,
            "forward_cost": record_rows(result, args.dtype, args.q_bits)})
        return 0

    return run(body)


if __name__ == "__main__":
    sys.exit(main())
