"""``python -m refusion_mlx.bench``: ReFusion against mlx-lm's autoregressive
decoding of the same weights (``compare``), or one of the other measurements
(``modes``: --concurrency, --http, --conversation, --layouts, --shape)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from ..cli import (OneLineParser, add_decoding_args, add_kv_args, add_model_args, check_writable, fill_defaults,
                   interrupt_once, output_file, positive_int, positive_ints, refuse_unread, run, storage_from_args)
from ..cli.launch import add_distributed_args, join
from ..decode.params import PARAM_NAMES
from ..distributed import watchdog
from ..errors import DecodeError
from ..models.backend import wired_limit
from . import modes
from .compare import format_report, resolve_all, run_benchmark, write_json
from .layouts import add_layout_args
from .shapes import HIDDEN_SHAPES, SHAPES, shape_names
from .suite import DEFAULT_SUITE, BenchError, load_suite


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number above 0, got {text!r}")
    return value


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="python -m refusion_mlx.bench",
        description="Benchmark ReFusion decoding against mlx-lm's autoregressive decoding of the same weights.")
    add_model_args(parser, dtype_default="float32", dtype_help="compute dtype of both sides (default float32)")
    add_distributed_args(parser)
    parser.add_argument("--suite", default="default",
                        help="'default' (the bundled suite) or a suite JSON file")
    add_decoding_args(parser)
    add_kv_args(parser)  # ReFusion's caches, and mlx-lm's (from the first token) on the AR side
    parser.add_argument("--repeat", type=positive_int, help="timed runs per prompt and side (median shown; default 1)")
    parser.add_argument("--warmup", type=int, help="untimed runs per side first (default 1)")
    parser.add_argument("--json", metavar="OUT", type=output_file,
                        help="also write the full report to this JSON file (-: to standard output, and the "
                             "table to standard error)")
    parser.add_argument("--no-ar", action="store_true", help="skip the AR side (ReFusion only)")
    parser.add_argument("--no-chat-template", action="store_true", help="tokenize the prompts as they are")
    parser.add_argument("--verbose", action="store_true", help="one line per run on standard error")
    parser.add_argument("--concurrency", type=positive_ints, metavar="N,N,...",
                        help="instead of the AR comparison: aggregate tokens/s and latency per request for "
                             "N concurrent clients decoded together (e.g. 1,2,4,8,16)")
    parser.add_argument("--rounds", type=positive_int,
                        help="with --concurrency: how many times the workload goes through the suite (default 2)")
    parser.add_argument("--http", action="store_true",
                        help="with --concurrency: through the OpenAI-compatible server on loopback, "
                             "streaming, instead of in-process")
    parser.add_argument("--conversation", type=positive_int, metavar="TURNS",
                        help="instead of the AR comparison: a conversation of TURNS questions from the suite "
                             "sent to the server the way chat apps send it (whole history each turn); the "
                             "tokens it prefilled per turn with and without its prompt cache")
    add_layout_args(parser)
    parser.add_argument("--shape", metavar="NAME",
                        help="instead of the AR comparison: record the demo model's (or --record-with's) "
                             "forwards on the suite's first --prompts prompts, derive the forwards of the same "
                             "prompts at the tokens per forward real checkpoints reach, replay them on a model "
                             f"of a real shape ({', '.join(shape_names())}; random weights) and time mlx-lm on "
                             "the same weights; with a forecast for Apple chips")
    parser.add_argument("--record-with", metavar="PATH",
                        help="with --shape: record the forwards with this local model folder (a converted "
                             "checkpoint) instead of the demo model, so the report follows its confidence; "
                             "--model means the same with --shape")
    parser.add_argument("--tokens-per-forward", type=positive_float, metavar="X",
                        help="with --shape: price (and on a GPU replay) one derived profile at X tokens per "
                             "forward instead of the default range 1.5, 2, 2.5, 3")
    parser.add_argument("--forecast-only", action="store_true",
                        help="with --shape: record and forecast, time nothing (the weights are never computed)")
    parser.add_argument("--q-bits", type=int, choices=(4, 8),
                        help="with --shape: quantize the shape's weights to 4 or 8 bits (group size 64)")
    parser.add_argument("--prompts", type=positive_int,
                        help="with --shape: how many of the suite's prompts to record (default 4; "
                             "--max-tokens defaults to 64 there)")
    parser.add_argument("--batch", type=positive_int, metavar="N",
                        help="with --shape: also time each profile as N requests decoded at once (their "
                             "forwards packed step by step, as the server's continuous batching runs them) "
                             "against the same N one at a time")
    parser.add_argument("--cost-curve", metavar="FILE",
                        help="with --shape: also price every profile from a device's measured cost of a forward "
                             "by width (the JSON of python -m benchmarks.forward_cost, or a record of "
                             "benchmarks/records), against AR's one-token forward measured beside it")
    return parser


# the flags of one measurement, refused without it (they would be ignored), and their defaults
MODE_FLAGS = {"shape": ("q_bits", "record_with", "tokens_per_forward", "forecast_only", "batch", "cost_curve",
                        "prompts"),
              "layouts": ("budgets", "slot_sizes", "limit", "data"), "concurrency": ("rounds", "http")}
MODE_DEFAULTS = {"prompts": 4, "budgets": [64, 128, 256, 512], "slot_sizes": [4, 8], "limit": 60, "rounds": 2,
                 "repeat": 1, "warmup": 1}
# the flags a measurement does not read, refused with it (they would be ignored): the sweep sets the layout and
# budget itself; the server applies the model's chat template to the chat messages it is sent
UNREAD = {"layouts": ("gen_length", "slot_size", "block_length", "serial_num_blocks", "repeat", "warmup", "no_ar",
                      "no_chat_template"),
          "concurrency": ("repeat", "warmup", "no_ar"), "http": ("no_chat_template",),
          "conversation": ("repeat", "warmup", "no_ar", "no_chat_template"), "shape": ("repeat", "warmup", "no_chat_template"),
          "forecast_only": ("batch",)}


def _same_file(a: str, b: str) -> bool:
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.warmup is not None and args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    if args.shape is not None and args.shape not in SHAPES and args.shape not in HIDDEN_SHAPES:
        parser.error(f"unknown --shape {args.shape!r}; known: {', '.join(shape_names())}")
    modes_given = [f"--{m}" for m in ("shape", "layouts", "concurrency", "conversation") if getattr(args, m)]
    if len(modes_given) > 1:
        parser.error(f"{' and '.join(modes_given)} are separate measurements: give one")
    refuse_unread(parser, args, MODE_FLAGS, UNREAD)
    fill_defaults(args, MODE_DEFAULTS)
    if args.json and args.json != "-":
        suite = DEFAULT_SUITE if args.suite == "default" else args.suite
        if any(_same_file(args.json, p) for p in (suite, args.data, args.cost_curve) if p):
            parser.error(f"--json {args.json} is an input of this run: give the report another file")
        package = Path(__file__).resolve().parents[1]  # refusion_mlx, as installed
        if package in Path(args.json).expanduser().resolve().parents:
            parser.error(f"--json {args.json} is inside the installed refusion_mlx package: give the report "
                         "another file")
    if args.shape is not None:
        if args.model and args.record_with and args.model != args.record_with:
            parser.error("--model and --record-with name the model that records the forwards: give one")
        args.record_with = args.record_with or args.model
    if args.kv_bits and args.layouts:
        parser.error("--kv-bits does not go with --layouts")
    overrides = {name: getattr(args, name) for name in PARAM_NAMES if getattr(args, name, None) is not None}

    def body() -> int:
        storage_from_args(args)  # a bad --kv-bits / --kv-group-size pair fails before anything loads
        dist = join(args)  # under mlx.launch: the comparison on every rank, rank 0 reports
        if dist is not None and (args.shape or args.layouts or args.concurrency or args.conversation):
            raise BenchError("under mlx.launch bench runs the comparison with mlx-lm only "
                             "(not --concurrency, --conversation, --layouts or --shape)")
        suite = load_suite(args.suite)
        try:
            resolve_all(suite, args.preset, overrides)
        except DecodeError as e:
            parser.error(str(e))
        if args.json and args.json != "-":
            try:
                check_writable(args.json)  # before the benchmark, not after it
            except OSError as e:
                raise BenchError(f"cannot write {args.json}: {e.strerror or e}") from None
        log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.verbose else None

        def emit(report: str, result: dict, leader: bool = True) -> int:
            # --json -: the JSON is standard output, so the table goes to standard error
            print(report, file=sys.stderr if args.json == "-" else sys.stdout, flush=True)
            if leader:
                write_json(args.json, result)
            return 0

        if args.shape:
            if args.record_with and not Path(args.record_with).expanduser().is_dir():
                raise BenchError(f"{args.record_with}: no such model folder (--record-with, or --model with "
                                 "--shape, records with a local model folder)")
            result = modes.measure_shape(args, suite, overrides, log)
            return emit(result.pop("report"), result)
        if args.layouts:
            result = modes.measure_layouts(args, suite, overrides, log)
            return emit(result.pop("report"), result)
        if args.concurrency or args.conversation:
            measure = (modes.run_conversation if args.conversation else modes.run_http if args.http
                       else modes.run_concurrency)
            result = measure(args, suite, overrides, log)
            return emit(result.pop("report"), result)
        with watchdog.armed():
            result = run_benchmark(args.model, suite, args.preset, overrides, args.dtype, args.repeat,
                                   args.warmup, not args.no_ar, not args.no_chat_template, log,
                                   adapter_path=args.adapter_path, dist=dist, kv_bits=args.kv_bits,
                                   kv_group_size=args.kv_group_size)
        return emit(format_report(result), result, dist is None or dist.leader)  # one file, from rank 0

    # a second Ctrl-C while the in-process server shuts down ends at once (not a teardown abort)
    with wired_limit(), interrupt_once():  # Metal: the weights stay resident while measuring
        return run(body)


if __name__ == "__main__":
    sys.exit(main())
