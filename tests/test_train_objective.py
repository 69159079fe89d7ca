"""ReFusion's hybrid loss against an independent PyTorch implementation, and
the example builder's properties."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mlx.core as mx

from refusion_mlx.train import (EPSILON, IGNORE, SLOT_SIZES, Example, build_example, collate,
                                loss_from_logits, refusion_loss)
from tests.helpers import random_config, random_model

MASK = 805


def torch_loss(logits: np.ndarray, batch: dict) -> float:
    """The authors' loss as their ``Qwen3ForCausalLM.forward`` computes it
    (the ``labels is not None`` branch), in PyTorch float32: the logits and
    the per-row arrays flattened, ``cross_entropy(..., reduction="mean")``
    over the boolean-indexed AR tokens (every token that is not a mask:
    prompt and pads too, ignored by their -100 label), and over the masked
    tokens the per-token cross-entropy divided by the token's p and its row's
    response length, summed and divided by ``input_ids.shape[0]``.

    One departure, written in: a batch with no labelled AR token takes 0
    for the AR term where the authors' mean would be NaN (REFUSION.md, 8)."""
    logits = torch.tensor(np.asarray(logits), dtype=torch.float32)
    B, T, V = logits.shape
    input_ids = torch.tensor(batch["input_ids"], dtype=torch.long)
    # their forward_process hands p and the answer length out per token (B, T)
    p_mask = torch.tensor(batch["mask_prob"], dtype=torch.float32).view(-1, 1).repeat(1, T)
    answer_lengths = torch.tensor(batch["response_length"]).view(-1, 1).repeat(1, T)

    com_logits = logits.float().view(-1, V)
    labels = torch.tensor(batch["labels"], dtype=torch.long).view(-1)
    masked_indices = torch.tensor(batch["mdm"], dtype=torch.bool).view(-1)
    p_mask = p_mask.view(-1)
    answer_lengths = answer_lengths.view(-1)

    AR_indices = ~masked_indices
    if (labels[AR_indices] != -100).any():
        AR_loss = F.cross_entropy(com_logits[AR_indices], labels[AR_indices], ignore_index=-100,
                                  reduction="mean")
    else:
        AR_loss = torch.tensor(0.0)
    MDM_token_loss = F.cross_entropy(com_logits[masked_indices], labels[masked_indices], ignore_index=-100,
                                     reduction="none") / p_mask[masked_indices]
    MDM_loss = torch.sum(MDM_token_loss / answer_lengths[masked_indices]) / input_ids.shape[0]
    return float(AR_loss + MDM_loss)


@pytest.fixture(scope="module")
def tiny():
    return random_model(random_config(), seed=3, scale=0.5)


def as_mx(batch):
    return {k: mx.array(v) for k, v in batch.items()}


def check_against_torch(model, batch):
    ours = refusion_loss(model, as_mx(batch)).item()
    logits = model(mx.array(batch["input_ids"]), mx.array(batch["position_ids"]))
    assert loss_from_logits(logits, as_mx(batch)).item() == pytest.approx(ours, rel=1e-6, abs=1e-6)
    reference = torch_loss(np.array(logits.astype(mx.float32)), batch)
    assert abs(ours - reference) <= 1e-4 * max(1.0, abs(reference)), (ours, reference)
    return ours


def random_pair(rng, prompt_len, response_len, vocab=800):
    return rng.integers(0, vocab, prompt_len).tolist(), rng.integers(0, vocab, response_len).tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_matches_torch_on_built_batches(tiny, seed):
    """B > 1, different prompt and response lengths, right padding."""
    rng = np.random.default_rng(seed)
    examples = [build_example(*random_pair(rng, P, L), MASK, rng)
                for P, L in [(7, 23), (3, 41), (12, 9), (5, 64)]]
    batch = collate(examples)
    assert batch["input_ids"].shape[1] % 32 == 0 and (batch["labels"] == IGNORE).any()
    check_against_torch(tiny, batch)


def test_loss_matches_torch_single_row(tiny):
    rng = np.random.default_rng(9)
    check_against_torch(tiny, collate([build_example(*random_pair(rng, 10, 30), MASK, rng)]))


def hand_batch(rows, mask_probs, masked_slots, slot=4):
    """Rows of (prompt, response) with the given slots masked; unmasked slots in original order."""
    examples = []
    for (prompt, response), p, masked in zip(rows, mask_probs, masked_slots):
        P, L = len(prompt), len(response)
        ids, pos, lab, mdm = list(prompt), list(range(P)), [IGNORE] * P, [False] * P
        bounds = [(s, min(s + slot, L)) for s in range(0, L, slot)]
        for i, (s, e) in enumerate(bounds):
            if i in masked:
                continue
            ids += response[s:e]
            pos += range(P + s, P + e)
            lab += response[s + 1:e] + [IGNORE]
            mdm += [False] * (e - s)
        for i, (s, e) in enumerate(bounds):
            if i in masked:
                ids += [MASK] * (e - s)
                pos += range(P + s, P + e)
                lab += response[s:e]
                mdm += [True] * (e - s)
        examples.append(Example(np.array(ids, np.int32), np.array(pos, np.int32), np.array(lab, np.int32),
                                np.array(mdm), p, L, slot))
    return collate(examples)


def test_loss_without_ar_tokens(tiny):
    rng = np.random.default_rng(4)
    rows = [random_pair(rng, 6, 10), random_pair(rng, 4, 13)]
    batch = hand_batch(rows, [1.0, 0.7], [{0, 1, 2}, {0, 1, 2, 3}])
    assert not ((batch["labels"] != IGNORE) & ~batch["mdm"]).any()
    check_against_torch(tiny, batch)


def test_loss_without_mdm_tokens(tiny):
    rng = np.random.default_rng(5)
    rows = [random_pair(rng, 6, 10), random_pair(rng, 9, 17)]
    batch = hand_batch(rows, [0.001, 0.2], [set(), set()])
    assert not batch["mdm"].any()
    loss = check_against_torch(tiny, batch)
    # then it is exactly the AR mean over the batch's tokens, not divided by B
    logits = tiny(mx.array(batch["input_ids"]), mx.array(batch["position_ids"]))
    labels = batch["labels"]
    lp = np.array(mx.log(mx.softmax(logits.astype(mx.float32), axis=-1)))
    rows, cols = np.nonzero(labels != IGNORE)
    ce = -lp[rows, cols, labels[rows, cols]]
    assert loss == pytest.approx(ce.mean(), rel=1e-4)


def test_loss_mixed_hand_batch_with_padding(tiny):
    rng = np.random.default_rng(6)
    rows = [random_pair(rng, 5, 3), random_pair(rng, 2, 30), random_pair(rng, 11, 12)]
    batch = hand_batch(rows, [0.5, 0.05, 0.9], [{0}, {1, 3, 5}, {2}])
    check_against_torch(tiny, batch)


@pytest.mark.parametrize("B", [3, 4, 5, 6])
def test_loss_matches_the_authors_at_every_batch_size(tiny, B):
    """B rows of different lengths; one row fully masked, one with no mask."""
    rng = np.random.default_rng(100 + B)
    rows = [random_pair(rng, int(rng.integers(2, 12)), int(rng.integers(5, 40))) for _ in range(B)]
    slots = [-(-len(r) // 4) for _, r in rows]
    masked = [set(range(slots[0])), set()] + [
        {i for i in range(n) if rng.random() < 0.5} for n in slots[2:]]
    probs = [1.0, 0.001] + [float(rng.uniform(0.05, 1.0)) for _ in range(B - 2)]
    batch = hand_batch(rows, probs, masked)
    row_mdm = batch["mdm"].any(axis=1)
    assert row_mdm[0] and not row_mdm[1]
    assert ((batch["labels"][0] != IGNORE) & ~batch["mdm"][0]).sum() == 0  # row 0 has no AR label
    check_against_torch(tiny, batch)


def test_ar_term_is_not_divided_by_the_batch_size(tiny):
    """Repeating every row leaves the loss unchanged: the AR term is a token
    mean and the MDM sum is divided by B, so both are per-row averages."""
    rng = np.random.default_rng(12)
    rows = [random_pair(rng, 5, 17), random_pair(rng, 8, 22)]
    once = hand_batch(rows, [0.4, 0.6], [{1}, {0, 3}])
    twice = hand_batch(rows * 2, [0.4, 0.6] * 2, [{1}, {0, 3}] * 2)
    a, b = refusion_loss(tiny, once).item(), refusion_loss(tiny, twice).item()
    assert b == pytest.approx(a, rel=1e-5)
    # and --ar-weight multiplies the AR term alone
    logits = tiny(mx.array(once["input_ids"]), mx.array(once["position_ids"]))
    no_mdm = dict(once, mdm=np.zeros_like(once["mdm"]), labels=np.where(once["mdm"], IGNORE, once["labels"]))
    ar = loss_from_logits(logits, as_mx(no_mdm)).item()
    assert loss_from_logits(logits, as_mx(once), ar_weight=3.0).item() == pytest.approx(a + 2 * ar, rel=1e-5)


def test_loss_of_empty_labels_is_zero(tiny):
    batch = hand_batch([([1, 2, 3], [4])], [0.5], [set()])  # a single AR token has no label
    assert refusion_loss(tiny, as_mx(batch)).item() == 0.0
    assert refusion_loss(tiny, batch).item() == 0.0  # numpy arrays are taken as well


def test_loss_has_gradients(tiny):
    import mlx.nn as nn

    rng = np.random.default_rng(7)
    batch = as_mx(collate([build_example(*random_pair(rng, 5, 20), MASK, rng) for _ in range(2)]))
    _, grads = nn.value_and_grad(tiny, refusion_loss)(tiny, batch)
    from mlx.utils import tree_flatten
    assert all(np.isfinite(np.array(g)).all() for _, g in tree_flatten(grads))


# --------------------------------------------------------------------------
# The example builder


@pytest.mark.parametrize("seed", range(12))
def test_example_properties(seed):
    rng = np.random.default_rng(seed)
    P, L = int(rng.integers(0, 20)), int(rng.integers(1, 90))
    prompt, response = random_pair(rng, P, L)
    e = build_example(prompt, response, MASK, rng)
    S = e.slot_size
    assert S in SLOT_SIZES
    assert EPSILON <= e.mask_prob <= 1.0
    assert e.response_length == L and len(e) == P + L
    assert e.input_ids.dtype == np.int32 and e.position_ids.dtype == np.int32 and e.labels.dtype == np.int32
    # every true position exactly once; the prompt first, in order, without loss
    assert sorted(e.position_ids.tolist()) == list(range(P + L))
    assert e.position_ids[:P].tolist() == list(range(P)) and e.input_ids[:P].tolist() == prompt
    assert (e.labels[:P] == IGNORE).all() and not e.mdm[:P].any()
    # unmasked slots come before masked ones; masked ones in original order, all mask ids
    mdm = e.mdm[P:]
    if mdm.any():
        first = int(np.argmax(mdm))
        assert mdm[first:].all()
        masked_pos = e.position_ids[P + first:]
        assert (np.diff(masked_pos) > 0).all()
        assert (e.input_ids[P + first:] == MASK).all()
        assert e.labels[P + first:].tolist() == [response[q - P] for q in masked_pos]
        # whole slots are masked
        assert all((q - P) // S in {(r - P) // S for r in masked_pos} for q in masked_pos)
        assert len(masked_pos) == sum(min(S, L - s) for s in range(0, L, S) if (s + P) in set(masked_pos))
    # AR tokens: their own token, labelled with the next token of their slot
    for i in np.flatnonzero(~e.mdm[P:]) + P:
        q = int(e.position_ids[i]) - P
        assert e.input_ids[i] == response[q]
        last_of_slot = (q + 1) % S == 0 or q == L - 1
        assert e.labels[i] == (IGNORE if last_of_slot else response[q + 1])
        if not last_of_slot:  # the slot continues right after it in the sequence
            assert e.position_ids[i + 1] == e.position_ids[i] + 1


def test_example_slot_sizes_masks_and_orders_vary():
    rng = np.random.default_rng(0)
    sizes, probs, orders = set(), [], set()
    prompt, response = list(range(3)), list(range(100, 164))
    for _ in range(300):
        e = build_example(prompt, response, MASK, rng)
        sizes.add(e.slot_size)
        probs.append(e.mask_prob)
        if not e.mdm.any() and e.slot_size == 32:
            orders.add(tuple(e.position_ids[3::32].tolist()))
    assert sizes == set(SLOT_SIZES)
    assert min(probs) >= EPSILON and max(probs) <= 1.0 and min(probs) < 0.1 and max(probs) > 0.9
    assert len(orders) == 2  # two 32-token slots, both orders occur


def test_example_is_reproducible_and_last_slot_shorter():
    a = build_example([1, 2], list(range(10, 23)), MASK, np.random.default_rng(5), slot_sizes=(4,))
    b = build_example([1, 2], list(range(10, 23)), MASK, np.random.default_rng(5), slot_sizes=(4,))
    for k in ("input_ids", "position_ids", "labels", "mdm"):
        assert (getattr(a, k) == getattr(b, k)).all()
    # 13 tokens in slots of 4: the last slot holds one token, which never has an AR label
    i = int(np.flatnonzero(a.position_ids == 2 + 12)[0])
    assert a.labels[i] == (22 if a.mdm[i] else IGNORE)


def test_mask_probability_is_bounded():
    from refusion_mlx.train.examples import mask_probability

    assert mask_probability(0.0) == pytest.approx(EPSILON)
    assert mask_probability(1.0) == pytest.approx(1.0)
