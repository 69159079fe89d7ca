"""Qwen3 with an explicit position id per token.

ReFusion commits slots out of order, so the order of tokens in the sequence
(and in the KV cache) is not their position order: attention is causal in
*sequence* order while RoPE rotates each token by its *own* position id.
Parameter names are Hugging Face's, so a converted folder also loads in
``mlx_lm.load`` (which decodes the same weights left to right).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import BaseModelArgs

from ..errors import ConfigError
from .base import CacheSpec
from .cpu_paths import RMSNorm, attend, attention_mask, grouped_mask, on, overlap, rms_norm, row_groups  # noqa: F401  (importable here)
from .fused import FUSED, Linear, Derived, fuse_linears, fused_rows
from .kernels import silu_gate
from .rope import PositionalRoPE, apply_rope, rope_scale


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    max_position_embeddings: int = 32768
    rope_theta: Optional[float] = None
    rope_scaling: Optional[Dict[str, Any]] = None
    rope_parameters: Optional[Dict[str, Any]] = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    use_sliding_window: bool = False
    hidden_act: str = "silu"
    mask_token_id: Optional[int] = None
    architectures: list = field(default_factory=list)

    def __post_init__(self):
        if self.model_type != "qwen3":
            raise ConfigError(
                f"model_type is {self.model_type!r}; ReFusion checkpoints are 'qwen3'"
            )
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.rope_parameters:  # transformers >= 5 nests the RoPE settings
            if self.rope_theta is None:
                self.rope_theta = self.rope_parameters.get("rope_theta")
            if self.rope_scaling is None:
                self.rope_scaling = self.rope_parameters
        if self.rope_theta is None:
            self.rope_theta = 1_000_000.0
        for name in ("hidden_size", "num_hidden_layers", "intermediate_size",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config.json: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                "config.json: num_attention_heads must be a multiple of num_key_value_heads"
            )
        if self.head_dim % 2:
            raise ConfigError("config.json: head_dim must be even for RoPE")
        if self.use_sliding_window:
            raise ConfigError("config.json: use_sliding_window is not supported")
        if self.hidden_act != "silu":
            raise ConfigError(f"config.json: hidden_act {self.hidden_act!r} is not supported (silu only)")
        rope_scale(self.rope_scaling)  # validates the scaling type


def visible_mask(visible: mx.array, run_start: Optional[mx.array] = None) -> mx.array:
    """(B, T, T) bool from (B, T) ints: token i attends to the first
    ``visible[b, i]`` tokens of its row, and to its own run: the tokens from
    ``run_start[b, i]`` (default: i itself) up to i.

    ``visible = arange(T)`` is the causal mask. Training's drafting examples
    give a mask fewer: only the written tokens before the run of masks it
    belongs to, and the masks of that run before it, as the plan pass drafts a
    block (see ``train.examples.build_draft_example``).
    """
    keys = mx.arange(visible.shape[-1])
    queries = keys[None, :, None]
    start = queries if run_start is None else run_start[..., None]
    own_run = (keys[None, None, :] >= start) & (keys[None, None, :] <= queries)
    return (keys[None, None, :] < visible[..., None]) | own_run


class Attention(nn.Module):
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
        self._head_scale = Derived()

    def __call__(self, x: mx.array, rope: Tuple[mx.array, mx.array], mask, kv=None) -> mx.array:
        """``x``: one sequence kept 2-D (T, dim), or a batch (B, T, dim)."""
        B, T = (1, x.shape[0]) if x.ndim == 2 else x.shape[:2]
        H, K, D = self.n_heads, self.n_kv_heads, self.head_dim
        if "qkv_proj" in self:
            qk, v = mx.split(self.qkv_proj(x), [(H + K) * D], axis=-1)
        else:
            qk, v = mx.concatenate([self.q_proj(x), self.k_proj(x)], axis=-1), self.v_proj(x)
        # queries and keys share one norm call and one rotation: per head it is
        # the same arithmetic as two calls, with half the ops to dispatch
        qk = rms_norm(qk.reshape(B, T, H + K, D), self.qk_norm_weight(), self.q_norm.eps)
        # the rotation also applies the softmax scale to the queries (keys x 1)
        qk = apply_rope(qk.transpose(0, 2, 1, 3), *rope, self.head_scale())
        q, k = mx.split(qk, [H], axis=1)
        v = v.reshape(B, T, K, D).transpose(0, 2, 1, 3)
        # with a cache, the layer's write keeps this pass's keys and values and
        # attends over what its queries may see (a packed batch: each request alone)
        out = attend(q, k, v, mask) if kv is None else kv.attend(q, k, v, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(*x.shape[:-1], H * D))

    def head_scale(self) -> mx.array:
        """(H + K, 1, 1): the softmax scale for query heads, 1 for key heads."""
        return self._head_scale.get((), lambda: mx.array(
            [self.scale] * self.n_heads + [1.0] * self.n_kv_heads, mx.float32).reshape(-1, 1, 1))

    def qk_norm_weight(self) -> mx.array:
        """q_norm's weight for every query head, then k_norm's for every KV head."""
        def make(q_weight, k_weight):
            D = self.head_dim
            return mx.concatenate([mx.broadcast_to(q_weight, (self.n_heads, D)),
                                   mx.broadcast_to(k_weight, (self.n_kv_heads, D))])
        return self._qk_norm_weight.get((self.q_norm["weight"], self.k_norm["weight"]), make)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = Linear(dim, hidden_dim, bias=False)
        self.down_proj = Linear(hidden_dim, dim, bias=False)
        self.up_proj = Linear(dim, hidden_dim, bias=False)

    def __call__(self, x) -> mx.array:
        if "gate_up_proj" in self:
            gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
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


class Qwen3Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(nn.Module):
    """Qwen3 causal LM whose forward takes the position id of every token.

    ``cache`` is ``None`` (plain causal pass) or a ``KVWrite`` from
    :mod:`refusion_mlx.decode.cache` that says where this pass's keys and values go
    and which cached rows each query may see.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Qwen3Model(args)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        self.rope = PositionalRoPE(args.head_dim, args.rope_theta, args.rope_scaling)
        # the query and KV heads this process computes: all of them, or its
        # share under tensor parallelism (``shard``)
        self.heads, self.kv_heads = args.num_attention_heads, args.num_key_value_heads
        # the layers [start, end) this process computes: all, or a pipeline rank's (``pipeline``)
        self.layer_range = (0, args.num_hidden_layers)
        # split over several processes (``sharding.shard`` or ``pipeline``):
        # then every rank must run the same ops in the same order, so no row groups
        self.distributed = False

    def row_groups(self, write, rows: int):
        """How a decode pass of ``rows`` tokens through ``write`` runs: the CPU
        paths' row groups (``cpu_paths.row_groups``), or one group when the
        model is split over processes (every rank must run the same ops)."""
        return [(0, rows, write, None)] if self.distributed else row_groups(write, rows)

    def hidden(self, tokens: mx.array, positions: mx.array, cache=None,
               visible: Optional[mx.array] = None, run_start: Optional[mx.array] = None,
               groups=None) -> mx.array:
        """Final-norm hidden states (B, T, dim) for tokens (B, T) at positions
        (T,) or (B, T). With a ``cache``, one sequence (B = 1); without one, a
        plain causal pass over each row (training: right-padded rows), or with
        ``visible`` (and ``run_start``) (B, T) ints the pass :func:`visible_mask` describes.
        ``groups``: the pass's :meth:`row_groups`, when the caller made them already."""
        if tokens.ndim != 2 or (cache is not None and (tokens.shape[0] != 1 or visible is not None)):
            raise ValueError(f"hidden() takes tokens (B, T), one row with a cache; got {tokens.shape}")
        if tokens.shape[0] > 1 or visible is not None:
            return self._batch_hidden(tokens, positions, visible, run_start)
        # one sequence, kept 2-D (T, hidden) inside: every projection is then a
        # plain matmul, without the reshapes a batch axis costs on each call
        h = self.model.embed_tokens(tokens.reshape(-1))
        T = h.shape[0]
        positions = positions.reshape(-1)
        if cache is None:
            mask = attention_mask("causal", T, T, self.heads, self.kv_heads, h.dtype)
            rope = self.rope.angles(positions)
            for layer in self.model.layers:
                h = layer(h, rope, mask)
            return self.model.norm(h)[None]
        # a decode pass: one group of rows, or (CPU paths, wide passes) two on
        # their own streams, each writing its rows and attending as a pass of its own
        runs = []  # per group: its rows' hidden states, rope, mask, write, stream
        for lo, hi, write, stream in groups or self.row_groups(cache, T):
            with on(stream):
                mask = write.mask
                if mask is not None:  # None: a packed batch, whose requests bring their own masks
                    mask = attention_mask(mask, hi - lo, write.visible, self.heads, self.kv_heads, h.dtype)
                whole = hi - lo == T
                runs.append([h if whole else h[lo:hi],
                             self.rope.angles(positions if whole else positions[lo:hi]), mask, write, stream])
        layers = self.model.layers
        for i, layer in enumerate(layers):
            for run in runs:
                x, rope, mask, write, stream = run
                with on(stream):
                    run[0] = layer(x, rope, mask, write.layer(i))
            overlap([r[0] for r in runs], i, len(layers))
        h = runs[0][0] if len(runs) == 1 else mx.concatenate([r[0] for r in runs])
        return self.model.norm(h)[None]

    def _batch_hidden(self, tokens: mx.array, positions: mx.array, visible: Optional[mx.array] = None,
                      run_start: Optional[mx.array] = None) -> mx.array:
        B, T = tokens.shape
        h = self.model.embed_tokens(tokens)
        rope = self.rope.angles(mx.broadcast_to(positions, (B, T)))
        mask = attention_mask("causal" if visible is None else visible_mask(visible, run_start), T, T,
                              self.heads, self.kv_heads, h.dtype)
        for layer in self.model.layers:
            h = layer(h, rope, mask)
        return self.model.norm(h)

    def head(self, h: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def __call__(self, tokens: mx.array, positions: mx.array, cache=None,
                 visible: Optional[mx.array] = None, run_start: Optional[mx.array] = None) -> mx.array:
        return self.head(self.hidden(tokens, positions, cache, visible, run_start))

    def fuse_projections(self) -> int:
        """Fuse q/k/v and gate/up into one matmul each, layer by layer.

        Fewer, larger matmuls per layer: +6% tokens/s on the demo model
        (CPU), where dispatch dominates. Returns how many groups were fused.
        """
        count = 0
        # the blocks this process holds (under ``pipeline`` some are gone, some wrapped)
        for layer in [m for m in self.model.modules() if isinstance(m, TransformerBlock)]:
            for parent in (layer.self_attn, layer.mlp):
                for fused_name, parts in FUSED.items():
                    if not all(p in parent for p in parts):
                        continue
                    fused = fuse_linears([parent[p] for p in parts])
                    if fused is None:
                        continue
                    for p in parts:
                        del parent[p]
                    parent[fused_name] = fused
                    mx.eval(fused.parameters())  # frees the separate weights now
                    count += 1
        return count

    def hf_parameters(self) -> Dict[str, mx.array]:
        """Parameters under Hugging Face's names (fused ones as row slices, no copies)."""
        rows = fused_rows(self.args)
        out = {}
        for name, value in tree_flatten(self.parameters()):
            module, _, leaf = name.rpartition(".")
            prefix, _, last = module.rpartition(".")
            if last not in FUSED:
                out[name] = value
                continue
            start = 0
            for part in FUSED[last]:
                out[f"{prefix}.{part}.{leaf}"] = value[start:start + rows[part]]
                start += rows[part]
        return out

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights

    def cache_spec(self) -> CacheSpec:
        """What one sequence's KV cache holds for this model in this process."""
        return CacheSpec(layers=self.args.num_hidden_layers, kv_heads=self.kv_heads,
                         head_dim=self.args.head_dim, dtype=self.model.norm.weight.dtype,
                         held=range(*self.layer_range))

    @property
    def layers(self):
        return self.model.layers
