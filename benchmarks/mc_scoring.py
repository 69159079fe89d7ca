"""Scoring speed: the Monte Carlo log-likelihood estimator (``decode/scoring.py``)
against the same estimate with a whole forward per sample.

    python -m benchmarks.mc_scoring                        # the bundled demo model, three shapes, mc_num 128
    python -m benchmarks.mc_scoring --shapes 500:5,2000:10 --mc-num 32 --json scoring.json

Each shape is ``context:scored`` tokens of a random prompt. The runtime's
estimator feeds the context once into a cache and then every sample's
scored tokens over it (``MCScorer``); the reference computes what the
authors' ``eval.py`` computes, every sample a whole causal forward of the
context and the continuation (16 samples a forward, as the estimator
did before). Reported per shape: seconds of each, the speed-up, and the
largest difference between their per-token estimates (they are the same
estimate, computed in another order). ``--kv-bits`` keeps the estimator's
cache quantized (the reference has no cache: the difference then includes
the quantization's).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional, Sequence

import mlx.core as mx
import numpy as np

from refusion_mlx.bench.report import format_table
from refusion_mlx.cli import run, storage_from_args
from refusion_mlx.decode.scoring import MC_ROWS, mc_masks, score_mc

from .speed_common import base_parser, check_json_path, load_model, write_json


def whole_forwards(model, ids: Sequence[int], context: int, mask_id: int, mc_num: int, seed: int) -> np.ndarray:
    """Per scored token, the estimate from a whole causal forward per sample
    (training's MDM layout, docs/training.md: the context, the continuation's unmasked
    tokens, then its masked ones as the mask id, each at its position)."""
    n, target, seq = len(ids), len(ids) - context, np.array(ids, np.int32)
    masks = mc_masks(target, mc_num, np.random.default_rng(seed))
    total = np.zeros(target)
    for start in range(0, mc_num, MC_ROWS):
        part = masks[start:start + MC_ROWS]
        orders = np.stack([np.concatenate([np.arange(context), context + np.flatnonzero(~m),
                                           context + np.flatnonzero(m)]) for m in part]).astype(np.int32)
        masked = np.arange(n)[None, :] >= n - part.sum(axis=1)[:, None]
        tokens = np.where(masked, mask_id, seq[orders]).astype(np.int32)
        logits = model(mx.array(tokens), mx.array(orders)).astype(mx.float32)
        picked = mx.take_along_axis(logits, mx.array(seq[orders])[..., None], axis=-1)[..., 0]
        lp = np.array(picked - mx.logsumexp(logits, axis=-1))
        for b, m in enumerate(part):
            rows = np.flatnonzero(masked[b])
            np.add.at(total, orders[b, rows] - context, lp[b, rows] / (m.sum() / target))
    return total / mc_num


def shapes_arg(text: str) -> List[tuple]:
    out = []
    for item in text.split(","):
        context, _, scored = item.partition(":")
        try:
            pair = (int(context), int(scored))
        except ValueError:  # ArgumentTypeError: argparse shows its message (a ValueError's it drops)
            raise argparse.ArgumentTypeError(f"{item!r} is not a shape: a shape is CONTEXT:SCORED, the "
                                             "prompt's tokens and the answer's tokens scored (e.g. 500:5)") from None
        if min(pair) < 1:
            raise argparse.ArgumentTypeError(f"{item!r} needs at least one token of context and one scored")
        out.append(pair)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    parser = base_parser("python -m benchmarks.mc_scoring",
                         "The Monte Carlo estimator, context fed once, against a whole forward per sample.",
                         decodes=False)
    parser.add_argument("--shapes", type=shapes_arg, default=[(100, 20), (500, 5), (1000, 10)],
                        help="CONTEXT:SCORED token counts, comma-separated (default 100:20,500:5,1000:10)")
    parser.add_argument("--mc-num", type=int, default=128, help="samples per estimate (default 128)")
    args = parser.parse_args(argv)
    if args.mc_num < 1:
        parser.error("--mc-num must be positive")

    def body() -> int:
        check_json_path(args.json)
        storage_from_args(args)  # a bad pair fails before the model loads
        model, _, env = load_model(args.model, args.dtype)
        storage = storage_from_args(args, model)
        mask_id, rng = model.args.mask_token_id, np.random.default_rng(args.seed)
        rows = []
        for context, scored in args.shapes:
            ids = [int(t) for t in rng.integers(1, model.args.vocab_size - 1, context + scored)]
            t0 = time.perf_counter()
            fast = score_mc(model, ids, context, mask_id, args.mc_num, args.seed, storage=storage).logprobs[context:]
            t1 = time.perf_counter()
            slow = whole_forwards(model, ids, context, mask_id, args.mc_num, args.seed)
            t2 = time.perf_counter()
            rows.append({"context": context, "scored": scored, "mc_num": args.mc_num,
                         "context_once_s": round(t1 - t0, 4), "whole_forwards_s": round(t2 - t1, 4),
                         "speedup": round((t2 - t1) / (t1 - t0), 2),
                         "max_difference": float(np.max(np.abs(np.array(fast) - slow)))})
            print(f"{context}:{scored} done", file=sys.stderr, flush=True)
        print(f"KV cache of the estimator: {storage.describe(model.cache_spec())}")
        print(format_table(["context", "scored", "mc_num", "context once s", "whole forwards s", "speed-up",
                            "largest difference"],
                           [[r["context"], r["scored"], r["mc_num"], f"{r['context_once_s']:.2f}",
                             f"{r['whole_forwards_s']:.2f}", f"{r['speedup']:.1f}x", f"{r['max_difference']:.1e}"]
                            for r in rows]))
        write_json(args.json, {"environment": env, "kv_bits": storage.bits, "rows": rows})
        return 0

    return run(body)


if __name__ == "__main__":
    sys.exit(main())
