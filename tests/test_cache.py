"""The committed cache: in-place growth, speculative write then commit, shared infill."""

import mlx.core as mx
import numpy as np
import pytest

from refusion_mlx.decode.cache import CommittedCache

from tests.helpers import decode_hidden, random_config, random_model


@pytest.fixture(scope="module")
def model():
    return random_model(random_config(vocab_size=120), seed=3)


def prefill(model, cache, tokens, positions):
    decode_hidden(model, mx.array(tokens)[None], mx.array(positions), cache.extend(len(tokens)))
    cache.commit(tokens, positions)


def test_growth_is_in_steps_not_per_token(model):
    cache = CommittedCache.for_model(model, step=64)
    capacities = set()
    for i in range(200):
        prefill(model, cache, [i % 100], [i])
        capacities.add(cache.capacity)
    assert len(cache) == 200
    assert capacities == {64, 128, 192, 256}
    assert cache.keys[0].shape[2] == cache.capacity


def test_uncommitted_rows_are_cropped(model):
    """A pass writes scratch rows; only commit() makes them part of the cache."""
    cache = CommittedCache.for_model(model)
    prefill(model, cache, [1, 2, 3], [0, 1, 2])
    decode_hidden(model, mx.array([[9, 9, 9, 9]]), mx.arange(3, 7), cache.extend(4))
    assert len(cache) == 3 and cache.tokens == [1, 2, 3]
    cache.commit([9, 9], [3, 4])
    assert cache.positions == [0, 1, 2, 3, 4]


def test_commit_of_unwritten_rows_is_refused(model):
    cache = CommittedCache.for_model(model, step=8)
    prefill(model, cache, [1, 2], [0, 1])
    with pytest.raises(ValueError):
        cache.commit(list(range(10)), list(range(2, 12)))


def test_cached_pass_equals_a_plain_forward(model):
    """Committed K/V reused by a later pass give the logits of one plain pass."""
    tokens, positions = [5, 8, 13, 21, 34, 55], [0, 1, 2, 5, 3, 4]
    cache = CommittedCache.for_model(model)
    prefill(model, cache, tokens[:4], positions[:4])
    cached = model.head(decode_hidden(model, mx.array(tokens[4:])[None], mx.array(positions[4:]), cache.extend(2)))
    plain = model(mx.array(tokens)[None], mx.array(positions))
    assert np.allclose(np.array(cached)[0], np.array(plain)[0, 4:], atol=1e-5)


@pytest.mark.parametrize("cursor", [0, 1, 3])
def test_packed_infill_equals_each_slot_alone(model, cursor):
    """k slots in one pass over the shared cache == each slot run on its own.

    Slot i's window must see the committed rows and its own earlier tokens
    only -- exactly a plain forward of prompt + that slot.
    """
    S, k = 4, 3
    prompt = [3, 1, 4, 1, 5, 9, 2]
    slots = [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]]
    slot_pos = [[7 + 8 + j for j in range(S)], [7 + j for j in range(S)], [7 + 4 + j for j in range(S)]]
    cache = CommittedCache.for_model(model)
    prefill(model, cache, prompt, list(range(7)))
    committed_keys = np.array(cache.keys[0][:, :, :7])
    flat = lambda rows, a: mx.array([t for r in rows for t in r[a:]])  # noqa: E731
    if cursor:  # private prefixes written by an earlier round
        decode_hidden(model, flat(slots, 0)[None], flat(slot_pos, 0), cache.infill(k, S, 0))
    out = model.head(decode_hidden(model, flat(slots, cursor)[None], flat(slot_pos, cursor), cache.infill(k, S, cursor)))
    out = np.array(out)[0].reshape(k, S - cursor, -1)
    for i in range(k):
        alone = model(mx.array(prompt + slots[i])[None], mx.array(list(range(7)) + slot_pos[i]))
        assert np.allclose(out[i], np.array(alone)[0, 7 + cursor:], atol=1e-5)
    assert len(cache) == 7
    assert np.array_equal(np.array(cache.keys[0][:, :, :7]), committed_keys)


def test_infill_rows_are_adopted_in_slot_order(model):
    """After infill, commit adopts the slots' own K/V (no recomputation).

    The second slot's rows must be the ones computed without seeing the first
    slot: equal to a cache built from prompt + that slot alone.
    """
    S = 2
    cache = CommittedCache.for_model(model)
    prefill(model, cache, [7, 7, 7], [0, 1, 2])
    decode_hidden(model, mx.array([[40, 41, 50, 51]]), mx.array([5, 6, 3, 4]), cache.infill(2, S, 0))
    cache.commit([40, 41, 50, 51], [5, 6, 3, 4])
    assert cache.positions == [0, 1, 2, 5, 6, 3, 4]
    for slot, rows, toks, pos in ((0, slice(3, 5), [40, 41], [5, 6]), (1, slice(5, 7), [50, 51], [3, 4])):
        alone = CommittedCache.for_model(model)
        prefill(model, alone, [7, 7, 7] + toks, [0, 1, 2] + pos)
        for layer in (1,):  # layer 0's K/V do not depend on attention
            assert np.allclose(np.array(cache.keys[layer][:, :, rows]),
                               np.array(alone.keys[layer][:, :, 3:5]), atol=1e-5)
            assert np.allclose(np.array(cache.values[layer][:, :, rows]),
                               np.array(alone.values[layer][:, :, 3:5]), atol=1e-5)


def test_keep_drops_rows_and_keeps_kv(model):
    cache = CommittedCache.for_model(model)
    prefill(model, cache, [1, 2, 3, 4, 5], [0, 1, 2, 4, 3])
    before = np.array(cache.values[1][:, :, :5])
    cache.keep([0, 1, 2, 4])
    assert cache.tokens == [1, 2, 3, 5] and cache.positions == [0, 1, 2, 3]
    assert np.array_equal(np.array(cache.values[1][:, :, :4]), before[:, :, [0, 1, 2, 4]])
    cache.truncate(2)
    assert cache.tokens == [1, 2]


def test_fork_copies_rows_and_leaves_the_source_alone():
    cache = CommittedCache(num_layers=2, num_kv_heads=1, head_dim=4, step=8)
    write = cache.extend(5)
    kv = mx.arange(5 * 4, dtype=mx.float32).reshape(1, 1, 5, 4)
    for i in range(2):
        write.layer(i).update_and_fetch(kv + i, kv - i)
    cache.commit([10, 11, 12, 13, 14], [0, 1, 2, 4, 3])
    fork = cache.fork([0, 1, 2, 4])
    assert fork.tokens == [10, 11, 12, 14] and fork.positions == [0, 1, 2, 3]
    assert np.array_equal(np.array(fork.keys[1][0, 0, 3]), np.array(kv[0, 0, 4] + 1))
    assert np.array_equal(np.array(fork.values[0][0, 0, :3]), np.array(kv[0, 0, :3]))
    fork.commit([], [])
    fork.reserve(20)
    fork.keys[0][:, :, 0, :] = 0.0
    assert len(cache) == 5 and float(cache.keys[0][0, 0, 0, 1]) == 1.0  # the source is untouched
    assert len(cache.fork([])) == 0


def test_prefill_chunks_and_passes_commit_each_chunk(model):
    """decode.prefill: chunks of at most ``step`` from a first position, until
    ``leave`` are left; the passes commit each chunk once the next is asked
    for; ``prefill`` runs them all, to the K/V of one pass."""
    from refusion_mlx.decode import prefill as pf

    assert list(pf.chunks([1, 2, 3, 4, 5], 10, step=2)) == [([1, 2], [10, 11]), ([3, 4], [12, 13]), ([5], [14])]
    assert list(pf.chunks([1, 2, 3, 4, 5], 0, step=2, leave=2)) == [([1, 2], [0, 1]), ([3, 4], [2, 3])]
    assert list(pf.chunks([1, 2], 0, step=2, leave=2)) == []

    cache = CommittedCache.for_model(model)
    gen = pf.passes(cache, [5, 6, 7], 0, step=2)
    first = next(gen)
    assert (first.phase, first.tokens.tolist(), first.positions.tolist(), len(cache)) == ("prefill", [5, 6], [0, 1], 0)
    second = gen.send(None)
    assert (second.tokens.tolist(), second.positions.tolist(), cache.tokens) == ([7], [2], [5, 6])

    tokens = [int(t) for t in np.random.default_rng(0).integers(0, 100, 13)]
    chunked, whole = CommittedCache.for_model(model), CommittedCache.for_model(model)
    pf.prefill(model, chunked, tokens[:3], step=4)
    pf.prefill(model, chunked, tokens[3:], step=4)  # positions go on after the cache's
    prefill(model, whole, tokens, list(range(13)))
    assert chunked.tokens == whole.tokens and chunked.positions == list(range(13))
    np.testing.assert_allclose(np.array(chunked.keys[0][:, :, :13]), np.array(whole.keys[0][:, :, :13]), atol=1e-4)
