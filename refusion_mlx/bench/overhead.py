"""Decoder overhead: wall time of a ReFusion run / time of the same forwards run bare.

A recording run notes the shape of every forward the decoder makes; timed
decoder runs and bare replays of those forwards (same shapes, same count, a
plain KV buffer, one evaluation per forward) then alternate, and the medians
are compared. Also reported: host synchronisations per decoding step (the
decoder's own count, and every ``mx.eval`` it makes), and the split per phase.

    python -m refusion_mlx.bench.overhead --model models/qwen3-0.6b-random
    python -m refusion_mlx.bench.overhead                     # the bundled demo model

Modes fix the decoding path whatever the weights (see speed_common.MODES).
Target (issue): overhead <= 1.10x on the Qwen3-0.6B shape.
"""

from __future__ import annotations

import sys
from typing import List, Optional

from .forward_replay import PHASE_ORDER, RecordingModel, by_phase, count_by_phase, prepare, replay
from .speed_common import (MODES, base_parser, check_json_path, counting_evals, decode, load_model,
                           make_params, random_prompt, write_json)
from ..cli import run

from .report import format_table
from ..errors import RefusionError

TARGET = 1.10


def measure_mode(model, tokenizer, prompt, params, repeat: int) -> dict:
    """Record, then alternate timed decoder runs with bare replays."""
    recorder = RecordingModel(model)
    with counting_evals() as evals:
        _, recorded = decode(recorder, tokenizer, prompt, params)
    shapes = recorder.shapes()
    prepared = prepare(model, shapes)
    walls, bares, runs = [], [], []
    for i in range(repeat):
        if i % 2:  # alternate which goes first, so neither always runs on a warmer machine
            bares.append(replay(model, prepared))
        wall, dec = decode(model, tokenizer, prompt, params)
        if dec.stats.forwards != len(shapes):
            raise RefusionError(f"the timed run made {dec.stats.forwards} forwards, the recorded "
                                f"one {len(shapes)}: the decoder is not deterministic here")
        walls.append(wall)
        runs.append(dec)
        if not i % 2:
            bares.append(replay(model, prepared))
    mid = sorted(range(repeat), key=lambda i: walls[i])[(repeat - 1) // 2]
    bare_mid = sorted(bares, key=sum)[(repeat - 1) // 2]
    stats = runs[mid].stats
    steps = max(stats.steps, 1)
    return {
        "params": {k: getattr(params, k) for k in ("gen_length", "slot_size", "block_length",
                                                   "slot_threshold", "token_threshold")},
        "prompt_tokens": len(prompt),
        "generated_tokens": stats.generated_tokens,
        "committed_tokens": stats.committed_tokens,
        "forwards": stats.forwards,
        "steps": stats.steps,
        "host_syncs": stats.host_syncs,
        "host_syncs_per_step": round(stats.host_syncs / steps, 3),
        "evals": evals["evals"],
        "evals_per_step": round(evals["evals"] / max(recorded.stats.steps, 1), 3),
        "decoder_seconds": round(walls[mid], 6),
        "decoder_phase_seconds": {k: round(v, 6) for k, v in stats.seconds.items()},
        "bare_seconds": round(sum(bare_mid), 6),
        "bare_phase_seconds": {k: round(v, 6) for k, v in by_phase(shapes, bare_mid).items()},
        "forwards_per_phase": count_by_phase(shapes),
        "overhead": round(walls[mid] / sum(bare_mid), 4),
        "repeat_decoder_seconds": [round(w, 6) for w in walls],
        "repeat_bare_seconds": [round(sum(b), 6) for b in bares],
        "forward_tokens": [s.tokens for s in shapes],
    }


def report(results: dict) -> str:
    rows = []
    for mode, r in results.items():
        rows.append([mode, r["generated_tokens"], r["forwards"], r["steps"], r["host_syncs_per_step"],
                     r["evals_per_step"], r["decoder_seconds"], sum(r["decoder_phase_seconds"].values()),
                     r["bare_seconds"], f"{r['overhead']:.3f}x"])
    lines = [format_table(["mode", "tokens", "fwd", "steps", "syncs/step", "evals/step", "decoder s",
                           "phases s", "bare s", "overhead"], rows, left=[0])]
    for mode, r in results.items():
        prow = []
        for p in PHASE_ORDER:
            d, b = r["decoder_phase_seconds"][p], r["bare_phase_seconds"][p]
            prow.append([p, r["forwards_per_phase"][p], d * 1000, b * 1000,
                         f"{d / b:.3f}x" if b > 0 else None])
        other = r["decoder_seconds"] - sum(r["decoder_phase_seconds"].values())
        prow.append(["outside phases", None, other * 1000, None, None])
        lines += ["", f"mode {mode}: per phase (decoder vs bare forwards)",
                  format_table(["phase", "fwd", "decoder ms", "bare ms", "ratio"], prow, left=[0])]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = base_parser("python -m refusion_mlx.bench.overhead", "Decoder overhead over bare forwards.")
    parser.add_argument("--modes", default="reference,parallel,infill",
                        help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--gen-length", type=int, default=64, help="response budget (default 64)")
    parser.add_argument("--block-length", type=int, default=16, help="block size in tokens (default 16)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="random prompt length (default 64)")
    parser.add_argument("--repeat", type=int, default=3, help="timed decoder runs and replays (median)")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        parser.error(f"unknown mode(s) {', '.join(bad) or '(none)'}; known: {', '.join(MODES)}")
    for name in ("gen_length", "block_length", "prompt_tokens", "repeat", "slot_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")

    def body() -> int:
        check_json_path(args.json)
        for m in modes:
            make_params(args.gen_length, args.slot_size, args.block_length, m).layout()
        model, tokenizer, env = load_model(args.model, args.dtype)
        prompt = random_prompt(tokenizer, model, args.prompt_tokens, args.seed)
        print(f"decoder overhead: budget {args.gen_length}, slot {args.slot_size}, block {args.block_length}, "
              f"random prompt of {len(prompt)} tokens, median of {args.repeat}; target <= {TARGET:.2f}x\n")
        results = {}
        for m in modes:
            params = make_params(args.gen_length, args.slot_size, args.block_length, m)
            results[m] = measure_mode(model, tokenizer, prompt, params, args.repeat)
            print(f"  {m}: overhead {results[m]['overhead']:.3f}x", file=sys.stderr, flush=True)
        print(report(results))
        write_json(args.json, {"meta": env, "target": TARGET, "modes": results})
        return 0

    return run(body)


if __name__ == "__main__":
    sys.exit(main())
