"""Write a randomly initialised ReFusion checkpoint of a real Qwen3 shape.

Speed work needs a model whose matmuls, KV cache and vocabulary have real
sizes; what it says does not matter. The checkpoint uses Hugging Face's
layout (``config.json`` + ``model.safetensors``), so both refusion-mlx and
mlx-lm load it. The tokenizer is the bundled demo model's: smaller than the
embedding, i.e. a padded vocabulary, with EOS ``<|im_end|>``; the mask id is
ReFusion's 151670 in ``config.json``.

    python benchmarks/make_speed_model.py models/qwen3-0.6b-random
    python benchmarks/make_speed_model.py models/qwen3-1.7b-random --shape 1.7b

The weights are generated, never committed: keep them under ``models/``
(gitignored) or outside the repository.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Optional

import refusion_mlx  # noqa: F401  (before mlx.core: BLAS preload)
from refusion_mlx.generate import OneLineParser
from refusion_mlx.utils import DEMO_MODEL

import mlx.core as mx

REFUSION_VOCAB = 151671
REFUSION_MASK_ID = 151670

# Qwen3's published shapes (both tie the input embedding and the LM head).
SHAPES: Dict[str, dict] = {
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                 tie_word_embeddings=True),
    "1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, intermediate_size=6144,
                 tie_word_embeddings=True),
}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "added_tokens.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def make_config(shape: str) -> dict:
    """config.json of a ReFusion model of the named Qwen3 shape."""
    demo = json.loads((DEMO_MODEL / "config.json").read_text())
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **SHAPES[shape],
        "vocab_size": REFUSION_VOCAB,
        "mask_token_id": REFUSION_MASK_ID,
        "bos_token_id": demo["bos_token_id"],
        "eos_token_id": demo["eos_token_id"],
        "pad_token_id": demo["pad_token_id"],
        "attention_bias": False,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
    }


def weight_shapes(config: dict) -> Dict[str, tuple]:
    """Every parameter's Hugging Face name and shape."""
    d, hd, v = config["hidden_size"], config["head_dim"], config["vocab_size"]
    nq, nkv, ff = config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, d)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (nq * hd, d),
            p + "self_attn.k_proj.weight": (nkv * hd, d),
            p + "self_attn.v_proj.weight": (nkv * hd, d),
            p + "self_attn.o_proj.weight": (d, nq * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (ff, d),
            p + "mlp.up_proj.weight": (ff, d),
            p + "mlp.down_proj.weight": (d, ff),
        })
    return shapes


def random_weights(config: dict, dtype: mx.Dtype, std: float, seed: int) -> Dict[str, mx.array]:
    """Norm scales at one, everything else N(0, std): a small std keeps the
    residual stream and the logits in a sane range through all layers."""
    key = mx.random.key(seed)
    weights = {}
    for name, shape in weight_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = mx.ones(shape, dtype=dtype)
        else:
            key, sub = mx.random.split(key)
            weights[name] = (mx.random.normal(shape, key=sub) * std).astype(dtype)
    return weights


def write_checkpoint(out: Path, shape: str = "0.6b", dtype: str = "bfloat16", std: float = 0.02,
                     seed: int = 0) -> dict:
    """Write config, weights and the demo tokenizer into ``out``; return the config."""
    config = make_config(shape)
    config["torch_dtype"] = dtype
    out.mkdir(parents=True, exist_ok=True)
    weights = random_weights(config, DTYPES[dtype], std, seed)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (DEMO_MODEL / name).is_file():
            shutil.copyfile(DEMO_MODEL / name, out / name)
    return config


def parameter_count(config: dict) -> int:
    total = 0
    for shape in weight_shapes(config).values():
        n = 1
        for s in shape:
            n *= s
        total += n
    return total


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python benchmarks/make_speed_model.py",
                           description="Write a random-weight ReFusion checkpoint of a real Qwen3 shape.")
    parser.add_argument("out", help="output folder (e.g. models/qwen3-0.6b-random; never commit it)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.6b", help="Qwen3 shape (default 0.6b)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                        help="stored dtype (default bfloat16, like the published checkpoints)")
    parser.add_argument("--std", type=float, default=0.02, help="init standard deviation (default 0.02)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="overwrite an existing checkpoint")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out).expanduser()
    if not args.std > 0:
        print("error: --std must be positive", file=sys.stderr)
        return 2
    if out.exists() and not out.is_dir():
        print(f"error: {out} is a file", file=sys.stderr)
        return 1
    if (out / "config.json").exists() and not args.force:
        print(f"error: {out} already holds a checkpoint (use --force to overwrite)", file=sys.stderr)
        return 1
    try:
        config = write_checkpoint(out, args.shape, args.dtype, args.std, args.seed)
    except OSError as e:
        print(f"error: cannot write {out}: {e.strerror or e}", file=sys.stderr)
        return 1
    n = parameter_count(config)
    print(f"wrote {out}: Qwen3-{args.shape} shape, {n / 1e6:.1f}M parameters, {args.dtype}, "
          f"vocab {config['vocab_size']}, mask id {config['mask_token_id']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
