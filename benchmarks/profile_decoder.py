"""Where a ReFusion run spends its time: waiting for MLX to compute (inside
``mx.eval``) or in Python (building the lazy graph, decoder bookkeeping).

    python -m benchmarks.profile_decoder                       # demo model, default suite prompts
    python -m benchmarks.profile_decoder --model models/qwen3-0.6b-random --cases 2 --gen-length 32

MLX is lazy: a Python call such as ``model.hidden`` only records operations;
the work happens when something is evaluated. So under cProfile the time
inside ``mlx.core.eval`` is compute (and the wait for it), and everything else
is host-side overhead the decoder could trim, keep lazy, or compile away.
``--compile-check`` also times a plain forward eagerly and under
``mx.compile`` to show what compilation could save per forward.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from contextlib import contextmanager
from typing import Dict, List, Optional

import mlx.core as mx

from refusion_mlx.bench.report import format_table
from refusion_mlx.bench.suite import load_suite, resolve_params
from refusion_mlx.cli import run, storage_from_args
from refusion_mlx.decode.stream import chat_prompt

from .speed_common import MODES, base_parser, check_json_path, decode, load_model, write_json

# Buckets by where a function lives / what it is. MLX's functions are not
# Python builtins to cProfile: an op call's time counts as its caller's own
# time, so "model Python" includes building the model's lazy graph. mx.eval
# is wrapped (see ``timed_eval``) so that waiting for MLX gets its own entry.
# The model's Python: the package's models/ (the families, causal_lm.py, the
# joined projections, RoPE, the CPU paths' ops) and the runner that drives a
# decode pass through them, MLX's nn layers and mlx-lm's models (the AR side).
MODEL_FILES = ("refusion_mlx/models/", "refusion_mlx/decode/runner.py", "/mlx/nn/", "/mlx_lm/models")
BUCKETS = (
    ("mx.eval (compute + wait)", lambda f, n: n == "mlx_eval"),
    ("numpy conversion", lambda f, n: n in ("<built-in method numpy.array>", "<built-in method numpy.asarray>")),
    ("model Python + graph building", lambda f, n: any(m in f.replace("\\", "/") for m in MODEL_FILES)),
    ("cache Python (cache.py, kv_store.py)", lambda f, n: f.endswith(("cache.py", "kv_store.py"))),
    ("decoder Python (decoder.py)", lambda f, n: f.endswith("decoder.py")),
)


def bucket_of(file: str, name: str) -> str:
    """The bucket a profiled function's own time counts in."""
    return next((bucket for bucket, test in BUCKETS if test(file, name)), "other Python")


@contextmanager
def timed_eval():
    """Route mx.eval through a Python function cProfile can see."""
    real = mx.eval

    def mlx_eval(*args, **kwargs):
        return real(*args, **kwargs)

    mx.eval = mlx_eval
    try:
        yield
    finally:
        mx.eval = real


def bucket_times(stats: pstats.Stats) -> Dict[str, float]:
    """Own time (tottime) of every function, summed per bucket."""
    out = {name: 0.0 for name, _ in BUCKETS}
    out["other Python"] = 0.0
    for (file, _line, func), (_cc, _nc, tt, _ct, _callers) in stats.stats.items():
        out[bucket_of(file, func)] += tt
    return out


def top_functions(stats: pstats.Stats, n: int) -> List[list]:
    rows = []
    items = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:n]
    for (file, line, func), (_cc, nc, tt, ct, _callers) in items:
        where = func if file == "~" else f"{file.split('/')[-1]}:{line} {func}"
        rows.append([where[:70], nc, tt * 1000, ct * 1000])
    return rows


def compile_check(model, sizes=(4, 16, 64)) -> List[dict]:
    """A plain causal forward (no cache), eager vs mx.compile, per size."""
    out = []
    fn = mx.compile(lambda t, p: model(t, p))
    for T in sizes:
        tokens = mx.zeros((1, T), dtype=mx.int32)
        positions = mx.arange(T, dtype=mx.int32)
        row = {"tokens": T}
        for label, f in (("eager", lambda: model(tokens, positions)), ("compiled", lambda: fn(tokens, positions))):
            mx.eval(f())  # warm (and trace)
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                mx.eval(f())
                times.append(time.perf_counter() - t0)
            row[f"{label}_ms"] = round(sorted(times)[2] * 1000, 3)
        out.append(row)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    parser = base_parser("python -m benchmarks.profile_decoder", "Profile ReFusion decoder runs.",
                         random_prompts=False)
    parser.set_defaults(slot_size=None)
    parser.add_argument("--suite", default="default", help="prompts to decode ('default' or a suite file)")
    parser.add_argument("--cases", type=int, default=0, help="only the first N prompts (default all)")
    parser.add_argument("--gen-length", type=int, help="override the suite's budget")
    parser.add_argument("--block-length", type=int, help="override the suite's block layout")
    parser.add_argument("--mode", choices=sorted(MODES), help="override the suite's thresholds")
    parser.add_argument("--top", type=int, default=25, help="functions listed (by own time)")
    parser.add_argument("--compile-check", action="store_true", help="also time eager vs mx.compile forwards")
    args = parser.parse_args(argv)
    if args.cases < 0 or args.top < 1 or any(v is not None and v < 1
                                             for v in (args.gen_length, args.block_length, args.slot_size)):
        parser.error("--cases must be >= 0; --top, --gen-length, --block-length and --slot-size positive")

    def body() -> int:
        check_json_path(args.json)
        suite = load_suite(args.suite)
        cases = suite.cases[: args.cases] if args.cases else suite.cases
        overrides = dict(MODES[args.mode]) if args.mode else {}
        if args.gen_length:
            overrides["gen_length"] = args.gen_length
        if args.block_length:
            overrides["block_length"] = args.block_length
        if args.slot_size:
            overrides["slot_size"] = args.slot_size
        params = [resolve_params(suite, c, None, overrides) for c in cases]
        storage_from_args(args)  # a bad pair fails before the model loads
        model, tokenizer, env = load_model(args.model, args.dtype)
        storage = storage_from_args(args, model)
        prompts = [chat_prompt(tokenizer, c.prompt, system=c.system) for c in cases]

        def run_all():
            total = 0
            for p, rp in zip(prompts, params):
                _, dec = decode(model, tokenizer, p, rp, storage=storage, ignore_eos=args.ignore_eos)
                total += dec.stats.forwards
            return total

        run_all()  # warm-up
        t0 = time.perf_counter()
        forwards = run_all()
        plain = time.perf_counter() - t0
        profiler = cProfile.Profile()
        t0 = time.perf_counter()
        with timed_eval():
            profiler.enable()
            run_all()
            profiler.disable()
        profiled = time.perf_counter() - t0
        stats = pstats.Stats(profiler, stream=io.StringIO())
        buckets = bucket_times(stats)
        print(f"\n{len(cases)} prompt(s), {forwards} forwards, slot {params[0].slot_size}"
              f"{', EOS ignored' if args.ignore_eos else ''}, KV cache {storage.describe(model.cache_spec())}: "
              f"{plain * 1000:.1f} ms unprofiled, "
              f"{profiled * 1000:.1f} ms under cProfile ({plain / forwards * 1000:.2f} ms per forward unprofiled)")
        total = sum(buckets.values())
        print(format_table(["where (own time)", "ms", "share"],
                           [[k, v * 1000, f"{v / total:.1%}"] for k, v in buckets.items()]))
        print(f"\ntop {args.top} functions by own time")
        top = top_functions(stats, args.top)
        print(format_table(["function", "calls", "own ms", "cumulative ms"], top))
        result = {"meta": env, "prompts": len(cases), "forwards": forwards, "slot_size": params[0].slot_size,
                  "ignore_eos": args.ignore_eos, "kv_bits": storage.bits, "unprofiled_seconds": plain,
                  "profiled_seconds": profiled, "buckets_seconds": buckets,
                  "top": [dict(zip(("function", "calls", "own_ms", "cumulative_ms"), r)) for r in top]}
        if args.compile_check:
            rows = compile_check(model)
            print("\nplain forward, eager vs mx.compile (median of 5)")
            print(format_table(["tokens", "eager ms", "compiled ms"],
                               [[r["tokens"], r["eager_ms"], r["compiled_ms"]] for r in rows]))
            result["compile_check"] = rows
        write_json(args.json, result)
        return 0

    return run(body)


if __name__ == "__main__":
    sys.exit(main())
