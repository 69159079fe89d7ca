"""Qwen3 (``model_type: qwen3``), the architecture of ReFusion's checkpoints.

RMSNorm pre-norm blocks, grouped-query attention with a per-head RMSNorm on
queries and keys (``q_norm``, ``k_norm``), a SwiGLU MLP, RoPE by each
token's own position id (``causal_lm``: ReFusion commits slots out of
order, so attention is causal in *sequence* order while each token rotates
by its position). Parameter names are Hugging Face's, so a converted folder
also loads in ``mlx_lm.load`` (which decodes the same weights left to right).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..errors import ConfigError
from .base import TensorParallel
from .causal_lm import CausalLM, DecoderArgs
from .cpu_paths import RMSNorm, attend, rms_norm
from .kernels import silu_gate
from .projections import Derived, Linear, Projections
from .rope import TokenPositions, apply_rope, head_scale


@dataclass
class ModelArgs(DecoderArgs):
    use_sliding_window: bool = False

    def __post_init__(self):
        if self.model_type != "qwen3":
            raise ConfigError(
                f"model_type is {self.model_type!r}; ReFusion checkpoints are 'qwen3'"
            )
        super().__post_init__()
        if self.use_sliding_window:
            raise ConfigError("config.json: use_sliding_window is not supported")


class Attention(nn.Module):
    # q and k side by side (one norm call, one rotation), then v
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
        self.q_norm = RMSNorm(hd, eps=args.rms_norm_eps)
        self.k_norm = RMSNorm(hd, eps=args.rms_norm_eps)
        self._qk_norm_weight = Derived()
        self._qk_norm_scaled = Derived()

    def __call__(self, x: mx.array, rope, mask, kv=None) -> mx.array:
        """``x``: one sequence kept 2-D (T, dim), or a batch (B, T, dim)."""
        B, T = (1, x.shape[0]) if x.ndim == 2 else x.shape[:2]
        H, K, D = self.n_heads, self.n_kv_heads, self.head_dim
        qk, v = self.qkv(self, x)
        # queries and keys share one norm call and one rotation: per head it is
        # the same arithmetic as two calls, with half the ops to dispatch
        if isinstance(rope, TokenPositions):  # MLX's fused rotation: the softmax scale folded into q's norm weight
            qk = rms_norm(qk.reshape(B, T, H + K, D), self.qk_norm_weight(scaled=True), self.q_norm.eps)
            qk = apply_rope(qk.transpose(0, 2, 1, 3), rope, None)
        else:  # the rotation also applies the softmax scale to the queries (keys x 1)
            qk = rms_norm(qk.reshape(B, T, H + K, D), self.qk_norm_weight(), self.q_norm.eps)
            qk = apply_rope(qk.transpose(0, 2, 1, 3), rope, head_scale(self.scale, H, K, qk.dtype))
        q, k = mx.split(qk, [H], axis=1)
        v = v.reshape(B, T, K, D).transpose(0, 2, 1, 3)
        # with a cache, the layer's write keeps this pass's keys and values and
        # attends over what its queries may see (a packed batch: each request alone)
        out = attend(q, k, v, mask) if kv is None else kv.attend(q, k, v, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(*x.shape[:-1], H * D))

    def qk_norm_weight(self, scaled: bool = False) -> mx.array:
        """q_norm's weight for every query head, then k_norm's for every KV
        head; ``scaled``: q_norm's times the softmax scale."""
        def make(q_weight, k_weight):
            D = self.head_dim
            if scaled:
                q_weight = q_weight * self.scale
            return mx.concatenate([mx.broadcast_to(q_weight, (self.n_heads, D)),
                                   mx.broadcast_to(k_weight, (self.n_kv_heads, D))])
        cached = self._qk_norm_scaled if scaled else self._qk_norm_weight
        return cached.get((self.q_norm["weight"], self.k_norm["weight"]), make)


class MLP(nn.Module):
    gate_up = Projections("gate_up_proj", (("gate_proj",), ("up_proj",)))

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = Linear(dim, hidden_dim, bias=False)
        self.down_proj = Linear(hidden_dim, dim, bias=False)
        self.up_proj = Linear(dim, hidden_dim, bias=False)

    def __call__(self, x) -> mx.array:
        gate, up = self.gate_up(self, x)
        return self.down_proj(silu_gate(gate, up))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x, rope, mask, kv=None):
        h = x + self.self_attn(self.input_layernorm(x), rope, mask, kv)
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(CausalLM):
    """Qwen3 causal LM whose tokens each carry a position id (``causal_lm.CausalLM``)."""

    ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3Model")
    # each rank computes 1/N of the heads and of the MLP's columns
    tensor_parallel = TensorParallel(
        split=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
        summed=("self_attn.o_proj", "mlp.down_proj"),
        counts=("self_attn.n_heads", "self_attn.n_kv_heads"),
        sizes=("num_attention_heads", "num_key_value_heads", "intermediate_size"))

    def __init__(self, args: ModelArgs):
        super().__init__(args, TransformerBlock)
