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
  at a new cache length, as in decoding (a backend that plans per shape pays for its plan every time):
  each row starts from its ``--kv`` length and its forwards see a few rows more, each phase's apart
  (``kv_range``: the shortest and longest; :func:`forward_timing.cache_lengths`; ``--fixed-kv``: the
  ``--kv`` length every run), AR's at the same lengths, and its ``build``: the host's time until
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
measuring). A ``--json`` file is rewritten (atomically) after every row
with ``complete`` false, and once more at the end with ``complete`` true:
a run killed or failed part way keeps every row it finished, in a valid
JSON, an earlier attention mode's too. On CUDA, run under ``nsys`` for
NVTX ranges of MLX's kernels; MLX exposes no per-op profiler to Python,
hence the parts timed alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Dict, List, Optional

import mlx.core as mx

from refusion_mlx._blas import blas_in_use
from refusion_mlx.bench.report import device_description, package_version
from refusion_mlx.cli import OneLineParser, positive_ints, run, write_text
from refusion_mlx.models import backend

from .forward_cost_report import PARTS, load_now, print_tables, spread, warnings
from .forward_timing import (PHASES, SLOT_SIZE, AROneToken, Filled, cache_lengths, forward_ms, parts_ms,
                             sync_cost_ms)
from .speed_common import check_json_path, median, shape_arg, write_json


def measure(model, ar_model, attention: List[str], phases: List[str], widths: List[int], kv_lens: List[int],
            repeat: int, fixed_kv: bool = False, split: bool = True, log=None,
            progress: Optional[Callable[[dict], None]] = None) -> dict:
    """Every row (:func:`forward_ms`, split by :func:`parts_ms`), AR's
    one-token forward by cache length from the forwards timed beside the
    rows, and the machine's load average at the start, the end and its
    highest between; ``progress``: called with all of that so far after
    every row (so a run cut short can keep what it measured)."""
    say = log or (lambda _m: None)
    load = {"cores": os.cpu_count(), "start": load_now()}
    peak = load["start"][0] if load["start"] else None
    sync_ms = sync_cost_ms()
    rows = []
    ar_times: Dict[int, List[float]] = {kv: [] for kv in kv_lens}
    ar_builds: Dict[int, List[float]] = {kv: [] for kv in kv_lens}

    def result(end) -> dict:
        def seen(kv: int) -> List[int]:  # AR's forwards were at the cache lengths of the rows' beside them
            paired = [r["kv_range"] for r in rows if r["kv_len"] == kv and "ar_ms" in r]
            return [min(a for a, _ in paired), max(b for _, b in paired)]

        ar_rows = [{"phase": "ar", "width": 1, "kv_len": kv, "kv_range": seen(kv), **spread(ar_times[kv]),
                    "build_ms": round(1000 * median(ar_builds[kv]), 4), "samples": len(ar_times[kv])}
                   for kv in kv_lens if ar_times[kv]]
        return {"sync_ms": round(sync_ms, 4), "rows": list(rows), "ar": ar_rows,
                "load": {**load, "end": end, "peak_1min": peak}}

    for mode in attention:
        with backend.setting(backend.ATTENTION_ENV, mode):
            for kv in kv_lens:
                room = len(phases) * (repeat + 1)  # the cache lengths past kv a row's forwards see
                filled = Filled(model, kv, room + max(SLOT_SIZE, *widths))
                ar = AROneToken(ar_model, kv, room, ar_times[kv], ar_builds[kv]) if ar_model is not None else None
                for p, phase in enumerate(phases):
                    lengths = cache_lengths(kv, p, len(phases), repeat, fixed_kv)
                    for width in widths:
                        times, builds, paired = forward_ms(model, filled, phase, width, lengths, ar)
                        row = {"attention": mode, "phase": phase, "width": width, "kv_len": kv,
                               "kv_range": [min(lengths[1:]), max(lengths[1:])], **spread(times),
                               "build_ms": round(1000 * median(builds), 4)}
                        filled.cut(kv)
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
                        if progress is not None:
                            progress(result(now))
                del filled, ar
    return result(load_now())


def record_rows(result: dict, dtype: str, q_bits: Optional[int]) -> List[dict]:
    """The rows as a benchmark record's ``forward_cost`` list."""
    out = [{**r, "dtype": dtype, "q_bits": q_bits} for r in result["rows"]]
    return out + [{**r, "attention": None, "dtype": dtype, "q_bits": q_bits} for r in result["ar"]]


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} hours" if seconds > 7200 else f"{seconds / 60:.0f} minutes" if seconds > 120 \
        else f"{seconds:.0f} s"


def slow_note(model, args) -> str:
    """One line for a run in half precision on the CPU, where MLX's kernels are much slower than in float32
    (4-bit most: qwen3-0.6b's one-token forward took 12.5 s, a 4-token one 4.5 times that): a one-token
    forward timed (two, the first untimed), the run's forwards and parts priced at it, each at one to its
    width times its cost."""
    times, _, _ = forward_ms(model, Filled(model, args.kv[0], SLOT_SIZE), "plan", 1, [args.kv[0]] * 2)
    each = len(args.attention) * len(args.kv) * len(args.phases) * (args.repeat + 1) * (1 if args.no_split else 2)
    ar = 0 if args.no_ar else len(args.attention) * len(args.kv) * len(args.phases) * len(args.widths) * args.repeat
    low, high = (each * len(args.widths) + ar) * times[0], (each * sum(args.widths) + ar) * times[0]
    weights = f"{args.dtype}{f', {args.q_bits}-bit' if args.q_bits else ''}"
    return (f"note: {weights} on the CPU is for parity, not speed: a one-token forward took {times[0]:.2f} s "
            f"here, so this run's {each * len(args.widths) + ar} forwards and parts take {_duration(low)} to "
            f"{_duration(high)} (a forward of n tokens costs up to n times as much); float32, the default, "
            "times the CPU")


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
    from refusion_mlx.bench.shapes import SHAPES, shape_config

    on_gpu = mx.default_device() == mx.gpu
    parser = OneLineParser(prog="python -m benchmarks.forward_cost",
                           description="A forward's cost by width, split by op class, against AR's one-token forward.")
    parser.add_argument("--shape", type=shape_arg, metavar="NAME",
                        default="refusion-8b" if on_gpu else "qwen3-0.6b",
                        help=f"model shape, random weights: {', '.join(SHAPES)} (default: refusion-8b on a GPU, "
                             "qwen3-0.6b on the CPU)")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                        default="bfloat16" if on_gpu else "float32",
                        help="the weights' dtype (default bfloat16 on a GPU, float32 on the CPU; on the CPU "
                             "bfloat16 is for parity, not speed: several times slower, 4-bit most; the run says "
                             "how long at its start)")
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
                        help="every forward at exactly the --kv length (default: each at a new length, as a "
                             "decode's cache grows, a few rows past it: the rows' kv_range)")
    parser.add_argument("--no-split", action="store_true", help="time whole forwards only")
    parser.add_argument("--no-ar", action="store_true", help="skip AR's one-token forward")
    parser.add_argument("--json", metavar="OUT", help="write the results to this JSON file (-: standard output, "
                        "the tables then on standard error)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be positive")
    context = shape_config(args.shape)["max_position_embeddings"]
    reach = max(args.kv) + len(args.phases) * (args.repeat + 1) + max(SLOT_SIZE, *args.widths)  # Filled's rows
    if reach > context:
        parser.error(f"--kv: {max(args.kv)} cached rows and the passes after them reach position {reach}, past "
                     f"{args.shape}'s context of {context} (max_position_embeddings)")
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
        # how the CPU paths laid the linears out (cpu_paths.lay_out_linears), which decides their cost by width
        linears = ("as loaded" if not backend.cpu_paths() else "weight-major"
                   if any(getattr(m, "weight_major", False) for m in model.modules()) else "transposed")
        blas = blas_in_use()  # as the run starts: each pass then fits the threads to its rows (Runner.hidden)
        if not on_gpu:  # its threads decide what a small matmul costs on a shared CPU (docs/benchmarks.md)
            print(f"BLAS: {blas}; linears: {linears}", file=report, flush=True)
            if args.dtype != "float32":  # MLX's CPU kernels in half precision: hours at a real shape, 4-bit
                print(slow_note(model, args), file=sys.stderr, flush=True)

        def payload(result: dict, complete: bool) -> dict:
            return {"device": device_description(), "mlx_version": package_version("mlx"), "blas": blas,
                    "shape": args.shape, "dtype": args.dtype, "q_bits": args.q_bits, "paths": backend.paths(),
                    "linears": linears,
                    "settings": {k: v for k, v in vars(args).items() if k != "json"},
                    "switches": {"overlap": backend.overlap_mode(), "qmm_pad": backend.qmm_pad_mode()},
                    "complete": complete, "sync_ms": result["sync_ms"], "load": result["load"],
                    "warnings": warnings(result), "forward_cost": record_rows(result, args.dtype, args.q_bits)}

        def so_far(result: dict) -> None:  # each row on disk as it is measured: a cut run keeps them
            write_text(args.json, json.dumps(payload(result, False), indent=1) + "\n")

        result = measure(model, ar_model, args.attention, args.phases, args.widths, args.kv, args.repeat,
                         args.fixed_kv, not args.no_split, log=lambda m: print(m, file=sys.stderr, flush=True),
                         progress=so_far if args.json and args.json != "-" else None)
        print_tables(result, report)
        done = payload(result, True)
        for line in done["warnings"]:
            print(f"warning: {line}", file=sys.stderr)
        write_json(args.json, done)
        return 0

    return run(body)


if __name__ == "__main__":
    sys.exit(main())
