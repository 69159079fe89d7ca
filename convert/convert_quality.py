"""How each conversion of the demo model fares on the golden fixtures.

    python -m convert.convert_quality [--variants f32,bf16,fp16,q8,q4,embed_8,mixed_4_6]

Converts ``refusion_mlx/demo/tiny-refusion`` once per variant and reports,
with the runtime as it is (quantized layers on MLX's quantized kernels):
the golden decoding cases reproduced token for token (float32 compute), the
top-1 agreement with the PyTorch logits of ``tests/fixtures/golden_logits.npz``
(in the stored dtype), and size and bits per weight.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

import refusion_mlx  # noqa: F401  (before mlx.core: optimized BLAS on Linux)
import mlx.core as mx
import numpy as np

from refusion_mlx.cli import OneLineParser
from refusion_mlx.convert import convert
from refusion_mlx.decode.decoder import RefusionDecoder
from refusion_mlx.decode.params import RefusionParams
from refusion_mlx.models.loading import load

FIXTURE_MODEL = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tiny-refusion"  # the golden cases' model

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
VARIANTS = {
    "f32": dict(dtype="float32"), "bf16": dict(dtype="bfloat16"), "fp16": dict(dtype="float16"),
    "q8": dict(quantize=True, q_bits=8), "q6": dict(quantize=True, q_bits=6),
    "q4": dict(quantize=True, q_bits=4), "q4-g32": dict(quantize=True, q_bits=4, q_group_size=32),
    "embed_8": dict(quant_predicate="embed_8"), "mixed_4_6": dict(quant_predicate="mixed_4_6"),
}


def golden_exact(folder: Path, cases: list) -> int:
    model, tok = load(folder, dtype="float32")
    exact = 0
    for c in cases:
        params = RefusionParams(gen_length=c["gen_length"], slot_size=c["slot_size"],
                                serial_num_blocks=c["serial_num_blocks"],
                                slot_threshold=c["slot_threshold"], token_threshold=c["token_threshold"])
        dec = RefusionDecoder(model, c["prompt_ids"], params, mask_id=model.args.mask_token_id,
                              eos_id=tok.eos_token_id)
        for _ in dec.steps():
            pass
        exact += dec.response() == c["output_ids"]
    return exact


def top1(folder: Path, logits: dict) -> tuple:
    model, _ = load(folder, dtype=_stored(folder))
    agree = total = 0
    for kind in ("plain", "slots"):
        out = model(mx.array(logits[f"{kind}_input_ids"])[None], mx.array(logits[f"{kind}_position_ids"]))
        ref = logits[f"{kind}_logits"]
        agree += int((np.array(out[0].astype(mx.float32)).argmax(-1) == ref.argmax(-1)).sum())
        total += len(ref)
    return agree, total


def _stored(folder: Path) -> str:
    return json.loads((folder / "config.json").read_text())["torch_dtype"]


def main(argv: Optional[List[str]] = None) -> int:
    parser = OneLineParser(prog="python -m convert.convert_quality", description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="f32,bf16,fp16,q8,q6,q4,q4-g32,embed_8,mixed_4_6")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant {', '.join(unknown)}; the variants are {', '.join(VARIANTS)}")
    cases = json.loads((FIXTURES / "golden_outputs.json").read_text())
    logits = dict(np.load(FIXTURES / "golden_logits.npz"))
    print("| variant | golden exact (float32) | top-1 vs PyTorch (stored dtype) | size (MB) | bits/weight |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in variants:
            s = convert(FIXTURE_MODEL, Path(tmp) / name, progress=False, **VARIANTS[name])
            agree, total = top1(s.path, logits)
            print(f"| {name} | {golden_exact(s.path, cases)}/{len(cases)} | {agree}/{total} "
                  f"| {s.bytes_after / 1e6:.2f} | {s.bits_per_weight:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
