"""Scaling of the ReFusion decoder: time per generated token against the
budget and the prompt length, peak memory against the number of slots
decoded in parallel.

    python -m benchmarks.scaling --model models/qwen3-0.6b-random --json scaling.json
    python -m benchmarks.scaling --model M --sections slots --long-prompt 4096
    python -m benchmarks.scaling --sections budgets --budgets 128 --budget-prompt 1900 --ignore-eos --kv-bits 8

Three tables:

* budgets (default 128..1024) at a fixed block size and a fixed decoding
  path (``--mode``, default ``parallel``: plan + verify per block) after a
  random 64-token prompt (``--budget-prompt``) that is prefilled outside the clock, so the fixed
  prefill does not flatter long budgets. Wall and process CPU time per token
  (CPU time is steadier when other jobs share the cores). Target: within
  +-20% of budget 128's.
* prompts (default 64..2048 tokens) at one budget: prefill time, decode time
  per token, peak memory.
* slots (default 1/4/8/16) on a long prompt: the prompt is prefilled once
  into a committed cache with room for every run, then each run decodes
  one block of k slots forced into parallel infill (slot threshold 0, token
  threshold 1) and the cache is truncated back. Peak memory is reported in
  total and above the weights (cache + working memory: the cache-dominated
  figure). Target: 16 slots <= 1.05x the peak of 1 slot.
"""

from __future__ import annotations

import sys
import time
from typing import List, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from refusion_mlx.bench.report import format_table
from refusion_mlx.cli import run, storage_from_args
from refusion_mlx.decode.cache import CommittedCache
from refusion_mlx.decode.decoder import check_context
from refusion_mlx.decode.params import RefusionParams
from refusion_mlx.decode.prefill import prefill
from refusion_mlx.errors import DecodeError

from .speed_common import (MODES, base_parser, check_json_path, decode, load_model, make_params,
                           random_prompt, write_json)

SECTIONS = ("budgets", "prompts", "slots")
FLAT_TARGET = 0.20
SLOT_TARGET = 1.05
GB = 1e9
DEFAULT_PROMPTS = (64, 128, 256, 512, 1024, 2048)  # the prompt table's lengths, cut to the model's context
DEFAULT_LONG_PROMPT = 2048


def timed(model, tokenizer, prompt, params: RefusionParams, cache=None, storage=None,
          ignore_eos: bool = False) -> dict:
    """One run's time per token, forwards and peak memory."""
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    cpu0 = time.process_time()
    wall, dec = decode(model, tokenizer, prompt, params, cache, storage, ignore_eos)
    cpu = time.process_time() - cpu0
    s = dec.stats
    decode_s = wall - s.seconds["prefill"]
    tokens = max(s.generated_tokens, 1)
    return {"prompt_tokens": len(prompt), "gen_length": params.gen_length,
            "generated_tokens": s.generated_tokens, "committed_tokens": s.committed_tokens,
            "forwards": s.forwards, "steps": s.steps, "host_syncs": s.host_syncs,
            "wall_seconds": round(wall, 6), "prefill_seconds": round(s.seconds["prefill"], 6),
            "decode_ms_per_token": round(decode_s / tokens * 1000, 4),
            "ms_per_token": round(wall / tokens * 1000, 4),
            "cpu_seconds": round(cpu, 6), "cpu_ms_per_token": round(cpu / tokens * 1000, 4),
            "peak_memory_gb": round(mx.get_peak_memory() / GB, 4),
            "active_before_gb": round(before / GB, 4)}


def repeated(run, items, repeat: int, label, key: str = "decode_ms_per_token") -> List[dict]:
    """``run(item)`` ``repeat`` times per item, interleaved (item by item, then
    again), so slow spells of a shared machine spread over all rows; per item
    the run with the median decode time per token is kept."""
    runs: List[List[dict]] = [[] for _ in items]
    for _ in range(repeat):
        for i, item in enumerate(items):
            r = run(item)
            runs[i].append(r)
            print(f"  {label(item)}: {r[key]:.1f} ms/token, prefill {r['prefill_seconds']:.2f} s",
                  file=sys.stderr, flush=True)
    rows = []
    for rs in runs:
        best = sorted(rs, key=lambda r: r[key])[(len(rs) - 1) // 2]
        best[f"repeat_{key}"] = [r[key] for r in rs]
        rows.append(best)
    return rows


def budgets_section(model, tokenizer, args) -> List[dict]:
    """The prompt is prefilled outside the clock into a fresh cache per run
    (no spare room: the decoder grows it as it would), so every row times
    the same thing: the response alone, first planning pass included."""
    prompt = random_prompt(tokenizer, model, args.budget_prompt, args.seed)

    def run(b):
        cache = prefilled(model, prompt[:-1], room=0, storage=args.storage)
        r = timed(model, tokenizer, prompt[-1:], make_params(b, args.slot_size, args.block_length, args.mode),
                  cache, ignore_eos=args.ignore_eos)
        r["prompt_tokens"] = len(prompt)
        return r

    rows = repeated(run, args.budgets, args.repeat, lambda b: f"budget {b}", key="ms_per_token")
    for r in rows:
        r["vs_first"] = round(r["ms_per_token"] / rows[0]["ms_per_token"] - 1, 4)
        r["cpu_vs_first"] = round(r["cpu_ms_per_token"] / rows[0]["cpu_ms_per_token"] - 1, 4)
    return rows


def prompts_section(model, tokenizer, args) -> List[dict]:
    params = make_params(args.prompt_budget, args.slot_size, args.block_length, args.mode)
    return repeated(lambda n: timed(model, tokenizer, random_prompt(tokenizer, model, n, args.seed), params,
                                    storage=args.storage, ignore_eos=args.ignore_eos),
                    args.prompts, args.repeat, lambda n: f"prompt {n}")


def prefilled(model, prompt: List[int], room: int, storage=None) -> CommittedCache:
    """A committed cache holding ``prompt`` (the decoder's own chunked
    prefill), with ``room`` spare rows reserved so no run grows it (growth is
    not what this table measures); ``storage``: --kv-bits' form."""
    cache = CommittedCache.for_model(model, storage=storage)
    cache.reserve(len(prompt) + room)
    prefill(model, cache, prompt)
    mx.eval(cache.state())
    return cache


def truncate(cache: CommittedCache, length: int) -> None:
    """Forget every committed row from ``length`` on (the prompt stays, the run's rows go)."""
    cache.keep(range(min(length, len(cache))))


def slots_section(model, tokenizer, args) -> List[dict]:
    S = args.slot_size
    prompt = random_prompt(tokenizer, model, args.long_prompt, args.seed)
    cache = prefilled(model, prompt[:-1], room=max(args.slots) * S + 64, storage=args.storage)
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    rows = []
    for k in args.slots:
        params = RefusionParams(gen_length=k * S, slot_size=S, block_length=k * S, **MODES["infill"])
        r = timed(model, tokenizer, prompt[-1:], params, cache, ignore_eos=args.ignore_eos)
        truncate(cache, len(prompt) - 1)
        r.update(slots=k, prompt_tokens=len(prompt), weights_gb=round(weights / GB, 4),
                 cache_gb=round(cache.nbytes / GB, 4),
                 above_weights_gb=round(r["peak_memory_gb"] - weights / GB, 4),
                 working_gb=round(r["peak_memory_gb"] - r["active_before_gb"], 4))
        rows.append(r)
        print(f"  {k} slots: peak {r['peak_memory_gb']:.3f} GB", file=sys.stderr, flush=True)
    for r in rows:
        r["peak_vs_1"] = round(r["peak_memory_gb"] / rows[0]["peak_memory_gb"], 4)
        r["above_weights_vs_1"] = round(r["above_weights_gb"] / rows[0]["above_weights_gb"], 4)
    return rows


def print_tables(results: dict) -> None:
    if "budgets" in results:
        rows = [[r["gen_length"], r["generated_tokens"], r["forwards"], r["wall_seconds"],
                 r["ms_per_token"], f"{r['vs_first']:+.1%}", r["cpu_ms_per_token"],
                 f"{r['cpu_vs_first']:+.1%}", r["peak_memory_gb"] * 1000] for r in results["budgets"]]
        print(f"\ntime per generated token vs budget ({results['budgets'][0]['prompt_tokens']}-token prompt "
              "prefilled beforehand)")
        print(format_table(["budget", "tokens", "fwd", "wall s", "ms/token", "vs first", "CPU ms/token",
                            "vs first", "peak MB"], rows))
    if "prompts" in results:
        rows = [[r["prompt_tokens"], r["generated_tokens"], r["forwards"], r["prefill_seconds"],
                 r["decode_ms_per_token"], r["ms_per_token"], r["cpu_ms_per_token"], r["peak_memory_gb"] * 1000]
                for r in results["prompts"]]
        print("\ntime per generated token vs prompt length")
        print(format_table(["prompt", "tokens", "fwd", "prefill s", "ms/token (decode)",
                            "ms/token (e2e)", "CPU ms/token (e2e)", "peak MB"], rows))
    if "slots" in results:
        rows = [[r["slots"], r["forwards"], r["wall_seconds"], r["peak_memory_gb"] * 1000,
                 r["above_weights_gb"] * 1000, r["cache_gb"] * 1000, r["working_gb"] * 1000,
                 f"{r['peak_vs_1']:.3f}x", f"{r['above_weights_vs_1']:.3f}x"] for r in results["slots"]]
        print(f"\npeak memory vs slots in parallel ({results['slots'][0]['prompt_tokens']}-token prompt, "
              "parallel infill)")
        print(format_table(["slots", "fwd", "wall s", "peak MB", "above weights MB", "cache MB",
                            "working MB", "peak vs 1", "above weights vs 1"], rows))


def summary(results: dict) -> dict:
    out = {}
    if "budgets" in results:
        devs = [r["vs_first"] for r in results["budgets"]]
        out["budget_max_deviation"] = max(devs, key=abs)
        out["budget_within_target"] = all(abs(d) <= FLAT_TARGET for d in devs)
        out["budget_max_cpu_deviation"] = max((r["cpu_vs_first"] for r in results["budgets"]), key=abs)
    if "slots" in results:
        last = results["slots"][-1]
        out["slots_peak_ratio"] = last["peak_vs_1"]
        out["slots_above_weights_ratio"] = last["above_weights_vs_1"]
        out["slots_within_target"] = last["above_weights_vs_1"] <= SLOT_TARGET
    return out


def fit_context(model, args, sections: List[str]) -> None:
    """The defaults of --prompts and --long-prompt cut to what the model's context leaves beside their
    budgets; then every section's longest run checked against it (``check_context``): a DecodeError naming
    the flags, before anything is measured, rather than a section failing after the ones before it ran."""
    context = model.args.max_position_embeddings
    slots = max(args.slots) * args.slot_size
    if args.prompts is None:
        budget = make_params(args.prompt_budget, args.slot_size, args.block_length, args.mode)
        left = context - budget.layout().gen_length
        args.prompts = sorted({min(n, left) for n in DEFAULT_PROMPTS if left >= 1})
    if args.long_prompt is None:
        args.long_prompt = max(2, min(DEFAULT_LONG_PROMPT, context - slots))
    runs = {"budgets": [(f"--budgets {b} after --budget-prompt {args.budget_prompt}", args.budget_prompt,
                         make_params(b, args.slot_size, args.block_length, args.mode)) for b in args.budgets],
            "prompts": [(f"--prompts {n} with --prompt-budget {args.prompt_budget}", n,
                         make_params(args.prompt_budget, args.slot_size, args.block_length, args.mode))
                        for n in args.prompts or [context]],
            "slots": [(f"--long-prompt {args.long_prompt} with --slots {max(args.slots)}", args.long_prompt,
                       RefusionParams(gen_length=slots, slot_size=args.slot_size, block_length=slots))]}
    for name in sections:
        for what, prompt, params in runs[name]:
            try:
                check_context(model, prompt, params)
            except DecodeError as e:
                raise DecodeError(f"{what}: {e}") from None


def int_list(text: str) -> List[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise ValueError(text)
    return values


def main(argv: Optional[List[str]] = None) -> int:
    parser = base_parser("python -m benchmarks.scaling", "Decoder scaling: budget, prompt length, slots.")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--mode", choices=sorted(MODES), default="parallel",
                        help="decoding path for the budget and prompt tables (default parallel)")
    parser.add_argument("--block-length", type=int, default=16)
    parser.add_argument("--budgets", type=int_list, default=[128, 256, 512, 1024])
    parser.add_argument("--budget-prompt", type=int, default=64,
                        help="prompt of the budget table, prefilled outside the clock (default 64; a long one "
                             "times decoding at a long context)")
    parser.add_argument("--prompts", type=int_list,
                        help="prompt lengths of the prompt table (default 64, 128, ..., 2048, each cut to what "
                             "the model's context leaves beside --prompt-budget)")
    parser.add_argument("--prompt-budget", type=int, default=128, help="budget of the prompt table")
    parser.add_argument("--slots", type=int_list, default=[1, 4, 8, 16])
    parser.add_argument("--long-prompt", type=int,
                        help="prompt of the slots table (default 2048, or what the model's context leaves "
                             "beside the most slots)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per row of the budget and prompt tables (median kept)")
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if not sections or any(s not in SECTIONS for s in sections):
        parser.error(f"--sections takes {', '.join(SECTIONS)}")
    for name in ("block_length", "prompt_budget", "long_prompt", "slot_size", "repeat", "budget_prompt"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.long_prompt is not None and args.long_prompt < 2:
        parser.error("--long-prompt must be at least 2")

    def body() -> int:
        check_json_path(args.json)
        for b in args.budgets + [args.prompt_budget]:
            make_params(b, args.slot_size, args.block_length, args.mode).layout()
        storage_from_args(args)  # a bad pair fails before the model loads
        model, tokenizer, env = load_model(args.model, args.dtype)
        args.storage = storage_from_args(args, model)
        fit_context(model, args, sections)  # every row fits, or one line before any is measured
        print(f"scaling: slot {args.slot_size}, block {args.block_length}, mode {args.mode} "
              f"({MODES[args.mode]}); median of {args.repeat} run(s) per row; "
              f"KV cache: {args.storage.describe(model.cache_spec())}")
        warm = random_prompt(tokenizer, model, 64, args.seed)
        decode(model, tokenizer, warm, make_params(args.block_length, args.slot_size, args.block_length, args.mode),
               storage=args.storage)
        results = {}
        for name, fn in (("budgets", budgets_section), ("prompts", prompts_section), ("slots", slots_section)):
            if name in sections:
                results[name] = fn(model, tokenizer, args)
        print_tables(results)
        summ = summary(results)
        if summ:
            print("\nsummary:", ", ".join(f"{k} {v}" for k, v in summ.items()))
        settings = {k: v for k, v in vars(args).items() if k not in ("json", "storage")}
        write_json(args.json, {"meta": env, "settings": settings,
                               "targets": {"budget_deviation": FLAT_TARGET, "slots_ratio": SLOT_TARGET},
                               **results, "summary": summ})
        return 0

    return run(body)


if __name__ == "__main__":
    sys.exit(main())
