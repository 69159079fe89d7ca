"""Llama (``model_type: llama``, ``LlamaForCausalLM``): the model contract
(``base.py``) for a second family, in this one file and one line of
``registry.FAMILIES``.

RMSNorm pre-norm blocks, grouped-query attention without a norm on queries
and keys, a SwiGLU MLP (with ``mlp_bias``), RoPE in Hugging Face's halves
convention by each token's own position id, RoPE base 10,000 unless config.json
says otherwise. RoPE scaling: none or linear (``rope.rope_scale``; Llama 3.1's
``llama3`` scaling is refused in one line). Parameter names are Hugging
Face's, so a converted folder also loads in ``mlx_lm.load``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import mlx.core as mx
import mlx.nn as nn

from ..errors import ConfigError
from .base import TensorParallel
from .causal_lm import CausalLM, DecoderArgs
from .cpu_paths import RMSNorm, attend
from .kernels import silu_gate
from .projections import Linear, Projections
from .rope import apply_rope, head_scale


@dataclass
class ModelArgs(DecoderArgs):
    max_position_embeddings: int = 2048
    mlp_bias: bool = False

    DEFAULT_ROPE_THETA = 10_000.0

    def __post_init__(self):
        if self.model_type != "llama":
            raise ConfigError(f"model_type is {self.model_type!r}; this is the 'llama' family")
        super().__post_init__()


class Attention(nn.Module):
    # q and k side by side (one rotation), then v
    qkv = Projections("qkv_proj", (("q_proj", "k_proj"), ("v_proj",)))

    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, hd = args.hidden_size, args.head_dim
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = hd
        self.scale = hd**-0.5
        bias = args.attention_bias
        self.q_proj = Linear(dim, self.n_heads * hd, bias=bias)
        self.k_proj = Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.v_proj = Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.o_proj = Linear(self.n_heads * hd, dim, bias=bias)

    def __call__(self, x: mx.array, rope, mask, kv=None) -> mx.array:
        """``x``: one sequence (T, dim), or a batch (B, T, dim)."""
        B, T = (1, x.shape[0]) if x.ndim == 2 else x.shape[:2]
        H, K, D = self.n_heads, self.n_kv_heads, self.head_dim
        qk, v = self.qkv(self, x)
        # one rotation for queries and keys, which also applies the softmax scale to the queries
        qk = apply_rope(qk.reshape(B, T, H + K, D).transpose(0, 2, 1, 3), rope,
                        head_scale(self.scale, H, K, qk.dtype))
        q, k = mx.split(qk, [H], axis=1)
        v = v.reshape(B, T, K, D).transpose(0, 2, 1, 3)
        out = attend(q, k, v, mask) if kv is None else kv.attend(q, k, v, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(*x.shape[:-1], H * D))



class MLP(nn.Module):
    gate_up = Projections("gate_up_proj", (("gate_proj",), ("up_proj",)))

    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, hidden, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = Linear(dim, hidden, bias=bias)
        self.down_proj = Linear(hidden, dim, bias=bias)
        self.up_proj = Linear(dim, hidden, bias=bias)

    def __call__(self, x) -> mx.array:
        gate, up = self.gate_up(self, x)
        return self.down_proj(silu_gate(gate, up))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x, rope, mask, kv=None):
        h = x + self.self_attn(self.input_layernorm(x), rope, mask, kv)
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(CausalLM):
    """Llama causal LM whose tokens each carry a position id (``causal_lm.CausalLM``)."""

    ARCHITECTURES = ("LlamaForCausalLM",)
    # each rank computes 1/N of the heads and of the MLP's columns
    tensor_parallel = TensorParallel(
        split=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
        summed=("self_attn.o_proj", "mlp.down_proj"),
        counts=("self_attn.n_heads", "self_attn.n_kv_heads"),
        sizes=("num_attention_heads", "num_key_value_heads", "intermediate_size"))

    def __init__(self, args: ModelArgs):
        super().__init__(args, TransformerBlock)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Older exports carry RoPE's inverse frequencies: recomputed here, dropped."""
        weights = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
        return super().sanitize(weights)
