"""``python -m refusion_mlx.bench --shape NAME``: ReFusion's forwards at a real
model's shape, against mlx-lm's autoregressive decoding of the same weights.

The bundled demo model is tiny, so its timings say little about a real
checkpoint. This mode

1. decodes the first ``--prompts`` prompts of the bench suite with the demo
   model and records every forward (``forward_replay.RecordingModel``):
   tokens fed, where they write, the K/V rows attended, head rows, phase;
2. builds a model of the named shape (Qwen3 0.6B/1.7B/4B or ReFusion 8B,
   ReFusion's vocabulary) with random weights, optionally quantized;
3. replays the recorded forwards on it (same token counts, cache lengths,
   head rows, the LM head in the decoder's chunks) and times mlx-lm's
   ``generate_step`` on the very same arrays for the same number of tokens
   per prompt (random prompt ids of the recorded prompts' lengths);
4. counts weight bytes and FLOPs per generated token on both sides and
   forecasts tokens/s on Apple chips from them: a roofline *model*, not a
   measurement.

The replay times the model alone (no drafting, scoring or host bookkeeping:
``bench.overhead`` measures that factor). ``--repeat`` and ``--warmup`` do
not apply: each side runs once after a short warm-up.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..decode.forward import head_chunk_rows
from ..models import backend
from .forward_replay import ForwardShape, RecordingModel, count_by_phase, prepare, replay
from .kv_memory import format_kv_memory, kv_memory
from .report import device_description, format_table
from .suite import BenchError, Suite

REFUSION_VOCAB = 151_671
QUANT_GROUP = 64

# Qwen3 configs (Hugging Face Qwen/Qwen3-*/config.json); ReFusion 8B is the
# Qwen3-8B shape with untied embeddings. All: head_dim 128, 8 KV heads.
SHAPES: Dict[str, Dict[str, Any]] = {
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       intermediate_size=3072, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                       intermediate_size=6144, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                     intermediate_size=9728, tie_word_embeddings=True),
    "refusion-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                        intermediate_size=12288, tie_word_embeddings=False),
}
# not listed in --help: a shape small enough for the tests
HIDDEN_SHAPES: Dict[str, Dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128, vocab_size=4096, tie_word_embeddings=True),
}


@dataclass(frozen=True)
class Chip:
    name: str
    bandwidth_gb_s: float
    fp16_tflops: float


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
    Chip("M3 Pro (18-core GPU)", 150.0, 2 * 7.4),
    Chip("M4 Pro (20-core GPU)", 273.0, 2 * 9.2),
    Chip("M4 Max (40-core GPU)", 546.0, 2 * 18.4),
    Chip("M3 Ultra (80-core GPU)", 819.0, 2 * 28.2),
)


def shape_names() -> List[str]:
    return list(SHAPES)


def check_shape(name: str) -> None:
    if name not in SHAPES and name not in HIDDEN_SHAPES:
        raise BenchError(f"unknown --shape {name!r}; known: {', '.join(SHAPES)}")


def shape_config(name: str) -> Dict[str, Any]:
    check_shape(name)
    base = dict(model_type="qwen3", num_key_value_heads=8, head_dim=128, vocab_size=REFUSION_VOCAB,
                rms_norm_eps=1e-6, max_position_embeddings=40960, rope_theta=1_000_000.0)
    return {**base, **(SHAPES.get(name) or HIDDEN_SHAPES[name])}


# --------------------------------------------------------------------------
# Recording


@dataclass
class Recorded:
    """The forwards of each prompt's decode and the tokens it generated."""

    prompt_tokens: List[int]
    generated: List[int]
    forwards: List[List[ForwardShape]]

    @property
    def shapes(self) -> List[ForwardShape]:
        return [s for f in self.forwards for s in f]


def record(suite: Suite, params, log=None, model_path: Optional[str] = None) -> Recorded:
    """Decode each case with the demo model (or ``model_path``'s), recording its forwards."""
    from ..decode.decoder import RefusionDecoder
    from ..decode.stream import chat_prompt
    from ..models.loading import load

    model, tokenizer = load(model_path)
    out = Recorded([], [], [])
    for case, p in zip(suite.cases, params):
        ids = chat_prompt(tokenizer, case.prompt, system=case.system)
        rec = RecordingModel(model)
        dec = RefusionDecoder(rec, ids, p, mask_id=model.args.mask_token_id, eos_id=tokenizer.eos_token_id)
        for _ in dec.steps():
            pass
        shapes = rec.shapes()
        if len(shapes) != dec.stats.forwards:
            raise BenchError(f"recorded {len(shapes)} forwards, the decoder counted {dec.stats.forwards}")
        out.prompt_tokens.append(len(ids))
        out.generated.append(max(dec.stats.generated_tokens, 1))
        out.forwards.append(shapes)
        if log:
            log(f"recorded {case.prompt[:40]!r}: {len(ids)} prompt tokens, {dec.stats.generated_tokens} "
                f"generated in {len(shapes)} forwards")
    return out


# --------------------------------------------------------------------------
# The model of the shape, and mlx-lm's on the same arrays


def build_models(name: str, dtype: str = "float32", q_bits: Optional[int] = None, ar: bool = True):
    """(our model, mlx-lm's model sharing its arrays or None), random weights;
    both chosen by the shape's ``model_type`` (``models.registry``, mlx-lm's module of that name)."""
    import importlib

    from ..models import registry
    from ..models.fused import fuse_projections
    from .runs import share_weights

    config = shape_config(name)
    mx.random.seed(0)
    model = registry.build(registry.model_args(config))
    model.set_dtype(getattr(mx, dtype))
    model.eval()
    mx.eval(model.parameters())
    if q_bits:
        nn.quantize(model, group_size=QUANT_GROUP, bits=q_bits)
        mx.eval(model.parameters())
    fuse_projections(model)
    if not ar:
        return model, None
    ar_family = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    ar_model = ar_family.Model(ar_family.ModelArgs.from_dict(config))
    if q_bits:
        nn.quantize(ar_model, group_size=QUANT_GROUP, bits=q_bits)
    share_weights(ar_model, model)  # mlx-lm's own random arrays are never evaluated
    return model, ar_model


@dataclass
class Costs:
    """What one forward reads and computes, from the model's arrays and shape."""

    body_bytes: int  # every weight but the embedding table and the LM head
    head_bytes: int  # the LM head's weight (the embedding table when tied)
    body_params: int
    head_params: int
    layers: int
    heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, model) -> "Costs":
        a = model.args
        flat = tree_flatten(model.parameters())
        head_key = "model.embed_tokens." if a.tie_word_embeddings else "lm_head."
        head_bytes = sum(v.nbytes for k, v in flat if k.startswith(head_key))
        body_bytes = sum(v.nbytes for k, v in flat if not k.startswith(("model.embed_tokens.", "lm_head.")))
        d, hd = a.hidden_size, a.head_dim
        per_layer = (2 * d * a.num_attention_heads * hd + 2 * d * a.num_key_value_heads * hd
                     + 3 * d * a.intermediate_size)
        return cls(body_bytes, head_bytes, per_layer * a.num_hidden_layers, d * a.vocab_size,
                   a.num_hidden_layers, a.num_attention_heads, hd, a.vocab_size)

    @property
    def per_chunk(self) -> int:
        """Head rows per chunk: the decoder's rule on the paths in force
        (``decode.forward.head_chunk_rows``; on the GPU paths every step's rows)."""
        return head_chunk_rows(self.vocab)

    def head_reads(self, head_rows: int) -> int:
        return math.ceil(head_rows / self.per_chunk) if head_rows else 0

    def forward(self, tokens: int, visible: int, head_rows: int) -> tuple:
        """(weight bytes read, FLOPs) of one forward."""
        reads = self.head_reads(head_rows)
        flops = (2 * self.body_params * tokens + 2 * self.head_params * head_rows
                 + 4 * self.layers * self.heads * self.head_dim * tokens * visible)
        return self.body_bytes + reads * self.head_bytes, flops


def refusion_forwards(rec: Recorded) -> List[tuple]:
    """(tokens, visible, head rows) of every recorded forward."""
    return [(s.tokens, s.visible, s.head_rows) for s in rec.shapes]


def ar_forwards(rec: Recorded) -> List[tuple]:
    """AR decoding of the same prompts and token counts: the prompt in one
    forward (head on its last row), then one token per forward."""
    out = []
    for p, n in zip(rec.prompt_tokens, rec.generated):
        out.append((p, p, 1))
        out += [(1, p + j, 1) for j in range(1, n)]
    return out


def totals(costs: Costs, forwards: Sequence[tuple]) -> tuple:
    per = [costs.forward(*f) for f in forwards]
    return sum(b for b, _ in per), sum(f for _, f in per), per


def forecast(per_forward: Sequence[tuple], tokens: int, chip: Chip) -> float:
    """Tokens/s if every forward took max(bytes / bandwidth, FLOPs / throughput)."""
    seconds = sum(max(b / (chip.bandwidth_gb_s * 1e9), f / (chip.fp16_tflops * 1e12)) for b, f in per_forward)
    return tokens / seconds if seconds > 0 else 0.0


# --------------------------------------------------------------------------
# Timing


def time_refusion(model, rec: Recorded, head_chunk: int, storage=None) -> List[float]:
    prepared = prepare(model, rec.shapes, storage=storage)
    warm = type(prepared)(prepared.shapes[:2], prepared.inputs[:2], prepared.cache)
    replay(model, warm, head_chunk=head_chunk)
    return replay(model, prepared, head_chunk=head_chunk)


def time_ar(ar_model, rec: Recorded, seed: int = 0) -> List[float]:
    """Wall seconds of mlx-lm's generate_step per prompt, to its last token
    (its look-ahead step drained outside the clock, as in runs.run_ar)."""
    from mlx_lm.generate import generate_step, generation_stream

    rng = np.random.default_rng(seed)
    vocab = ar_model.args.vocab_size
    prompts = [mx.array(rng.integers(0, vocab, (p,)), dtype=mx.int32) for p in rec.prompt_tokens]
    for _ in generate_step(prompts[0], ar_model, max_tokens=2):  # warm-up
        pass
    mx.synchronize(generation_stream)
    walls = []
    for ids, n in zip(prompts, rec.generated):
        got = 0
        mx.synchronize()
        t0 = time.perf_counter()
        for _ in generate_step(ids, ar_model, max_tokens=n):
            got += 1
        walls.append(time.perf_counter() - t0)
        mx.synchronize(generation_stream)
        if got != n:
            raise BenchError(f"mlx-lm generated {got} tokens, expected {n}")
    return walls


# --------------------------------------------------------------------------
# The mode


def run_shape(name: str, suite: Suite, params, dtype: str = "float32", q_bits: Optional[int] = None,
              ar: bool = True, log=None, record_model: Optional[str] = None, kv: Optional[dict] = None) -> dict:
    from .runs import storage_of

    say = log or (lambda _m: None)
    rec = record(suite, params, log, record_model)
    say(f"building {name} ({dtype}{f', {q_bits}-bit' if q_bits else ''}) with random weights")
    model, ar_model = build_models(name, dtype, q_bits, ar)
    costs = Costs.of(model)
    shapes = rec.shapes
    seconds = time_refusion(model, rec, costs.per_chunk, storage_of(kv, model))
    say(f"replayed {len(seconds)} forwards in {sum(seconds):.2f} s")
    ar_walls = time_ar(ar_model, rec) if ar else []
    if ar:
        say(f"mlx-lm: {sum(rec.generated)} tokens in {sum(ar_walls):.2f} s")
    tokens = sum(rec.generated)
    rf_bytes, rf_flops, rf_per = totals(costs, refusion_forwards(rec))
    ar_fw = ar_forwards(rec)
    ar_bytes, ar_flops, ar_per = totals(costs, ar_fw)
    reads = [costs.head_reads(s.head_rows) for s in shapes if s.head_rows]
    rf_tok_s = tokens / sum(seconds)
    ar_tok_s = tokens / sum(ar_walls) if ar else None
    rows = []
    for chip in CHIPS:
        r, a = forecast(rf_per, tokens, chip), forecast(ar_per, tokens, chip)
        rows.append({"chip": chip.name, "bandwidth_gb_s": chip.bandwidth_gb_s, "fp16_tflops": chip.fp16_tflops,
                     "refusion_tok_s": round(r, 1), "ar_tok_s": round(a, 1), "ratio": round(r / a, 3)})
    n_params = costs.body_params + costs.head_params * (1 if model.args.tie_word_embeddings else 2)
    return {
        "shape": name, "recorded_with": record_model or "bundled demo model", "config": shape_config(name),
        "parameters": n_params, "dtype": dtype, "q_bits": q_bits,
        "device": device_description(), "paths": f"{backend.paths()} ({backend.mode()})",
        "prompts": len(rec.generated), "prompt_tokens": rec.prompt_tokens, "generated_tokens": rec.generated,
        "forwards": len(shapes), "replayed_forwards": len(seconds),
        "forwards_per_phase": count_by_phase(shapes), "ar_forwards": len(ar_fw),
        "refusion_seconds": round(sum(seconds), 6), "ar_seconds": round(sum(ar_walls), 6) if ar else None,
        "refusion_tok_s": round(rf_tok_s, 3), "ar_tok_s": None if ar_tok_s is None else round(ar_tok_s, 3),
        "ratio": None if not ar_tok_s else round(rf_tok_s / ar_tok_s, 4),
        "tokens_per_forward": round(tokens / len(shapes), 4),
        "head_rows_per_chunk": costs.per_chunk,
        "head_reads_per_step": round(sum(reads) / max(len(reads), 1), 4),
        "head_reads_per_step_max": max(reads, default=0),
        "weight_bytes": {"body": costs.body_bytes, "head": costs.head_bytes},
        "weight_bytes_per_token": {"refusion": round(rf_bytes / tokens), "ar": round(ar_bytes / tokens)},
        "flops_per_token": {"refusion": round(rf_flops / tokens), "ar": round(ar_flops / tokens)},
        "forecast": rows, "kv_memory": kv_memory(shape_config(name), dtype, **(kv or {})),
        "forecast_note": "a roofline model, not a measurement: each forward costs max(weight bytes / "
                         "bandwidth, FLOPs / fp16 throughput); KV reads, kernel launches and the decoder's "
                         "host work are left out",
    }


def format_shape_report(r: dict) -> str:
    c = r["config"]
    quant = f", {r['q_bits']}-bit weights" if r["q_bits"] else ""
    lines = [f"shape {r['shape']}: hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
             f"{c['num_attention_heads']}/{c['num_key_value_heads']} heads, vocab {c['vocab_size']}; "
             f"{r['parameters'] / 1e6:.0f}M parameters, random weights, {r['dtype']}{quant}",
             f"device: {r['device']}; paths: {r['paths']}",
             f"forwards recorded with the {r['recorded_with']}: {r['prompts']} prompts, {sum(r['generated_tokens'])} "
             f"tokens in {r['forwards']} forwards (replayed: {r['replayed_forwards']}); LM head "
             f"{r['head_rows_per_chunk']} rows per chunk, {r['head_reads_per_step']} reads per step "
             f"(max {r['head_reads_per_step_max']})", ""]
    wb, fl = r["weight_bytes_per_token"], r["flops_per_token"]
    measured = [["ReFusion (replayed forwards)", r["refusion_seconds"], r["refusion_tok_s"],
                 r["tokens_per_forward"], wb["refusion"] / 1e6, fl["refusion"] / 1e9]]
    if r["ar_tok_s"] is not None:
        ar_tpf = sum(r["generated_tokens"]) / r["ar_forwards"]
        measured.append(["AR (mlx-lm generate_step)", r["ar_seconds"], r["ar_tok_s"], round(ar_tpf, 4),
                         wb["ar"] / 1e6, fl["ar"] / 1e9])
    lines.append(format_table(["measured here", "seconds", "tok/s", "tok/forward", "weight MB/tok",
                               "GFLOP/tok"], measured))
    if r["ratio"] is not None:
        lines.append(f"ReFusion / AR: {r['ratio']:.3f}x")
    lines += ["", "forecast (a roofline MODEL, not a measurement: per forward max(bytes / bandwidth, "
                  "FLOPs / fp16 TFLOP/s))",
              format_table(["chip", "GB/s", "fp16 TFLOP/s", "ReFusion tok/s", "AR tok/s", "ratio"],
                           [[f["chip"], f["bandwidth_gb_s"], f["fp16_tflops"], f["refusion_tok_s"],
                             f["ar_tok_s"], f"{f['ratio']:.2f}x"] for f in r["forecast"]])]
    return "\n".join(lines + ["", format_kv_memory(r["kv_memory"])])
