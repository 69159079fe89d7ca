"""Random ReFusion checkpoints of real shapes, in every input format the converter reads.

    python -m convert.make_checkpoint OUT --shape 0.6b --format sharded-bin

Shapes are Qwen3's (0.6B, 1.7B, 8B) with ReFusion's resized vocabulary
(151671 rows, ``mask_token_id`` 151670), or ``tiny`` for tests. Weights are
random bf16, written shard by shard (memory stays near one shard), named and
ordered as Hugging Face's ``save_pretrained`` writes them. The tokenizer is the
demo model's, with EOS ``<|im_end|>`` and its ``<|mask|>`` at the config's
``mask_token_id`` (``move_mask_token``): at ``tiny`` smaller than the embedding
(a padded vocabulary, which is legal; mask id 805, the demo's), at a real shape grown to the
embedding's rows with tokens no text encodes to (``pad_tokenizer``). Generated checkpoints are for tests and
benchmarks only; never commit them.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from refusion_mlx.cli import OneLineParser, positive_int  # refusion_mlx before torch and mlx: its BLAS

import torch

DEMO = Path(__file__).resolve().parent.parent / "refusion_mlx" / "demo" / "tiny-refusion"
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
                   "generation_config.json"]
REFUSION_VOCAB, REFUSION_MASK = 151671, 151670
MASK, DEMO_MASK = "<|mask|>", 805  # the demo tokenizer's mask token and its id (the tiny shape's mask id)

SHAPES: Dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128, vocab_size=1024, tie_word_embeddings=False,
                 max_position_embeddings=2048, rope_theta=10000.0),
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, tie_word_embeddings=True),
    "1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=6144, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, intermediate_size=12288, tie_word_embeddings=False),
}
FORMATS = ["safetensors", "sharded-safetensors", "bin", "sharded-bin"]


def make_config(shape: str = "tiny", **overrides) -> dict:
    """A Qwen3 config.json as transformers writes it, with ReFusion's mask id."""
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 804, "eos_token_id": 801, "pad_token_id": 799,
        "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 40960,
        "max_window_layers": 28, "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000.0,
        "sliding_window": None, "use_cache": True, "use_sliding_window": False,
        "torch_dtype": "bfloat16", "vocab_size": REFUSION_VOCAB, "mask_token_id": REFUSION_MASK,
    }
    config.update(SHAPES[shape])
    config.update(overrides)
    if shape == "tiny" and "mask_token_id" not in overrides:
        config["mask_token_id"] = DEMO_MASK
    return {k: v for k, v in config.items() if v is not None or k in ("rope_scaling", "sliding_window")}


def tensor_shapes(config: dict) -> List[Tuple[str, Tuple[int, ...]]]:
    """Every tensor of Qwen3ForCausalLM's state dict, in save_pretrained's order."""
    h, hd, v = config["hidden_size"], config["head_dim"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    inter = config["intermediate_size"]
    shapes = [("model.embed_tokens.weight", (v, h))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (h,)), (p + "mlp.down_proj.weight", (h, inter)),
                   (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                   (p + "post_attention_layernorm.weight", (h,)), (p + "self_attn.k_norm.weight", (hd,)),
                   (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                   (p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.q_proj.weight", (q, h)),
                   (p + "self_attn.v_proj.weight", (kv, h))]
        if config.get("attention_bias"):
            shapes += [(p + f"self_attn.{n}_proj.bias", (d,)) for n, d in (("q", q), ("k", kv), ("v", kv))]
    shapes.append(("model.norm.weight", (h,)))
    if not config.get("tie_word_embeddings"):
        shapes.append(("lm_head.weight", (v, h)))
    return shapes


def random_tensor(name: str, shape: Tuple[int, ...], gen: torch.Generator,
                  dtype: torch.dtype) -> torch.Tensor:
    """Scales that keep activations O(1) and logits peaked, so top-1 comparisons mean something."""
    if name.endswith("norm.weight"):
        t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
    elif "embed_tokens" in name:
        t = torch.randn(shape, generator=gen)
    elif "lm_head" in name:
        t = torch.randn(shape, generator=gen) * (4.0 / math.sqrt(shape[1]))
    elif name.endswith(".bias"):
        t = 0.02 * torch.randn(shape, generator=gen)
    else:
        t = torch.randn(shape, generator=gen) * (0.5 / math.sqrt(shape[1]))
    return t.to(dtype)


def split_shards(shapes, count: int, itemsize: int) -> List[List[Tuple[str, Tuple[int, ...]]]]:
    """``count`` runs of consecutive tensors of about equal bytes (the last may be smaller)."""
    total = sum(math.prod(s) for _, s in shapes) * itemsize
    target = total / count
    shards: List[list] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > target * 1.0001 and len(shards) < count:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def write_shard(path: Path, tensors: Dict[str, torch.Tensor], fmt: str) -> None:
    if fmt.endswith("bin"):
        torch.save(tensors, path)
    else:
        from safetensors.torch import save_file

        save_file(tensors, str(path), metadata={"format": "pt"})


def make_checkpoint(out: Path, shape: str = "tiny", fmt: str = "safetensors", shards: int = 3,
                    seed: int = 0, dtype: str = "bfloat16", copy_tokenizer: bool = True,
                    **overrides) -> Path:
    """Write config, tokenizer and random weights to ``out``; return ``out``."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}")
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {list(SHAPES)}")
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = make_config(shape, torch_dtype=dtype, **overrides)
    torch_dtype = getattr(torch, dtype)
    shapes = tensor_shapes(config)
    sharded = fmt.startswith("sharded")
    groups = split_shards(shapes, shards if sharded else 1, torch.empty((), dtype=torch_dtype).element_size())
    ext = "bin" if fmt.endswith("bin") else "safetensors"
    prefix = "pytorch_model" if ext == "bin" else "model"
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for i, group in enumerate(groups, 1):
        name = f"{prefix}-{i:05d}-of-{len(groups):05d}.{ext}" if sharded else f"{prefix}.{ext}"
        tensors = {n: random_tensor(n, s, gen, torch_dtype) for n, s in group}
        write_shard(out / name, tensors, fmt)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({n: name for n in tensors})
        del tensors
    if sharded:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / f"{prefix}.{ext}.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if copy_tokenizer:
        for f in TOKENIZER_FILES:
            shutil.copy(DEMO / f, out / f)
        move_mask_token(out, config.get("mask_token_id"))
        pad_tokenizer(out, config["vocab_size"])
    return out


def move_mask_token(folder: Path, mask_id: Optional[int]) -> None:
    """The demo tokenizer's ``<|mask|>`` moved to the config's ``mask_token_id`` (they name the same
    token: the loader refuses a config that contradicts its tokenizer) where no other token has that
    id; its old id is left free (``pad_tokenizer`` fills it). An id another token has is left as it
    is: a checkpoint the loader refuses."""
    data = json.loads((folder / "tokenizer.json").read_text())
    used = set(data["model"]["vocab"].values()) | {t["id"] for t in data["added_tokens"]}
    if mask_id is None or mask_id in used:
        return
    for t in data["added_tokens"]:
        if t["content"] == MASK:
            t["id"] = mask_id
    (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    added = json.loads((folder / "added_tokens.json").read_text())
    added[MASK] = mask_id
    (folder / "added_tokens.json").write_text(json.dumps(added, ensure_ascii=False))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {(str(mask_id) if v["content"] == MASK else k): v
                                      for k, v in config["added_tokens_decoder"].items()}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2))


def pad_tokenizer(folder: Path, vocab_size: int) -> None:
    """The demo tokenizer in ``folder`` grown to ``vocab_size`` tokens where the embedding is over twice its
    size (a real shape's 151,671 rows): the loader refuses a tokenizer that small as one whose vocabulary
    files are missing. Else only the free ids below its highest are filled (transformers would close
    such a gap, moving the ids above it). The new tokens (``<pad816>`` ...) take the free ids; no text
    encodes to them."""
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    added = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
    used = set(vocab.values()) | set(added.values())
    top = vocab_size if 2 * len(used) < vocab_size else max(used) + 1
    extra = {f"<pad{i}>": i for i in range(top) if i not in used}
    if not extra:
        return
    vocab.update(extra)
    vocab.update(added)  # tokenizers numbers an added token the vocabulary lacks after the vocabulary: kept here
    (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    slow = json.loads((folder / "vocab.json").read_text())
    slow.update(extra)
    (folder / "vocab.json").write_text(json.dumps(slow, ensure_ascii=False))


def main(argv: Optional[List[str]] = None) -> int:
    parser = OneLineParser(prog="python -m convert.make_checkpoint", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write (created; a new or empty one)")
    parser.add_argument("--shape", "--layout", dest="shape", choices=list(SHAPES), default="0.6b",
                        help="model shape (--layout: its old name)")
    parser.add_argument("--format", dest="fmt", choices=FORMATS, default="sharded-safetensors")
    parser.add_argument("--shards", type=positive_int, default=3, help="shard count of the sharded formats")
    parser.add_argument("--layers", type=positive_int, help="override num_hidden_layers (smaller 8B-wide models)")
    parser.add_argument("--vocab-size", type=positive_int, help=f"embedding rows (default {REFUSION_VOCAB})")
    parser.add_argument("--mask-token-id", type=int, help=f"default {REFUSION_MASK} (tiny: {DEMO_MASK}), the "
                        f"tokenizer's {MASK} moved there; -1 leaves it out")
    tie = parser.add_mutually_exclusive_group()
    tie.add_argument("--tied", dest="tie", action="store_true", default=None, help="tie_word_embeddings: true")
    tie.add_argument("--untied", dest="tie", action="store_false", help="tie_word_embeddings: false")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.out.is_file() or (args.out.is_dir() and any(args.out.iterdir())):
        parser.error(f"{args.out} exists and is not an empty folder; give a new one (nothing is overwritten)")
    overrides = {}
    if args.layers is not None:
        overrides["num_hidden_layers"] = args.layers
    if args.vocab_size is not None:
        overrides["vocab_size"] = args.vocab_size
    if args.mask_token_id is not None:
        overrides["mask_token_id"] = None if args.mask_token_id < 0 else args.mask_token_id
    if args.tie is not None:
        overrides["tie_word_embeddings"] = args.tie
    try:
        out = make_checkpoint(args.out, args.shape, args.fmt, args.shards, args.seed, args.dtype, **overrides)
    except OSError as e:
        print(f"error: cannot write {args.out}: {e.strerror or e} ({e.filename or args.out})", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in out.iterdir() if f.suffix in (".bin", ".safetensors"))
    print(f"{out}: {args.shape} shape, {args.fmt}, {size / 1e9:.3f} GB of weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
