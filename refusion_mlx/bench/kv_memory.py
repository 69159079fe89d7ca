"""What a model's KV cache costs per token and per conversation, kept in
its dtype or quantized (``--kv-bits``): the table ``--shape`` reports
(docs/benchmarks.md), from the shape's config alone, no buffer made."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import mlx.core as mx

from .report import format_table

CONVERSATION_TOKENS = (4096, 32768)


def kv_memory(config: Dict[str, Any], dtype: str, kv_bits: Optional[int] = None,
              kv_group_size: Optional[int] = None, tokens: Sequence[int] = CONVERSATION_TOKENS) -> dict:
    """KV bytes per token of the shape, every layer, kept in ``dtype`` and
    quantized to 8 and 4 bits (groups of ``kv_group_size``, default 64; the
    form --kv-bits chose is marked), and the memory one conversation of each
    of ``tokens`` holds; ``pass_bytes``: what a request's widest decoding
    pass (a block of the default 16 tokens) holds besides in the model's
    dtype until committed, with a quantized cache."""
    from ..decode.kv_store import KVStorage
    from ..decode.params import DEFAULT_BLOCK_TOKENS
    from ..models.base import CacheSpec

    layers = config["num_hidden_layers"]
    spec = CacheSpec(layers, config["num_key_value_heads"], config["head_dim"], getattr(mx, dtype), range(layers))
    forms = []
    for bits in (None, 8, 4):
        storage = KVStorage.of(bits, bits and (kv_group_size or 64))
        if bits and spec.head_dim % storage.settings["group_size"]:
            continue  # a head too narrow for the group (the tests' tiny shape)
        per_token = layers * storage.row_bytes(spec)
        forms.append({"kv_bits": bits, "form": storage.describe(spec), "bytes_per_token": per_token,
                      "chosen": bits == kv_bits, "conversation_bytes": {str(n): n * per_token for n in tokens},
                      "pass_bytes": DEFAULT_BLOCK_TOKENS * layers * storage.scratch_row_bytes(spec)})
    return {"layers": layers, "tokens": list(tokens), "forms": forms}


def format_kv_memory(kv: dict) -> str:
    """The KV table of ``--shape``'s report."""
    float_bytes = kv["forms"][0]["bytes_per_token"]
    rows = [[("* " if f["chosen"] else "") + f["form"].replace("mlx.core.", ""), f["bytes_per_token"],
             *[f"{f['conversation_bytes'][str(n)] / 2 ** 20:,.0f}" for n in kv["tokens"]],
             f"{f['pass_bytes'] / 2 ** 20:,.0f}", f"{float_bytes / f['bytes_per_token']:.2f}x"] for f in kv["forms"]]
    heads = ["KV cache (* --kv-bits)", "bytes/token", *[f"MiB per {n}-token conversation" for n in kv["tokens"]],
             "MiB a pass holds besides", "float / this"]
    return f"KV memory ({kv['layers']} layers)\n" + format_table(heads, rows)
