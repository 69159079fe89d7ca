"""The forecast of ``bench --shape``: what a profile's forwards (``profiles``)
would cost on Apple chips, from what the shape decides (weight bytes and
FLOPs of a forward of each width: ``shapes.Costs``).

Each forward is priced at max(weight bytes / bandwidth, FLOPs / fp16
throughput): a roofline, with no per-forward launch or dispatch time, no KV
reads and no host work, so every tokens/s it gives is a *ceiling*, and its
ReFusion / AR ratio holds only if ReFusion's wide forwards run as close to
the chip's limits as AR's one-token forwards. They did not on an H100 (the
numbers in :data:`MEASURED_ON_H100`), so the ratio is printed as a ceiling
with that evidence beside it. ReFusion / AR can never exceed the tokens per
forward: a forward of several tokens reads the weights at least once and
computes more.

The weight bytes of a forward are what MLX's Metal kernels read, not one
pass over the weights whatever the width (:func:`weight_reads`, from
``mlx/backend/metal/matmul.cpp`` and ``quantized.cpp``): a forward of a
few rows on an M3 or later streams each matrix once per tile of at most 5
rows (``gemv_wide``, ``qmv_wide``) below the width where a GEMM takes
over, 16 rows for bf16/fp16 and a per-chip, per-shape limit of 6-33 rows
for quantized weights; on M1 and M2 a quantized matrix is streamed once
per row below its limit. float32 weights are streamed once at any width:
``gemv_wide`` serves float16 and bfloat16 only (``gemv_wide_config``), so
float32 takes ``gemv`` for one row and the steel GEMM (split-K where the
output is small) from two, whose 16-row or wider tiles hold a pass of up
to 15 rows in one tile row.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from .report import format_parameters, format_table


@dataclass(frozen=True)
class Chip:
    name: str
    bandwidth_gb_s: float
    fp16_tflops: float
    gen: int = 16  # Apple GPU family (M1 13, M2 14, M3 15, M4 16, M5 17): MLX's Metal kernels dispatch on it
    ultra: bool = False  # two dies (MLX: an architecture name ending in 'd')


# Memory bandwidth: Apple's published specifications (apple.com/macbook-pro/specs,
# apple.com/mac-studio/specs; newsroom releases of Oct 2023, Oct 2024, Mar 2025):
# M3 Pro 150 GB/s, M4 Pro 273 GB/s, M4 Max (16-core CPU / 40-core GPU) 546 GB/s,
# M3 Ultra 819 GB/s. Apple publishes no TFLOP/s: the commonly cited GPU FP32
# figures (cores x 128 ALUs x 2 FLOPs x clock; en.wikipedia.org "Apple M3" and
# "Apple M4" GPU tables): M3 Pro 18-core ~7.4, M4 Pro 20-core ~9.2, M4 Max
# 40-core ~18.4, M3 Ultra 80-core ~28.2 (sources differ by up to ~20% on the
# clock assumed), here taken x2 for fp16 matrix work (an assumption, and an
# optimistic one: it only matters where a forward is compute bound).
CHIPS = (
    Chip("M3 Pro (18-core GPU)", 150.0, 2 * 7.4, 15),
    Chip("M4 Pro (20-core GPU)", 273.0, 2 * 9.2, 16),
    Chip("M4 Max (40-core GPU)", 546.0, 2 * 18.4, 16),
    Chip("M3 Ultra (80-core GPU)", 819.0, 2 * 28.2, 15, ultra=True),
)
REFERENCE_CHIP = CHIPS[2]  # whose weight bytes the report's bandwidth-bound ratio uses


def qmv_row_limit(k: int, n: int, chip: Chip) -> int:
    """Rows from which MLX's Metal quantized matmul of a (k in, n out)
    matrix takes its split-K GEMM (one pass over the weights) rather than
    its mat-vec kernels (``get_qmv_batch_limit``, mlx/backend/metal/quantized.cpp)."""
    small, mid = k <= 2048 and n <= 2048, k <= 4096 and n <= 4096
    if chip.gen >= 17 and not chip.ultra:
        return 33 if small else 25 if mid else 13
    if chip.gen >= 15 and not chip.ultra:
        return 13 if small else 15 if mid else 13
    if chip.ultra:
        return 32 if small else 18 if mid else 12
    return 14 if small else 10 if mid else 6


def weight_reads(rows: int, k: int, n: int, q_bits: Optional[int], chip: Chip, dtype: str = "bfloat16") -> int:
    """How many times MLX's Metal kernels stream a (k, n) weight matrix for
    ``rows`` input rows. bf16/fp16: one row ``gemv``; 2-15 rows on an M3 or
    later ``gemv_wide``, one pass per tile of at most 5 rows; else a GEMM,
    one pass. float32 (``dtype``, not quantized): ``gemv`` or a GEMM, one
    pass (``gemv_wide`` takes float16 and bfloat16 only). Quantized
    (affine, any ``dtype``): from :func:`qmv_row_limit` rows a split-K
    GEMM, one pass; below it ``qmv_wide`` on an M3 or later (a pass per 5
    rows), ``qmv`` on M1/M2 (a pass per row)."""
    if rows <= 1:
        return 1 if rows == 1 else 0
    if not q_bits:
        wide = chip.gen >= 15 and rows <= 15 and dtype in ("bfloat16", "float16")
        return -(-rows // 5) if wide else 1
    if rows >= qmv_row_limit(k, n, chip):
        return 1
    return -(-rows // 5) if chip.gen >= 15 else rows

# What this roofline printed against what the same forwards measured on one
# NVIDIA H100 with MLX's CUDA backend, refusion-8b, random weights
# (docs/benchmarks.md, "On a CUDA GPU"): (weights, recorded with, tokens per
# forward, measured ReFusion / AR, forecast ratio printed for the M4 Max).
MEASURED_ON_H100 = (
    ("bfloat16", "the demo model", 6.81, 1.68, 6.81),
    ("4-bit", "the demo model", 6.81, 1.32, 6.24),
    ("4-bit", "the test fixture model", 5.33, 0.77, 4.97),
)


class OnAppleGPU:
    """``Costs`` as Apple GPUs pay them: the GPU paths run the LM head over a
    step's rows in one call (``decode.forward.head_chunk_rows``), whatever
    paths this process runs, and each matrix is streamed as often as MLX's
    Metal kernels stream it for the forward's width (:func:`weight_reads`;
    ``q_bits``: the weights' quantization, ``dtype`` their float type).
    Without a chip: one pass."""

    def __init__(self, costs, q_bits: Optional[int] = None, dtype: str = "bfloat16"):
        self.costs, self.q_bits, self.dtype = costs, q_bits, dtype

    def forward(self, tokens: int, visible: int, head_rows: int, chip: Optional[Chip] = None) -> tuple:
        c = self.costs
        b, f = c.forward(tokens, visible, head_rows)
        extra = c.head_reads(head_rows) - (1 if head_rows else 0)
        b -= extra * c.head_bytes
        if chip is None:
            return b, f
        per_param = c.body_bytes / c.body_params
        for k, n, params in c.matrices:
            b += (weight_reads(tokens, k, n, self.q_bits, chip, self.dtype) - 1) * params * per_param
        if head_rows:
            b += (weight_reads(head_rows, c.hidden, c.vocab, self.q_bits, chip, self.dtype) - 1) * c.head_bytes
        return b, f


def seconds(costs, forwards: Sequence[tuple], chip: Chip) -> float:
    """Roofline seconds of ``forwards`` ((tokens, visible, head rows) each):
    every forward max(bytes / bandwidth, FLOPs / throughput)."""
    total = 0.0
    for f in forwards:
        b, fl = costs.forward(*f, chip=chip)
        total += max(b / (chip.bandwidth_gb_s * 1e9), fl / (chip.fp16_tflops * 1e12))
    return total


def tok_s(costs, forwards: Sequence[tuple], tokens: int, chip: Chip) -> float:
    """Tokens/s if every forward ran at ``chip``'s roofline (a ceiling)."""
    s = seconds(costs, forwards, chip)
    return tokens / s if s > 0 else 0.0


def bytes_and_flops(costs, forwards: Sequence[tuple], chip: Optional[Chip] = None) -> tuple:
    per = [costs.forward(*f, chip=chip) for f in forwards]
    return sum(b for b, _ in per), sum(f for _, f in per)


def price(costs, forwards: Sequence[tuple], ar: Sequence[tuple], tokens: int,
          chips: Sequence[Chip] = CHIPS, q_bits: Optional[int] = None, dtype: str = "bfloat16") -> dict:
    """A profile's forecast against AR's forwards for the same tokens: per chip
    the two ceilings and their ratio; the bandwidth-bound ratio (AR's weight
    bytes per token over ReFusion's on :data:`REFERENCE_CHIP`: what it gives
    when no forward is compute bound); bytes and FLOPs per token there.
    Priced as on Apple GPUs (:class:`OnAppleGPU`, ``q_bits`` and ``dtype``: the weights')."""
    costs = OnAppleGPU(costs, q_bits, dtype)
    rf_bytes, rf_flops = bytes_and_flops(costs, forwards, REFERENCE_CHIP)
    ar_bytes, ar_flops = bytes_and_flops(costs, ar, REFERENCE_CHIP)
    rows = []
    for chip in chips:
        r, a = tok_s(costs, forwards, tokens, chip), tok_s(costs, ar, tokens, chip)
        rows.append({"chip": chip.name, "bandwidth_gb_s": chip.bandwidth_gb_s, "fp16_tflops": chip.fp16_tflops,
                     "refusion_tok_s": round(r, 1), "ar_tok_s": round(a, 1), "ratio": round(r / a, 3)})
    return {"forecast": rows, "bandwidth_bound_ratio": round(ar_bytes / rf_bytes, 3),
            "weight_bytes_per_token": {"refusion": round(rf_bytes / tokens), "ar": round(ar_bytes / tokens)},
            "flops_per_token": {"refusion": round(rf_flops / tokens), "ar": round(ar_flops / tokens)}}


NOTE = ("a roofline model, not a measurement: each forward costs max(weight bytes / bandwidth, FLOPs / fp16 "
        "throughput); kernel launches, KV reads and the decoder's host work are left out, so every tok/s is a "
        "ceiling and the ratio holds only if ReFusion's wide forwards run as close to the chip's limits as AR's "
        "one-token forwards (on an H100 they did not: see h100 in this report)")


def _speed(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def row_label(p: dict) -> str:
    if p["source"] == "derived":
        return f"ReFusion at {p['target']:g} tok/forward [a]"
    if p["recorded_with"] == "bundled demo model":
        return "the demo model's own, not real [b]"
    return "recorded with your model [b]"


def _span(values: List[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}x" if round(lo, 2) == round(hi, 2) else f"{lo:.2f}-{hi:.2f}x"


def derived_or_all(profiles: List[dict]) -> List[dict]:
    return [p for p in profiles if p["source"] == "derived"] or profiles


def _note(text: str) -> List[str]:
    return textwrap.wrap(text, width=110, subsequent_indent="    ")


def format_forecast(r: dict) -> str:
    """The forecast section: one row per profile, a column per chip (the
    recorded profile apart, below a rule), then the footnotes that say what
    each row rests on."""
    profiles = r["profiles"]
    chips = [row["chip"] for row in profiles[0]["forecast"]]
    ar_row = ["AR (mlx-lm), 1 token a forward", "1.00", r["ar_forwards"], "1.0"]
    ar_row += [_speed(row["ar_tok_s"]) for row in profiles[0]["forecast"]]
    rows = [ar_row]
    for p in profiles:
        cells = [row_label(p), f"{p['tokens_per_forward']:.2f}", p["forwards"], f"{p['tokens_fed_per_forward']:.1f}"]
        cells += [f"{_speed(row['refusion_tok_s'])} ({row['ratio']:.2f}x)" for row in p["forecast"]]
        rows.append(cells)
    table = format_table(["profile", "tok/fwd", "forwards", "fed/fwd"] + [c.split(" (")[0] for c in chips],
                         rows).split("\n")
    recorded = [p for p in profiles if p["source"] == "recorded"]
    if recorded and len(recorded) < len(profiles):  # the recorded profile apart from the derived ones
        table.insert(len(table) - len(recorded), table[1])
    lines = ["forecast for Apple GPUs, AT MOST: tokens/s ceilings, ReFusion / AR in brackets "
             "(a roofline model, not a measurement [c], of MLX's Metal kernels [d])"] + table
    tpf = [p["tokens_per_forward"] for p in derived_or_all(profiles)]
    lines += _note(f"ReFusion beats AR only while one of its forwards costs less than tok/fwd times one of AR's "
                   f"({_span(tpf)} here); on an H100 they cost "
                   f"{', '.join(f'{t / m:.1f}x' for _, _, t, m, _ in MEASURED_ON_H100)} one of AR's [c].")
    derived = [p for p in profiles if p["source"] == "derived"]
    if derived:
        s = r["settings"]
        lines += _note(
            f"[a] derived, not recorded: the same {r['prompts']} prompts and {sum(r['generated_tokens'])} tokens "
            f"decoded by the decoder's rules at {s['slot_size']}-token slots in blocks of {s['block_length']}: "
            "each round a plan pass as wide as the block's masked slots (the first with the prompt) and a "
            "verify as wide as the slots drafted; below slot/2 tokens per forward one slot a round, and infill "
            "rounds (draft + verify, as wide as the unfinished slots) after some verifies; the slots a round and "
            "the infill rounds set to reach the row's tokens per forward (docs/benchmarks.md). "
            f"{', '.join(f'{t:g}' for t in r['tokens_per_forward_range'])}: "
            + ("asked for with --tokens-per-forward. " if len(r["tokens_per_forward_range"]) == 1 else
               "where real checkpoints are reported (the paper's 2.33x over Qwen3-8B on an A100 needs at "
               "least 2.33 tokens per forward). ")
            + "Measure your checkpoint's own with --record-with PATH.")
    if r["out_of_reach"]:
        lines += _note(f"    left out, out of reach at these settings: "
                       f"{', '.join(f'{t:g}' for t in r['out_of_reach'])} tokens per forward")
    for p in recorded:
        if p["recorded_with"] == "bundled demo model":
            lines += _note(
                f"[b] the bundled demo model's recorded forwards ({p['tokens_per_forward']:.2f} tokens per "
                f"forward): a {format_parameters(r['recorded_parameters'])}-parameter model certain of its "
                "synthetic answers. No real checkpoint is known to reach this: the row is the demo's, to set beside the measurement, not a forecast for a "
                "real model.")
        else:
            lines += _note(
                f"[b] the forwards {p['recorded_with']} made on these prompts at these settings: its own "
                f"confidence, measured ({p['tokens_per_forward']:.2f} tokens per forward).")
    h = "; ".join(f"{w}, {who}'s forwards ({t:.2f} tok/fwd): {m:.2f}x measured, {f:.2f}x forecast"
                  for w, who, t, m, f in MEASURED_ON_H100)
    lines += _note(
        "[c] each forward priced at max(weight bytes / bandwidth, FLOPs / fp16 TFLOP/s) at "
        f"{', '.join(f'{c.bandwidth_gb_s:g}' for c in _chips(chips))} GB/s, the LM head read once a step; no "
        "kernel launch, KV read or host time, so each tok/s is a ceiling, and the ratio holds only if "
        "ReFusion's wide forwards run as close to the chip's limits as AR's one-token ones (it can never "
        "exceed the tokens per forward). On an H100 (MLX's CUDA backend, refusion-8b) they did not: "
        f"{h} (docs/benchmarks.md).")
    lines += _note(kernel_note(r["config"], r.get("q_bits"), _chips(chips), r.get("dtype", "bfloat16")))
    return "\n".join(lines)


# The MLX whose Metal kernels :func:`weight_reads` and :func:`qmv_row_limit` follow (mlx/backend/metal:
# matmul.cpp, quantized.cpp): gemv_wide is new in 0.32.1, qmv_wide in 0.32.0; another MLX may stream otherwise.
KERNELS_OF = "MLX 0.32.1"
STREAMED = f"streamed as {KERNELS_OF}'s Metal kernels stream them (gemv_wide is new in 0.32.1, qmv_wide in 0.32.0)"


def kernel_note(config: dict, q_bits: Optional[int], chips: Sequence[Chip], dtype: str = "bfloat16") -> str:
    """Footnote [d]: the weights' form and the widths at which the forecast
    has MLX's Metal kernels stream each matrix more than once, and the MLX
    whose kernels those are (:data:`KERNELS_OF`)."""
    if not q_bits and dtype == "float32":
        return (f"[d] float32 weights, {STREAMED}: once at every width (gemv for 1 row, a GEMM from 2: "
                "gemv_wide, which re-reads the weights every 5 rows, takes float16 and bfloat16 only).")
    if not q_bits:
        return (f"[d] {dtype} weights, {STREAMED}: a 1-row forward once (gemv), 2-15 rows once per 5 rows on M3 "
                "and later (gemv_wide: 2 passes from 6 rows, 3 from 11; M1/M2 take a GEMM), 16 rows and more once "
                "(GEMM).")
    d, hd = config["hidden_size"], config["head_dim"]
    H, K, inter = config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]
    mats = (("qkv", d, (H + 2 * K) * hd), ("o", H * hd, d), ("gate_up", d, 2 * inter), ("down", inter, d),
            ("head", d, config["vocab_size"]))
    limits = "; ".join(f"{c.name.split(' (')[0]} " + ", ".join(f"{m} {qmv_row_limit(k, n, c)}" for m, k, n in mats)
                       for c in chips)
    return (f"[d] {q_bits}-bit weights (group size 64, {dtype} activations), {STREAMED}: below a matrix's GEMM "
            "row limit once per 5 rows on M3 and later (qmv_wide; once per row on M1/M2), from it once (split-K "
            f"GEMM); the limits at this shape, in rows: {limits}.")


def _chips(names: List[str]) -> List[Chip]:
    by_name: Dict[str, Chip] = {c.name: c for c in CHIPS}
    return [by_name[n] for n in names if n in by_name]


def gap(measured_ratio: Optional[float], forecast_ratio: float) -> Optional[float]:
    """Measured over forecast ReFusion / AR (1: the model held)."""
    if not measured_ratio or not forecast_ratio:
        return None
    return round(measured_ratio / forecast_ratio, 3)
