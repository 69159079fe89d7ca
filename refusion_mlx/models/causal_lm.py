"""The decoder-only language model every family here shares, but its blocks.

:class:`CausalLM` is the contract of ``base.py`` around a family's block
class: the embedding, the blocks, the final norm and the LM head under
Hugging Face's names, RoPE from a position id per token, the plain pass
(training, logits checks) and the pieces ``decode/runner.py`` drives a
decode pass through. :class:`DecoderArgs` is the config.json every such
family reads, with the checks that make a bad one a one-line error.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..errors import ConfigError
from .base import CacheSpec, TensorParallel
from .config_checks import field_problems
from .cpu_paths import RMSNorm, attention_mask
from .projections import Linear, tied_head
from .rope import PositionalRoPE, rope_scale


@dataclass
class DecoderArgs:
    """config.json as a decoder-only family reads it (a family's ``ModelArgs``
    subclasses it and checks its own ``model_type`` and extras first)."""

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
    hidden_act: str = "silu"
    mask_token_id: Optional[int] = None
    architectures: list = field(default_factory=list)

    # the RoPE base when config.json gives none: transformers' default (Qwen3Config's, LlamaConfig's), what
    # the PyTorch model runs with; real checkpoints name theirs (ReFusion's, Qwen3's: 1e6)
    DEFAULT_ROPE_THETA = 10_000.0

    @classmethod
    def from_dict(cls, config: Dict[str, Any]) -> "DecoderArgs":
        """The fields this class declares, read from ``config``; other keys are
        ignored (config.json carries many a runtime has no use for). Not
        mlx-lm's base class: importing mlx_lm imports transformers (~4 s), which
        a command that fails on its flags should not wait for."""
        fields = inspect.signature(cls).parameters
        return cls(**{k: v for k, v in config.items() if k in fields})

    def __post_init__(self):
        problems = field_problems(self)  # every bad value, one line each, before anything is derived from them
        if problems:
            raise ConfigError("\n".join(f"config.json: {p}" for p in problems))
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
            self.rope_theta = self.DEFAULT_ROPE_THETA
        if self.head_dim < 2 or self.num_key_value_heads > self.num_attention_heads:
            raise ConfigError(f"config.json: head_dim ({self.head_dim}: hidden_size / num_attention_heads when not "
                              "given) must be at least 2, and num_key_value_heads at most num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                "config.json: num_attention_heads must be a multiple of num_key_value_heads"
            )
        if self.head_dim % 2:
            raise ConfigError("config.json: head_dim must be even for RoPE")
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


class Stack(nn.Module):
    """What Hugging Face names ``model.``: the embedding, the blocks, the final norm."""

    def __init__(self, args: DecoderArgs, block: type):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [block(args) for _ in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class CausalLM(nn.Module):
    """A decoder-only LM whose tokens each carry a position id, built from a
    family's block class (``block(args)``, called ``block(x, rope, mask, kv=None)``)."""

    ARCHITECTURES: Tuple[str, ...] = ()
    tensor_parallel: TensorParallel

    def __init__(self, args: DecoderArgs, block: type):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Stack(args, block)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        self.rotary = PositionalRoPE(args.head_dim, args.rope_theta, args.rope_scaling)
        # the query and KV heads this process computes: all of them, or its
        # share under tensor parallelism (``sharding.shard``)
        self.heads, self.kv_heads = args.num_attention_heads, args.num_key_value_heads
        # the layers [start, end) this process computes: all, or a pipeline rank's (``sharding.pipeline``)
        self.layer_range = (0, args.num_hidden_layers)

    @property
    def layers(self):
        return self.model.layers

    # -- the pieces a decode pass is driven through (decode/runner.py) --------

    def embed(self, tokens: mx.array) -> mx.array:
        return self.model.embed_tokens(tokens)

    def rope(self, positions: mx.array):
        """What every layer takes as ``rope`` for tokens at ``positions`` (T,)
        or (B, T) (``rope.PositionalRoPE.for_pass``: cos and sin in the
        model's dtype, or the positions for MLX's fused kernel)."""
        return self.rotary.for_pass(positions, self.model.norm.weight.dtype)

    def attention_mask(self, mask, queries: int, keys: int, dtype: mx.Dtype):
        """``mask`` in the form the attention takes on this device (``cpu_paths.attention_mask``)."""
        return attention_mask(mask, queries, keys, self.heads, self.kv_heads, dtype)

    def norm(self, h: mx.array) -> mx.array:
        return self.model.norm(h)

    def head(self, h: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            return tied_head(self.model.embed_tokens, h)
        return self.lm_head(h)

    # -- the plain pass --------------------------------------------------------

    def hidden(self, tokens: mx.array, positions: mx.array, visible: Optional[mx.array] = None,
               run_start: Optional[mx.array] = None) -> mx.array:
        """Final-norm hidden states (B, T, dim) for tokens (B, T) at positions
        (T,) or (B, T): causal over each row (training: right-padded rows), or
        with ``visible`` (and ``run_start``) (B, T) ints the pass
        :func:`visible_mask` describes."""
        if tokens.ndim != 2:
            raise ValueError(f"the model takes tokens (B, T); got shape {tokens.shape}")
        B, T = tokens.shape
        h = self.embed(tokens)
        rope = self.rope(mx.broadcast_to(positions, (B, T)))
        mask = self.attention_mask("causal" if visible is None else visible_mask(visible, run_start),
                                   T, T, h.dtype)
        for layer in self.layers:
            h = layer(h, rope, mask)
        return self.norm(h)

    def __call__(self, tokens: mx.array, positions: mx.array, visible: Optional[mx.array] = None,
                 run_start: Optional[mx.array] = None) -> mx.array:
        return self.head(self.hidden(tokens, positions, visible, run_start))

    # -- weights and cache -----------------------------------------------------

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights

    def cache_spec(self) -> CacheSpec:
        """What one sequence's KV cache holds for this model in this process."""
        return CacheSpec(layers=self.args.num_hidden_layers, kv_heads=self.kv_heads,
                         head_dim=self.args.head_dim, dtype=self.model.norm.weight.dtype,
                         held=range(*self.layer_range))
