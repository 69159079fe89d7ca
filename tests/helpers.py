"""Small random ReFusion checkpoints for tests."""

import json
import shutil
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from refusion_mlx.decode.runner import Runner
from refusion_mlx.models import registry
from refusion_mlx.models.loading import DEMO_MODEL

# The model the golden outputs and logits were made with: the demo model as it
# was before it was retrained to converse (the package's demo may change).
FIXTURE_MODEL = Path(__file__).parent / "fixtures" / "tiny-refusion"
DEMO_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "demo_model"

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
                   "generation_config.json"]


def random_config(vocab_size=806, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                  intermediate=128, tie=False, mask_token_id: Optional[int] = 805, **extra):
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "intermediate_size": intermediate,
        "vocab_size": vocab_size, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": tie, "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if mask_token_id is not None:
        config["mask_token_id"] = mask_token_id
    config.update(extra)
    return config


def random_model(config: dict, seed: int = 0, scale: float = 1.0, layer_std: float = 0.08):
    """A float32 model of the config's family with peaky outputs (so decisions are not coin flips)."""
    mx.random.seed(seed)
    model = registry.build(registry.family_args(config))
    params = []
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            value = mx.ones_like(p)
        else:
            std = scale if "embed" in name or "lm_head" in name else layer_std
            value = mx.random.normal(p.shape) * std
        params.append((name, value.astype(mx.float32)))
    model.load_weights(params)
    model.args.mask_token_id = config.get("mask_token_id")
    mx.eval(model.parameters())
    return model


def write_checkpoint(model, folder: Path, config: dict, tokenizer_from: Path = DEMO_MODEL,
                     dtype=mx.float32) -> Path:
    """An HF-format folder: config.json, model.safetensors, the demo tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(dtype) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, folder / name)
    return folder


def decode_hidden(model, tokens, positions, write):
    """Final-norm hidden states (1, T, dim) of one decode pass of tokens (T,)
    or (1, T) through ``write``, run as the decoder runs it (``decode.runner``)."""
    hidden = Runner.of(model).hidden(mx.array(tokens).reshape(-1), mx.array(positions).reshape(-1), write)
    return hidden[None]


def rows_of(cache, start=0):
    return list(zip(cache.positions[start:], cache.tokens[start:]))


def answer_positions_contiguous(cache, response_start, answer_len):
    committed = {p for p in cache.positions if p >= response_start}
    return set(range(response_start, response_start + answer_len)) <= committed


def demo_example_module(name: str):
    """A script of examples/demo_model imported by path (it imports its neighbours, so their folder goes on
    sys.path while it loads)."""
    import importlib.util
    import sys

    sys.path.insert(0, str(DEMO_EXAMPLE))
    try:
        spec = importlib.util.spec_from_file_location(name, DEMO_EXAMPLE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(DEMO_EXAMPLE))
    return module


def committed_cache(rows: int = 4096):
    """A one-layer CommittedCache with room for ``rows`` rows: the holder of
    committed tokens that text views (AnswerText, SlotView) read."""
    from refusion_mlx.decode.cache import CommittedCache
    from refusion_mlx.models.base import CacheSpec

    cache = CommittedCache(CacheSpec(1, 1, 1, mx.float32, range(1)), growth=rows)
    cache.reserve(rows)
    return cache


def commit(cache, positions, tokens):
    """Commit ``tokens`` at ``positions`` as a step of the decoder does."""
    cache.commit(list(tokens), list(positions))


class StandInCache:
    """What the prompt cache reads of a CommittedCache, without arrays: ``tokens``
    at rows 0, 1, ... in position order, 100 bytes a row."""

    def __init__(self, tokens):
        self.tokens = list(tokens)

    nbytes = property(lambda self: 100 * len(self.tokens))

    def __len__(self):
        return len(self.tokens)

    def in_position_order(self):
        return [(r, r, t) for r, t in enumerate(self.tokens)]

    def token_at(self, position):
        return self.tokens[position] if position < len(self.tokens) else None

    def fork(self, rows, exact=False):
        return StandInCache([self.tokens[r] for r in rows])
