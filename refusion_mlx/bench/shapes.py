"""``python -m refusion_mlx.bench --shape NAME``: ReFusion's forwards at a real
model's shape, against mlx-lm's autoregressive decoding of the same weights,
and a forecast of both for Apple chips.

What the shape decides (weight bytes and FLOPs of a forward of each width:
:class:`Costs`) is kept apart from what the model's confidence decides (how
many tokens a forward commits, how wide the passes are: ``profiles``). The
bundled demo model is tiny and very sure of its synthetic answers, so its
forwards say little about a real checkpoint's. This mode

1. decodes the first ``--prompts`` prompts of the bench suite with the demo
   model, or the model folder of ``--record-with``, and records every forward
   (``forward_replay.RecordingModel``): tokens fed, where they write, the K/V
   rows attended, head rows, phase;
2. derives profiles of the same prompts and token counts at the tokens per
   forward real checkpoints reach, or at ``--tokens-per-forward``
   (``profiles.derive``);
3. builds a model of the named shape (Qwen3 0.6B/1.7B/4B or ReFusion 8B,
   ReFusion's vocabulary) with random weights, optionally quantized;
4. prices every profile, and AR decoding of the same tokens, on Apple chips
   (``forecast``): a roofline *model* whose tokens/s are ceilings;
5. replays the recorded forwards bare on the model (on a GPU every derived
   profile's too: same token counts, cache lengths, masks, head rows, the LM
   head in the decoder's chunks) and times mlx-lm's ``generate_step`` on the
   very same arrays for the same number of tokens per prompt (random prompt
   ids of the recorded prompts' lengths). On a GPU the measurement comes
   first and the forecast beside it, with the gap between them.

The replay times the model alone (no drafting, scoring or host bookkeeping:
``benchmarks.overhead`` measures that factor). ``--repeat`` and ``--warmup`` do
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

from .. import _blas
from ..decode.forward import head_chunk_rows
from ..models import backend, cpu_paths
from .cost_curve import price as curve_price
from .forecast import MEASURED_ON_H100, NOTE, gap, price
from .forward_replay import ForwardShape, RecordingModel, count_by_phase, time_batched, time_refusion
from .kv_memory import kv_memory
from .profiles import DEFAULT_TOKENS_PER_FORWARD, Profile, derive, derived_range, requests
from .report import device_description
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
    parameters: int = 0  # the recording model's (report.logical_parameters)

    @property
    def shapes(self) -> List[ForwardShape]:
        return [s for f in self.forwards for s in f]


def record(suite: Suite, params, log=None, model_path: Optional[str] = None) -> Recorded:
    """Decode each case with the demo model (or ``model_path``'s), recording its forwards."""
    from ..decode.decoder import RefusionDecoder
    from ..decode.stream import chat_prompt
    from ..models.loading import load

    from .report import logical_parameters

    model, tokenizer = load(model_path)
    out = Recorded([], [], [], logical_parameters(model))
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


def build_models(name: str, dtype: str = "float32", q_bits: Optional[int] = None, ar: bool = True,
                 materialize: bool = True):
    """(our model, mlx-lm's model sharing its arrays or None), random weights;
    both chosen by the shape's ``model_type`` (``models.registry``, mlx-lm's module of that name).
    Quantized before its weights are computed, so an 8B shape never holds
    its float32 weights at once. ``materialize=False``: the weights stay
    lazy (never computed: their sizes are all ``Costs`` reads; :func:`compute`
    computes them later) and no mlx-lm model."""
    from ..models import registry

    config = shape_config(name)
    mx.random.seed(0)
    model = registry.build(registry.family_args(config))
    model.set_dtype(getattr(mx, dtype))
    model.eval()
    if q_bits:
        nn.quantize(model, group_size=QUANT_GROUP, bits=q_bits)
    if not materialize:
        return model, None
    return compute(model, name, q_bits, ar)


def compute(model, name: str, q_bits: Optional[int] = None, ar: bool = True):
    """Compute a lazy model's weights (its projections joined), and mlx-lm's
    twin on the same arrays when ``ar``: ``(model, ar_model or None)``."""
    import importlib

    from ..models.projections import join_projections, pad_quantized
    from .runs import share_weights

    join_projections(model)  # computes each joined group's weights
    pad_quantized(model)  # as loading does: narrow quantized passes padded where the kernels charge less
    flat = [v for _, v in tree_flatten(model.parameters())]
    for i in range(0, len(flat), 8):  # the rest, a few arrays at a time
        mx.eval(flat[i:i + 8])
    if backend.cpu_paths():  # as loading lays them out (mlx-lm's twin shares the arrays, as bench's does)
        _blas.fit_threads(model.args.hidden_size)  # for the BLAS threads its passes will run on
        cpu_paths.lay_out_linears(model)
    if not ar:
        return model, None
    config = shape_config(name)
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
    hidden: int = 0
    matrices: tuple = ()  # (in, out, parameters over all layers) of each matmul of a block, joined as run

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
        L, H, K, inter = a.num_hidden_layers, a.num_attention_heads, a.num_key_value_heads, a.intermediate_size
        shapes = ((d, (H + 2 * K) * hd), (H * hd, d), (d, 2 * inter), (inter, d))  # qkv, o, gate_up, down
        return cls(body_bytes, head_bytes, per_layer * L, d * a.vocab_size, L, H, hd, a.vocab_size, d,
                   tuple((k, n, k * n * L) for k, n in shapes))

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


def priced(shapes: Sequence[ForwardShape]) -> List[tuple]:
    """(tokens, visible, head rows) of every forward: what ``Costs.forward`` prices."""
    return [(s.tokens, s.visible, s.head_rows) for s in shapes]


def ar_forwards(rec: Recorded) -> List[tuple]:
    """AR decoding of the same prompts and token counts: the prompt in one
    forward (head on its last row), then one token per forward."""
    out = []
    for p, n in zip(rec.prompt_tokens, rec.generated):
        out.append((p, p, 1))
        out += [(1, p + j, 1) for j in range(1, n)]
    return out


# --------------------------------------------------------------------------
# Timing


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


def on_gpu() -> bool:
    """Whether MLX computes on a GPU here (Metal, or MLX's CUDA backend)."""
    return mx.default_device() == mx.gpu


def _measured(profile: Profile, seconds: float, ar_tok_s: Optional[float], forecast_ratio: float) -> dict:
    tok_s = profile.tokens / seconds
    ratio = round(tok_s / ar_tok_s, 4) if ar_tok_s else None
    return {"seconds": round(seconds, 6), "tok_s": round(tok_s, 3), "ratio": ratio,
            "forecast_ratio": forecast_ratio, "measured_over_forecast": gap(ratio, forecast_ratio)}


def run_shape(name: str, suite: Suite, params, dtype: str = "float32", q_bits: Optional[int] = None,
              ar: bool = True, log=None, record_model: Optional[str] = None,
              tokens_per_forward: Optional[float] = None, measure: bool = True,
              measure_profiles: Optional[bool] = None, show=None, kv: Optional[dict] = None,
              batch: int = 1, cost_curve=None) -> dict:
    """The --shape report. ``record_model``: the folder whose forwards are
    recorded (None: the demo model's); ``tokens_per_forward``: one derived
    profile instead of the default range; ``measure=False``: no timing (the
    weights are never computed); ``measure_profiles``: replay the derived
    profiles too (default: on a GPU); ``show(report)``: called with the
    report so far before timing on the CPU, where timing a large shape is slow;
    ``kv``: the KV cache's settings (``bits``, ``group_size``; None: float);
    ``batch``: above 1, each profile timed also as that many requests at
    once against the same one at a time (``forward_replay.time_batched``);
    ``cost_curve``: a device's measured ``cost_curve.CostCurve``, which
    prices every profile too."""
    from .runs import storage_of

    say = log or (lambda _m: None)
    rec = record(suite, params, log, record_model)
    reqs = requests(rec.prompt_tokens, rec.generated, params)
    wanted = [tokens_per_forward] if tokens_per_forward is not None else list(DEFAULT_TOKENS_PER_FORWARD)
    if tokens_per_forward is not None:
        derived, out_of_reach = [derive(reqs, tokens_per_forward)], []
    else:
        derived, out_of_reach = derived_range(reqs, wanted)
    tokens = sum(rec.generated)
    recorded = Profile("recorded", "recorded", rec.shapes, tokens)
    say(f"building {name} ({dtype}{f', {q_bits}-bit' if q_bits else ''}) with random weights")
    model, _ = build_models(name, dtype, q_bits, materialize=False)  # its weights' sizes, none computed yet
    costs = Costs.of(model)
    ar_fw = ar_forwards(rec)
    profiles = []
    for p in derived + [recorded]:
        d = p.describe()
        d["recorded_with"] = (record_model or "bundled demo model") if p.source == "recorded" else None
        d.update(price(costs, priced(p.forwards), ar_fw, tokens, q_bits=q_bits, dtype=dtype))
        d["measured"] = None
        if cost_curve is not None:
            d["from_curve"] = curve_price(cost_curve, p.forwards, rec.prompt_tokens, rec.generated, tokens)
        profiles.append(d)
    mine = profiles[-1]
    reads = [costs.head_reads(s.head_rows) for s in rec.shapes if s.head_rows]
    n_params = costs.body_params + costs.head_params * (1 if model.args.tie_word_embeddings else 2)
    layout = params[0].layout()
    result = {
        "shape": name, "recorded_with": record_model or "bundled demo model", "config": shape_config(name),
        "recorded_parameters": rec.parameters,
        "parameters": n_params, "dtype": dtype, "q_bits": q_bits,
        "device": device_description(), "paths": f"{backend.paths()} ({backend.mode()})",
        "measured_on": ("gpu" if on_gpu() else "cpu") if measure else None, "forecast_for": "Apple GPUs",
        "settings": {"gen_length": params[0].gen_length, "slot_size": params[0].slot_size,
                     "block_length": layout.block_lengths[0], "slot_threshold": params[0].slot_threshold,
                     "token_threshold": params[0].token_threshold},
        "prompts": len(rec.generated), "prompt_tokens": rec.prompt_tokens, "generated_tokens": rec.generated,
        "forwards": len(rec.shapes), "replayed_forwards": 0,
        "forwards_per_phase": count_by_phase(rec.shapes), "ar_forwards": len(ar_fw),
        "refusion_seconds": None, "ar_seconds": None, "refusion_tok_s": None, "ar_tok_s": None, "ratio": None,
        "tokens_per_forward": round(tokens / len(rec.shapes), 4),
        "tokens_per_forward_range": wanted, "out_of_reach": out_of_reach,
        "head_rows_per_chunk": costs.per_chunk,
        "head_reads_per_step": round(sum(reads) / max(len(reads), 1), 4),
        "head_reads_per_step_max": max(reads, default=0),
        "weight_bytes": {"body": costs.body_bytes, "head": costs.head_bytes},
        "flops_per_token_fed": 2 * costs.body_params, "flops_per_head_row": 2 * costs.head_params,
        "weight_bytes_per_token": mine["weight_bytes_per_token"], "flops_per_token": mine["flops_per_token"],
        "forecast": mine["forecast"], "forecast_note": NOTE, "profiles": profiles,
        "kv_memory": kv_memory(shape_config(name), dtype, **(kv or {})),
        "cost_curve": None if cost_curve is None else cost_curve.describe(),
        "h100": [{"weights": w, "recorded_with": who, "tokens_per_forward": t, "measured_ratio": m,
                  "forecast_ratio": f} for w, who, t, m, f in MEASURED_ON_H100],
    }
    if not measure:
        return result
    if show is not None and not on_gpu():
        show(result)
    say("computing the weights")
    model, ar_model = compute(model, name, q_bits, ar)
    if measure_profiles is None:
        measure_profiles = on_gpu()
    ar_walls = time_ar(ar_model, rec) if ar else []
    ar_tok_s = tokens / sum(ar_walls) if ar else None
    if ar:
        say(f"mlx-lm: {tokens} tokens in {sum(ar_walls):.2f} s")
        result.update(ar_seconds=round(sum(ar_walls), 6), ar_tok_s=round(ar_tok_s, 3))
    timed = list(zip(derived, profiles)) if measure_profiles else []
    for p, d in timed + [(recorded, mine)]:
        seconds = time_refusion(model, p.forwards, costs.per_chunk, storage_of(kv, model))
        say(f"replayed {d['label']}: {len(seconds)} forwards in {sum(seconds):.2f} s")
        d["measured"] = _measured(p, sum(seconds), ar_tok_s, d["bandwidth_bound_ratio"])
        if batch > 1:
            d["batched"] = time_batched(model, p.forwards, rec.generated, batch, costs.per_chunk,
                                        storage_of(kv, model))
            say(f"{d['label']}: {batch} requests at once {d['batched']['speedup']:.2f}x one at a time")
    m = mine["measured"]
    result.update(replayed_forwards=len(rec.shapes), refusion_seconds=m["seconds"], refusion_tok_s=m["tok_s"],
                  ratio=m["ratio"])
    return result
