"""What every model family gives the rest of the runtime: the model contract.

A family is one module of this package named by its ``model_type`` in
``registry.FAMILIES`` (one line). Loading, conversion, the quantization
plan, sharding, fusion, training and the bench's ``--shape`` find it there
by ``config.json``'s ``model_type``, as mlx-lm's ``_get_classes`` does, and
none of them names a family. The module defines:

``ModelArgs``
    A dataclass read from config.json (``ModelArgs.from_dict``: unknown keys
    ignored) that refuses what the family cannot run with a one-line
    ``ConfigError``. The rest of the runtime reads ``model_type``,
    ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads``, ``head_dim``, ``vocab_size``,
    ``max_position_embeddings``, ``tie_word_embeddings``, ``rope_theta``,
    ``rms_norm_eps``; the loader sets ``mask_token_id``.
    (``causal_lm.DecoderArgs`` holds these and their checks.)

``Model(args)``: an ``nn.Module`` with (:class:`RefusionModel`):

* **Hugging Face's parameter names**: ``model.embed_tokens``,
  ``model.layers.{i}...``, ``model.norm``, ``lm_head`` (absent when tied).
  The converter checks a checkpoint against ``Model(args).parameters()`` and
  plans quantization on a lazy copy; ``mlx_lm.load`` reads the folders it
  writes; adapters wrap ``self_attn.q_proj`` ... as mlx-lm names them.
  ``sanitize(weights)`` turns a checkpoint's tensors into these names.
* ``ARCHITECTURES``: the Hugging Face class names (config.json's
  ``architectures``) the converter accepts for this family.
* **A plain pass**: ``model(tokens, positions, visible=None, run_start=None)``
  gives the logits (B, T, vocab) of tokens (B, T) at their own position ids
  (T,) or (B, T) -- REFUSION.md §1: attention causal in sequence order,
  RoPE by position id -- or with ``visible`` the mask
  ``causal_lm.visible_mask`` describes (training's drafting examples).
  ``hidden`` is the same pass up to the final norm.
* **The pieces a decode pass is driven through**: ``decode/runner.py``
  owns that loop (row groups, CPU streams, overlap, BLAS threads) and calls
  ``embed(tokens)``, ``rope(positions)`` (what every layer takes as
  ``rope``), ``attention_mask(mask, queries, keys, dtype)`` (what every layer
  takes as ``mask``, from ``"causal"`` or a boolean (T, L) array), each of
  ``layers`` as ``layer(x, rope, mask, kv)``, ``norm(h)`` and ``head(h)``.
  ``x`` is one sequence (T, dim) or a batch (B, T, dim). ``kv`` is None (a
  plain pass: attend over this pass's keys) or a layer's write
  (``KVWrite.layer(i)``, ``PackedWrite.layer(i)``): the attention then
  hands it this pass's queries, keys and values, ``kv.attend(q, k, v,
  mask)``, and the write stores the keys and values and attends over the
  cached rows each query may see. ``layers`` is a list the pipeline may
  change in place (a rank's other layers become pass-throughs).
* ``cache_spec()``: what one sequence's KV cache holds (:class:`CacheSpec`).
* **This process's share**, which sharding changes: ``heads`` and
  ``kv_heads`` (the query and KV heads computed here), ``layer_range``
  (the layers held here).
* ``tensor_parallel``: how tensor parallelism splits a block
  (:class:`TensorParallel`; ``sharding.shard`` does it).
* **Projections that read one input** (q/k/v, gate/up) are declared as
  ``projections.Projections`` class attributes of the modules that own them and
  called through them (``qk, v = self.qkv(self, x)``): ``projections.join_projections``
  joins each group into one matmul after loading and ``projections.hf_parameters``
  gives back the parameters under Hugging Face's names.

``causal_lm.CausalLM`` is all of this but the blocks: a family subclasses it
with its block class and declares ``ARCHITECTURES`` and ``tensor_parallel``
(``qwen3.py``; ``llama.py`` is the same contract without the q/k norm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Protocol, Tuple

import mlx.core as mx


@dataclass(frozen=True)
class CacheSpec:
    """One sequence's KV cache for a model in this process: ``layers`` in all,
    of which ``held`` are computed here (a pipeline rank's range), each with
    ``kv_heads`` heads of ``head_dim`` in ``dtype``. What a row costs depends
    on how it is stored: ``decode/kv_store.py``'s ``row_bytes`` says."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: mx.Dtype
    held: range


@dataclass(frozen=True)
class TensorParallel:
    """How tensor parallelism splits each block (``sharding.shard``); paths
    are relative to a block.

    ``split``: linear layers whose output rows each rank keeps a slice of
    (no communication: q/k/v, gate/up). ``summed``: layers whose input
    columns each rank keeps, their partial outputs summed over the ranks (one
    all-reduce each: o_proj, down_proj). ``counts``: integer attributes that
    count what is split (the heads), divided by the ranks. ``sizes``: the
    config.json sizes that must divide by the ranks (the one-line error
    names them)."""

    split: Tuple[str, ...]
    summed: Tuple[str, ...]
    counts: Tuple[str, ...]
    sizes: Tuple[str, ...]


class RefusionModel(Protocol):
    """The contract above, as the decoder, trainer, converter, sharding and
    cache use it."""

    args: Any
    model_type: str
    heads: int
    kv_heads: int
    layer_range: Tuple[int, int]
    tensor_parallel: TensorParallel
    ARCHITECTURES: Tuple[str, ...]

    @property
    def layers(self) -> List[Any]:
        """The blocks, ``layer(x, rope, mask, kv=None) -> x``."""

    def embed(self, tokens: mx.array) -> mx.array:
        """Token ids -> hidden states."""

    def rope(self, positions: mx.array) -> Any:
        """What every layer takes as ``rope`` for tokens at these position ids."""

    def attention_mask(self, mask: Any, queries: int, keys: int, dtype: mx.Dtype) -> Any:
        """What every layer takes as ``mask``, from ``"causal"`` or boolean (T, L) or (B, T, L)."""

    def norm(self, h: mx.array) -> mx.array:
        """The final norm."""

    def head(self, h: mx.array) -> mx.array:
        """Final-norm hidden states -> logits."""

    def hidden(self, tokens: mx.array, positions: mx.array, visible=None, run_start=None) -> mx.array:
        """A plain pass up to the final norm."""

    def __call__(self, tokens: mx.array, positions: mx.array, visible=None, run_start=None) -> mx.array:
        """A plain pass's logits."""

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """A checkpoint's tensors under the model's parameter names."""

    def cache_spec(self) -> CacheSpec:
        """What one sequence's KV cache holds for this model in this process."""
