"""Logit parity of a converted MLX folder with its PyTorch checkpoint.

    python -m convert.parity --hf-path SRC --mlx-path DST [--min-top1 0.99]

Runs transformers' ``Qwen3ForCausalLM`` (float32, eager attention) on the
PyTorch checkpoint and ``refusion_mlx`` on the converted folder over the same
token sequences, with explicit ``position_ids``: once in order and once
the way ReFusion feeds them (slots committed out of order, so sequence order
and position order differ). Reports the largest logit difference and the
top-1 agreement; exits 1 when agreement is below ``--min-top1``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import refusion_mlx  # noqa: F401  (before mlx.core: optimized BLAS on Linux)
import mlx.core as mx
import numpy as np

from refusion_mlx.cli import OneLineParser, positive_int
from refusion_mlx.errors import RefusionError

Sequence = Tuple[str, np.ndarray, np.ndarray]  # (label, token ids, position ids)


def sequences(vocab: int, length: int, count: int, slot: int = 4, seed: int = 0) -> List[Sequence]:
    """Random token sequences, each with in-order and slot-shuffled positions."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        ids = rng.integers(0, vocab, size=length)
        plain = np.arange(length)
        prefix = length // 2
        slots = rng.permutation((length - prefix) // slot)
        tail = np.concatenate([np.arange(prefix + s * slot, prefix + (s + 1) * slot) for s in slots])
        shuffled = np.concatenate([plain[:prefix], tail, plain[prefix + len(tail):]])
        out += [(f"seq{i}-plain", ids, plain), (f"seq{i}-slots", ids, shuffled)]
    return out


def golden_sequences(npz: Path) -> List[Sequence]:
    """The sequences of a golden-logits file (keys ``{name}_input_ids``, ``{name}_position_ids``)."""
    data = np.load(npz)
    names = sorted(k[: -len("_input_ids")] for k in data if k.endswith("_input_ids"))
    return [(n, data[f"{n}_input_ids"], data[f"{n}_position_ids"]) for n in names]


def torch_logits(src: Path, seqs: List[Sequence]) -> Dict[str, np.ndarray]:
    import torch
    from transformers import AutoModelForCausalLM

    # the checkpoint's own architecture (Qwen3 or Llama): another class would leave weights out and differ
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    out = {}
    with torch.no_grad():
        for label, ids, pos in seqs:
            logits = model(input_ids=torch.tensor(ids)[None], position_ids=torch.tensor(pos)[None]).logits
            out[label] = logits[0].float().numpy()
    return out


def mlx_logits(dst: Path, seqs: List[Sequence], dtype: str) -> Dict[str, np.ndarray]:
    from refusion_mlx.models.loading import load

    model, _ = load(dst, dtype=dtype)
    out = {}
    for label, ids, pos in seqs:
        logits = model(mx.array(ids)[None], mx.array(pos)).astype(mx.float32)
        out[label] = np.array(logits[0])
    return out


def compare(ref: Dict[str, np.ndarray], got: Dict[str, np.ndarray]) -> dict:
    rows, agree, total = [], 0, 0
    for label in ref:
        a, b = ref[label], got[label]
        same = int((a.argmax(-1) == b.argmax(-1)).sum())
        rows.append({"sequence": label, "tokens": len(a), "top1_agree": same,
                     "max_abs_diff": float(np.abs(a - b).max()),
                     "mean_abs_diff": float(np.abs(a - b).mean())})
        agree, total = agree + same, total + len(a)
    return {"top1_agreement": agree / total, "tokens": total,
            "max_abs_diff": max(r["max_abs_diff"] for r in rows), "sequences": rows}


def parity(src: Path, dst: Path, dtype: str = "float32", seqs: Optional[List[Sequence]] = None,
           length: int = 64, count: int = 2) -> dict:
    """Compare logits; the result has ``top1_agreement`` and ``max_abs_diff``."""
    if seqs is None:
        vocab = json.loads((Path(src) / "config.json").read_text())["vocab_size"]
        seqs = sequences(vocab, length, count)
    return compare(torch_logits(Path(src), seqs), mlx_logits(Path(dst), seqs, dtype))


def sequence_length(text: str) -> int:
    """argparse type: a length of at least 8 (its second half is shuffled in slots of 4)."""
    value = positive_int(text)
    if value < 8:
        raise argparse.ArgumentTypeError(f"expected at least 8 (half of it is shuffled in slots of 4), got {value}")
    return value


def main(argv: Optional[List[str]] = None) -> int:
    parser = OneLineParser(prog="python -m convert.parity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-path", type=Path, required=True, help="the PyTorch checkpoint folder")
    parser.add_argument("--mlx-path", type=Path, required=True, help="the converted folder")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                        help="MLX compute dtype (PyTorch always runs float32)")
    parser.add_argument("--golden", type=Path, help="take the sequences from a golden-logits .npz")
    parser.add_argument("--length", type=sequence_length, default=64, help="random sequence length (8 or more)")
    parser.add_argument("--count", type=positive_int, default=2, help="random sequences (each run plain and slotted)")
    parser.add_argument("--min-top1", type=float, default=0.99, help="fail below this top-1 agreement")
    parser.add_argument("--json", action="store_true", help="print the full report as JSON")
    args = parser.parse_args(argv)
    for flag, folder in (("--hf-path", args.hf_path), ("--mlx-path", args.mlx_path)):
        if not (folder / "config.json").is_file():
            parser.error(f"{flag} {folder} is not a model folder (no config.json)")
    if args.golden and not args.golden.is_file():
        parser.error(f"--golden {args.golden} does not exist")
    try:
        seqs = golden_sequences(args.golden) if args.golden else None
        report = parity(args.hf_path, args.mlx_path, args.dtype, seqs, args.length, args.count)
    except (RefusionError, OSError, ValueError) as e:  # a folder that does not load, a bad .npz
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for r in report["sequences"]:
            print(f"{r['sequence']:>14}: top-1 {r['top1_agree']}/{r['tokens']}, "
                  f"max |diff| {r['max_abs_diff']:.3g}, mean |diff| {r['mean_abs_diff']:.3g}")
        print(f"top-1 agreement {report['top1_agreement']:.4f} over {report['tokens']} tokens, "
              f"max |diff| {report['max_abs_diff']:.3g}")
    ok = report["top1_agreement"] >= args.min_top1
    if not ok:
        print(f"FAIL: top-1 agreement below {args.min_top1}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
