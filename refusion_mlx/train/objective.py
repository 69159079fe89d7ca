"""ReFusion's hybrid loss over a padded batch (a pure function of model and batch)."""

from __future__ import annotations

from typing import Dict

import mlx.core as mx

from .examples import IGNORE


def token_cross_entropy(logits: mx.array, labels: mx.array) -> mx.array:
    """Cross-entropy of every token in float32, (B, T); 0 where the label is IGNORE.

    logsumexp minus the label's logit: no vocabulary-sized softmax is kept.
    """
    logits = logits.astype(mx.float32)
    valid = labels != IGNORE
    safe = mx.where(valid, labels, 0)
    picked = mx.take_along_axis(logits, safe[..., None], axis=-1)[..., 0]
    return mx.where(valid, mx.logsumexp(logits, axis=-1) - picked, 0.0)


def loss_from_logits(logits: mx.array, batch: Dict[str, mx.array], ar_weight: float = 1.0) -> mx.array:
    """The batch loss from logits (B, T, V); see :func:`refusion_loss`."""
    labels, mdm = batch["labels"], batch["mdm"].astype(mx.bool_)
    ce = token_cross_entropy(logits, labels)
    valid = labels != IGNORE
    ar = valid & ~mdm
    mdm = valid & mdm
    n_ar = ar.sum()
    ar_mean = mx.where(n_ar > 0, (ce * ar).sum() / mx.maximum(n_ar, 1), 0.0)
    weight = batch["mask_prob"].astype(mx.float32) * batch["response_length"].astype(mx.float32)
    mdm_sum = (mx.where(mdm, ce, 0.0) / weight[:, None]).sum()
    return ar_weight * ar_mean + mdm_sum / labels.shape[0]


def refusion_loss(model, batch: Dict[str, mx.array], ar_weight: float = 1.0) -> mx.array:
    """The scalar training loss of a batch.

    ``batch`` holds (B, T) arrays ``input_ids``, ``position_ids``, ``labels``
    (IGNORE = -100 where no loss), ``mdm`` (bool: a mask token, labelled
    with its own token) and (B,) arrays ``mask_prob`` (p of the row) and
    ``response_length`` (its response tokens, EOS included). Rows are
    right-padded; pads are labelled -100.

    The authors' loss (``Qwen3ForCausalLM.forward`` of their
    ``modeling_qwen3_refusion.py``). With CE the float32 cross-entropy of a
    token, AR the labelled tokens that are not MDM (over the whole batch), MDM
    the labelled MDM tokens, b(i) the row of token i and B the batch's rows::

        loss = mean_{i in AR} CE_i  +  ( sum_{i in MDM} CE_i / (p_b(i) * len_b(i)) ) / B

    The AR term is a token mean over the batch and is not divided by B; only
    the MDM sum is. It is 0 when AR is empty (the authors' mean over nothing
    is NaN). ``ar_weight`` (1 = the paper, ``--ar-weight``) multiplies the AR
    mean.
    Optional (B, T) ints ``visible`` and ``run_start`` (drafting examples) set
    which tokens each token attends to (``models.causal_lm.visible_mask``);
    without them the pass is causal.
    """
    batch = {k: v if isinstance(v, mx.array) else mx.array(v) for k, v in batch.items()}  # numpy too
    if "visible" in batch:  # drafting examples: their masks see only the tokens before them
        logits = model(batch["input_ids"], batch["position_ids"], visible=batch["visible"],
                       run_start=batch.get("run_start"))
    else:
        logits = model(batch["input_ids"], batch["position_ids"])
    return loss_from_logits(logits, batch, ar_weight)
