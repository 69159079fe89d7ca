"""The committed cache: in-place growth, speculative write then commit, shared infill."""

import mlx.core as mx
import numpy as np
import pytest

from refusion_mlx.decode.cache import CommittedCache
from refusion_mlx.decode.kv_quant import QuantizedStore
from refusion_mlx.decode.kv_store import KVStore, KVStorage
from refusion_mlx.models.base import CacheSpec

from tests.helpers import decode_hidden, random_config, random_model


@pytest.fixture(scope="module")
def model():
    return random_model(random_config(vocab_size=120), seed=3)


def keys(cache, layer):
    """Every row a layer's store holds: its keys (1, kv_heads, capacity, head_dim)."""
    return cache.stores[layer].read(cache.capacity)[0]


def values(cache, layer):
    return cache.stores[layer].read(cache.capacity)[1]


def prefill(model, cache, tokens, positions):
    decode_hidden(model, mx.array(tokens)[None], mx.array(positions), cache.extend(len(tokens)))
    cache.commit(tokens, positions)


def test_growth_is_in_multiples_of_growth_rows_not_per_token(model):
    cache = CommittedCache.for_model(model, growth=64)
    capacities = set()
    for i in range(200):
        prefill(model, cache, [i % 100], [i])
        capacities.add(cache.capacity)
    assert len(cache) == 200
    assert capacities == {64, 128, 192, 256}
    assert cache.stores[0].keys.shape[2] == cache.stores[0].capacity == cache.capacity


def test_a_planned_cache_doubles_up_to_its_plan_and_values_survive_growth(model):
    """A response plans its prompt and whole budget (``plan``) instead of allocating them at its start: the
    capacity doubles as rows are written, never past the plan (in whole growth steps), and each growth keeps
    the rows written before it."""
    cache = CommittedCache.for_model(model, growth=64)
    cache.plan(600)
    capacities = []
    for i in range(600):
        prefill(model, cache, [i % 100], [i])
        if cache.capacity not in capacities:
            capacities.append(cache.capacity)
        if i == 5:
            first = np.array(keys(cache, 0)[:, :, :6])
    assert capacities == [64, 128, 256, 512, 640] and cache.capacity == cache.stores[0].capacity
    assert np.array_equal(np.array(keys(cache, 0)[:, :, :6]), first)
    unplanned = CommittedCache.for_model(model, growth=64)
    unplanned.reserve(300)
    assert unplanned.capacity == 320  # no plan: whole growth steps, as before


def test_uncommitted_rows_are_cropped(model):
    """A pass writes scratch rows; only commit() makes them part of the cache."""
    cache = CommittedCache.for_model(model)
    prefill(model, cache, [1, 2, 3], [0, 1, 2])
    decode_hidden(model, mx.array([[9, 9, 9, 9]]), mx.arange(3, 7), cache.extend(4))
    assert len(cache) == 3 and cache.tokens == [1, 2, 3]
    cache.commit([9, 9], [3, 4])
    assert cache.positions == [0, 1, 2, 3, 4]


def test_commit_of_unwritten_rows_is_refused(model):
    cache = CommittedCache.for_model(model, growth=8)
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
    committed_keys = np.array(keys(cache, 0)[:, :, :7])
    flat = lambda rows, a: mx.array([t for r in rows for t in r[a:]])  # noqa: E731
    if cursor:  # private prefixes written by an earlier round
        decode_hidden(model, flat(slots, 0)[None], flat(slot_pos, 0), cache.infill(k, S, 0))
    out = model.head(decode_hidden(model, flat(slots, cursor)[None], flat(slot_pos, cursor), cache.infill(k, S, cursor)))
    out = np.array(out)[0].reshape(k, S - cursor, -1)
    for i in range(k):
        alone = model(mx.array(prompt + slots[i])[None], mx.array(list(range(7)) + slot_pos[i]))
        assert np.allclose(out[i], np.array(alone)[0, 7 + cursor:], atol=1e-5)
    assert len(cache) == 7
    assert np.array_equal(np.array(keys(cache, 0)[:, :, :7]), committed_keys)


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
            assert np.allclose(np.array(keys(cache, layer)[:, :, rows]),
                               np.array(keys(alone, layer)[:, :, 3:5]), atol=1e-5)
            assert np.allclose(np.array(values(cache, layer)[:, :, rows]),
                               np.array(values(alone, layer)[:, :, 3:5]), atol=1e-5)


def test_keep_drops_rows_and_keeps_kv(model):
    cache = CommittedCache.for_model(model)
    prefill(model, cache, [1, 2, 3, 4, 5], [0, 1, 2, 4, 3])
    before = np.array(values(cache, 1)[:, :, :5])
    cache.keep([0, 1, 2, 4])
    assert cache.tokens == [1, 2, 3, 5] and cache.positions == [0, 1, 2, 3]
    assert np.array_equal(np.array(values(cache, 1)[:, :, :4]), before[:, :, [0, 1, 2, 4]])


def test_fork_copies_rows_and_leaves_the_source_alone():
    cache = CommittedCache(CacheSpec(layers=2, kv_heads=1, head_dim=4, dtype=mx.float32, held=range(2)), growth=8)
    write = cache.extend(5)
    kv = mx.arange(5 * 4, dtype=mx.float32).reshape(1, 1, 5, 4)
    for i in range(2):
        write.layer(i).update(kv + i, kv - i)
    cache.commit([10, 11, 12, 13, 14], [0, 1, 2, 4, 3])
    fork = cache.fork([0, 1, 2, 4])
    assert fork.tokens == [10, 11, 12, 14] and fork.positions == [0, 1, 2, 3]
    assert np.array_equal(np.array(keys(fork, 1)[0, 0, 3]), np.array(kv[0, 0, 4] + 1))
    assert np.array_equal(np.array(values(fork, 0)[0, 0, :3]), np.array(kv[0, 0, :3]))
    fork.commit([], [])
    fork.reserve(20)
    fork.stores[0].write(mx.zeros((1, 1, 1, 4)), mx.zeros((1, 1, 1, 4)), 0)
    assert float(keys(fork, 0)[0, 0, 0, 1]) == 0.0
    assert len(cache) == 5 and float(keys(cache, 0)[0, 0, 0, 1]) == 1.0  # the source is untouched
    assert len(cache.fork([])) == 0


def test_prefill_chunks_and_passes_commit_each_chunk(model):
    """decode.prefill: chunks of at most ``chunk`` from a first position, until
    ``leave`` are left; the passes commit each chunk once the next is asked
    for; ``prefill`` runs them all, to the K/V of one pass."""
    from refusion_mlx.decode import prefill as pf

    assert list(pf.chunks([1, 2, 3, 4, 5], 10, chunk=2)) == [([1, 2], [10, 11]), ([3, 4], [12, 13]), ([5], [14])]
    assert list(pf.chunks([1, 2, 3, 4, 5], 0, chunk=2, leave=2)) == [([1, 2], [0, 1]), ([3, 4], [2, 3])]
    assert list(pf.chunks([1, 2], 0, chunk=2, leave=2)) == []

    cache = CommittedCache.for_model(model)
    gen = pf.passes(cache, [5, 6, 7], 0, chunk=2)
    first = next(gen)
    assert (first.phase, first.tokens.tolist(), first.positions.tolist(), len(cache)) == ("prefill", [5, 6], [0, 1], 0)
    second = gen.send(None)
    assert (second.tokens.tolist(), second.positions.tolist(), cache.tokens) == ([7], [2], [5, 6])

    tokens = [int(t) for t in np.random.default_rng(0).integers(0, 100, 13)]
    chunked, whole = CommittedCache.for_model(model), CommittedCache.for_model(model)
    pf.prefill(model, chunked, tokens[:3], chunk=4)
    pf.prefill(model, chunked, tokens[3:], chunk=4)  # positions go on after the cache's
    prefill(model, whole, tokens, list(range(13)))
    assert chunked.tokens == whole.tokens and chunked.positions == list(range(13))
    np.testing.assert_allclose(np.array(keys(chunked, 0)[:, :, :13]), np.array(keys(whole, 0)[:, :, :13]), atol=1e-4)


# -- the storage interface: its contract on the float store and on a sibling --


class StackedStore(KVStore):
    """Keys and values in one (2, kv_heads, capacity, head_dim) array, stored
    in ``dtype`` (the model's unless given): a sibling of FloatStore written
    here, so that plugging one in is proved to need no change elsewhere. It
    checks what it is told: no pass writes a committed row."""

    def __init__(self, spec, dtype=None):
        super().__init__(spec)
        self.dtype = dtype or spec.dtype
        self.kv = None
        self.committed = 0

    @classmethod
    def row_bytes(cls, spec, dtype=None):
        return 2 * spec.kv_heads * spec.head_dim * (dtype or spec.dtype).size

    @classmethod
    def describe(cls, spec, dtype=None):
        return f"stacked {dtype or spec.dtype}"

    def grow(self, capacity):
        pad = mx.zeros((2, self.spec.kv_heads, capacity - self.capacity, self.spec.head_dim), self.dtype)
        self.kv = pad if self.kv is None else mx.concatenate([self.kv, pad], axis=2)
        self.capacity = capacity

    def write(self, keys, values, start, settled=0):
        assert start >= self.committed, "a pass wrote a committed row"
        self.kv[:, :, start:start + keys.shape[2]] = mx.concatenate([keys, values]).astype(self.dtype)

    def write_rows(self, keys, values, rows, end=None):
        self.kv[:, :, rows] = mx.concatenate([keys, values]).astype(self.dtype)

    def read(self, length):
        kv = self.kv[:, :, :length].astype(self.spec.dtype)
        return kv[:1], kv[1:]

    def set_committed(self, count):
        self.committed = count

    def keep(self, index, start=0):
        self.kv[:, :, start:start + index.shape[0]] = mx.take(self.kv, index, axis=2)

    def fork(self, index, capacity):
        new = StackedStore(self.spec, self.dtype)
        new.grow(capacity)
        new.kv[:, :, :index.shape[0]] = mx.take(self.kv, index, axis=2)
        return new

    @property
    def nbytes(self):
        return 0 if self.kv is None else self.kv.nbytes

    def state(self):
        return [] if self.kv is None else [self.kv]

    def to_arrays(self, rows):
        return {"kv": self.kv[:, :, :rows]}

    def load_arrays(self, arrays, rows):
        kv = arrays.get("kv")
        if kv is None or kv.shape != (2, self.spec.kv_heads, rows, self.spec.head_dim) or kv.dtype != self.dtype:
            raise ValueError("not this store's arrays")
        self.kv[:, :, :rows] = kv


STORAGES = {"float": KVStorage(), "stacked": KVStorage(StackedStore),
            "stacked-f16": KVStorage(StackedStore, dtype=mx.float16),
            "q8": KVStorage(QuantizedStore, bits=8, group_size=64), "q4": KVStorage(QuantizedStore, bits=4, group_size=32)}
SPEC = CacheSpec(layers=1, kv_heads=2, head_dim=64, dtype=mx.float32, held=range(1))


def rows_of(first, n):
    """(1, 2, n, 64) keys and values of rows first.., multiples of 17 within
    +-255 with 0 and +-255 in every group of 32: exact in float16 and as 8- or
    4-bit codes (scale 1 or 17), so every store reads back what it was given."""
    r = mx.arange(first, first + n)[None, None, :, None]
    k = (17 * ((7 * r + 5 * mx.arange(2)[None, :, None, None] + 3 * mx.arange(64)) % 16)).astype(mx.float32)
    return k, -k


@pytest.mark.parametrize("paths", ["cpu", "gpu"])
@pytest.mark.parametrize("name", STORAGES)
def test_a_store_keeps_the_interfaces_contract(name, paths, set_paths):
    """Write (a range, given rows), read, grow, attend, commit, keep, fork,
    bytes and the named arrays, told what is committed as CommittedCache
    tells it: what the cache relies on of any store."""
    from refusion_mlx.models.cpu_paths import attend, attention_mask

    set_paths(paths)
    storage = STORAGES[name]
    store = storage.new(SPEC)
    assert store.capacity == 0 and store.nbytes == 0
    store.grow(4)
    store.write(*rows_of(0, 4), start=0)
    store.grow(8)  # growth keeps every row
    assert store.capacity == 8 and store.nbytes >= 8 * storage.row_bytes(SPEC)
    store.write_rows(*rows_of(10, 2), rows=mx.array([6, 4]), end=8)
    expect = np.zeros((1, 2, 8, 64), np.float32)
    expect[:, :, :4] = np.array(rows_of(0, 4)[0])
    expect[:, :, [6, 4]] = np.array(rows_of(10, 2)[0])
    q = mx.random.normal((1, 4, 2, 64), key=mx.random.key(0)) / 64
    mask = attention_mask("causal", 2, 5, 4, 2, mx.float32)
    for committed in (0, 8):  # the rows as passes wrote them, then as committed rows
        store.set_committed(committed)
        keys, values = store.read(8)
        assert keys.shape == values.shape == (1, 2, 8, 64) and keys.dtype == SPEC.dtype
        assert np.array_equal(np.array(keys), expect) and np.array_equal(np.array(values), -expect)
        assert np.array_equal(np.array(store.read(3)[0]), expect[:, :, :3])
        assert np.allclose(np.array(store.attend(q, mask, 5)), np.array(attend(q, *store.read(5), mask)), atol=1e-4)
    assert store.nbytes == 8 * storage.row_bytes(SPEC)  # all committed: no rows held besides

    fork = store.fork(mx.array([4, 0, 1], dtype=mx.int32), 4)
    fork.set_committed(3)
    assert type(fork) is type(store) and fork.capacity == 4
    assert np.array_equal(np.array(fork.read(3)[0]), expect[:, :, [4, 0, 1]])
    fork.write(*rows_of(20, 1), start=3)
    fork.set_committed(4)
    assert np.array_equal(np.array(fork.read(4)[0][:, :, 3]), np.array(rows_of(20, 1)[0])[:, :, 0])
    assert np.array_equal(np.array(store.read(8)[0]), expect)  # the source is untouched

    store.keep(mx.array([2, 0], dtype=mx.int32))
    store.set_committed(2)
    assert np.array_equal(np.array(store.read(2)[1]), -expect[:, :, [2, 0]])

    arrays = fork.to_arrays(3)
    assert arrays
    loaded = storage.new(SPEC)
    loaded.grow(3)
    loaded.load_arrays(arrays, 3)
    loaded.set_committed(3)
    assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(loaded.read(3), fork.read(3)))
    for wrong in ({}, fork.to_arrays(2)):
        with pytest.raises(ValueError):
            storage.new(SPEC).load_arrays(wrong, 3)


@pytest.mark.parametrize("name", STORAGES)
@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 5, 7, 8], [0, 1, 2, 4, 3], [2, 0, 1], [0, 1, 2, 3]],
                         ids=["interleaved-tail", "position-order", "all-moved", "prefix"])
def test_keep_copies_only_the_rows_that_move(name, rows, monkeypatch):
    """CommittedCache.keep leaves the leading rows already in place alone:
    every store gathers only the rows from the first moved one on (none for
    a prefix), and the kept rows read back as a gather of all of them would."""
    cache = CommittedCache(CacheSpec(layers=2, kv_heads=2, head_dim=64, dtype=mx.float32, held=range(2)),
                           growth=16, storage=STORAGES[name])
    write = cache.extend(10)
    for layer in range(2):
        write.layer(layer).update(*rows_of(10 * layer, 10))
    positions = [0, 1, 2, 3, 6, 4, 9, 5, 7, 8]
    cache.commit(list(range(100, 110)), positions)
    before = [[np.array(a) for a in s.read(10)] for s in cache.stores]
    gathered = []
    take = mx.take

    def counting_take(a, index, axis=None, **kw):
        gathered.append(index.shape[0])
        return take(a, index, axis=axis, **kw)

    monkeypatch.setattr(mx, "take", counting_take)
    cache.keep(rows)
    monkeypatch.undo()
    start = next((i for i, r in enumerate(rows) if r != i), len(rows))
    assert set(gathered) == ({len(rows) - start} if start < len(rows) else set())
    assert cache.tokens == [100 + r for r in rows] and cache.positions == [positions[r] for r in rows]
    assert all(cache.token_at(positions[r]) == 100 + r for r in rows)
    assert all(cache.token_at(p) is None for r, p in enumerate(positions) if r not in rows)
    for store, (keys, values) in zip(cache.stores, before):
        assert np.array_equal(np.array(store.read(len(rows))[0]), keys[:, :, rows])
        assert np.array_equal(np.array(store.read(len(rows))[1]), values[:, :, rows])


def test_each_kind_of_store_names_its_form_and_row_cost():
    """What memory admission and the prompt-cache fingerprint ask, with no buffer made."""
    assert STORAGES["float"].describe(SPEC) == str(mx.float32)  # the float store's files keep their fingerprint
    assert len({s.describe(SPEC) for s in STORAGES.values()}) == len(STORAGES)
    assert STORAGES["float"].row_bytes(SPEC) == STORAGES["stacked"].row_bytes(SPEC) == 2 * 2 * 64 * 4
    assert STORAGES["stacked-f16"].row_bytes(SPEC) == 2 * 2 * 64 * 2
    # codes, then a float32 scale and bias per group: 64 + 8 bytes a head at 8 bits, 32 + 2 * 8 at 4 in groups of 32
    assert STORAGES["q8"].row_bytes(SPEC) == 2 * 2 * (64 + 8) and STORAGES["q4"].row_bytes(SPEC) == 2 * 2 * (32 + 16)
    # the rows a pass writes are kept in float besides until committed; the float stores write into their rows
    assert [STORAGES[n].scratch_row_bytes(SPEC) for n in ("float", "stacked", "q8")] == [0, 0, 2 * 2 * 64 * 4]


def golden_params(case):
    from refusion_mlx.decode.params import RefusionParams

    return RefusionParams(gen_length=case["gen_length"], slot_size=case["slot_size"],
                          serial_num_blocks=case["serial_num_blocks"],
                          slot_threshold=case["slot_threshold"], token_threshold=case["token_threshold"])


@pytest.mark.parametrize("paths", ["cpu", "gpu"])
def test_a_sibling_store_plugs_into_the_cache(demo, golden_cases, set_paths, paths):
    """A cache of StackedStores decodes golden cases token-exact, alone and
    batched (both ways a batch attends); then fork, keep and the named
    arrays round-trip, and a file of another stored form is refused."""
    from refusion_mlx.decode.batch import BatchGenerator
    from refusion_mlx.decode.decoder import RefusionDecoder

    set_paths(paths)
    model, tokenizer = demo
    storage = KVStorage(StackedStore)
    cases = [golden_cases[i] for i in (0, 9, 17, 26)]
    alone = CommittedCache.for_model(model, storage=storage)
    decoder = RefusionDecoder(model, cases[0]["prompt_ids"], golden_params(cases[0]),
                              mask_id=model.args.mask_token_id, eos_id=tokenizer.eos_token_id, cache=alone)
    for _ in decoder.steps():
        pass
    assert decoder.response() == cases[0]["output_ids"]

    gen = BatchGenerator(model, tokenizer, max_batch=len(cases))
    caches = [CommittedCache.for_model(model, storage=storage) for _ in cases]
    uids = [gen.insert(c["prompt_ids"], golden_params(c), cache=cache) for c, cache in zip(cases, caches)]
    out = {uid: [] for uid in uids}
    while gen.has_work:
        for r in gen.step():
            out[r.uid] += r.tokens
    assert [out[uid] for uid in uids] == [c["output_ids"] for c in cases]

    cache = caches[1]
    held = [s for s in cache.stores if s is not None]
    assert all(type(s) is StackedStore and s.committed == len(cache) for s in held)
    assert cache.nbytes == len(held) * cache.capacity * storage.row_bytes(cache.spec)
    rows = [r for _, r, _ in cache.in_position_order()]
    fork = cache.fork(rows)
    assert fork.tokens == [cache.tokens[r] for r in rows] and fork.storage is storage
    assert all(s.committed == len(fork) for s in fork.stores if s is not None)
    arrays = fork.to_arrays()
    assert {"tokens", "positions", "kv.0"} <= set(arrays) and "keys.0" not in arrays
    loaded = CommittedCache.for_model(model, storage=storage)
    loaded.load_arrays(arrays)
    assert loaded.tokens == fork.tokens and loaded.positions == fork.positions
    for a, b in zip(loaded.stores, fork.stores):
        assert np.array_equal(np.array(a.read(len(fork))[0]), np.array(b.read(len(fork))[0]))
    fork.keep(list(range(len(fork) - 1, -1, -1)))  # every row, reversed
    assert fork.tokens == loaded.tokens[::-1]
    assert np.array_equal(np.array(fork.stores[1].read(len(fork))[1]),
                          np.array(loaded.stores[1].read(len(loaded))[1])[:, :, ::-1])

    from refusion_mlx.serve.core.memory import kv_row_bytes

    spec = model.cache_spec()  # admission counts every layer at the storage's row cost
    assert kv_row_bytes(model) == spec.layers * 2 * spec.kv_heads * spec.head_dim * 4
    assert kv_row_bytes(model, KVStorage(StackedStore, dtype=mx.float16)) * 2 == kv_row_bytes(model)
    half = CommittedCache.for_model(model, storage=KVStorage(StackedStore, dtype=mx.float16))
    with pytest.raises(ValueError):  # float32 rows are not a float16 store's
        half.load_arrays(arrays)
    assert len(half) == 0 and half.capacity == 0 and half.nbytes == 0
    with pytest.raises(ValueError):  # nor a float store's
        CommittedCache.for_model(model).load_arrays(arrays)


def test_prompt_cache_files_come_back_only_in_the_form_they_were_stored(demo, tmp_path):
    """The files' fingerprint names the stored form: entries written by
    StackedStores reload as such, and a float-store server skips them."""
    from refusion_mlx.decode.prefill import prefill as run_prefill
    from refusion_mlx.serve.caches.cache_files import attach
    from refusion_mlx.serve.caches.prompt_cache import PromptCache

    model, _ = demo
    storage = KVStorage(StackedStore)
    writer = PromptCache(1 << 30)
    attach(writer, model, tmp_path, 1 << 30, storage=storage)
    cache = CommittedCache.for_model(model, storage=storage)
    run_prefill(model, cache, [5, 6, 7, 8, 9])
    writer.insert(cache)
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    same, plain = PromptCache(1 << 30), PromptCache(1 << 30)
    attach(same, model, tmp_path, 1 << 30, storage=storage)
    attach(plain, model, tmp_path, 1 << 30)
    assert len(same) == 1 and len(plain) == 0
    (entry,) = same.entries.values()
    assert entry.tokens == [5, 6, 7, 8, 9] and all(type(s) is StackedStore for s in entry.stores if s is not None)


def test_a_prompt_cache_entry_holds_its_rows_alone(demo, tmp_path):
    """A short chat's entry is its rows, not a 256-row growth step: an 8 MiB
    budget kept 8 entries of 30 tokens (1 MiB each); restored from its file too.
    A request continuing it gets whole growth steps again, to grow in."""
    from refusion_mlx.decode.prefill import prefill as run_prefill
    from refusion_mlx.serve.caches.cache_files import attach
    from refusion_mlx.serve.caches.prompt_cache import PromptCache

    model, _ = demo
    cache = CommittedCache.for_model(model)
    run_prefill(model, cache, list(range(5, 35)))
    row_bytes = cache.nbytes // cache.capacity
    entries = PromptCache(1 << 30)
    attach(entries, model, tmp_path, 1 << 30)
    entries.insert(cache)
    (entry,) = entries.entries.values()
    assert cache.capacity == cache.growth and entry.capacity == 30 and entry.nbytes == 30 * row_bytes
    assert entries.nbytes == 30 * row_bytes
    reread = PromptCache(1 << 30)
    attach(reread, model, tmp_path, 1 << 30)
    (restored,) = reread.entries.values()
    assert restored.nbytes == 30 * row_bytes and restored.tokens == list(range(5, 35))
    n, continued = entries.lookup(list(range(5, 40)))
    assert n == 30 and continued.capacity == continued.growth


def test_a_prompt_cache_entry_is_never_a_prefix_of_another(demo, tmp_path):
    """A cache whose rows an entry holds already (a shorter conversation, left after a longer one) adds
    nothing, in memory or on disk, and marks that entry used; a restart reloads the same entries (a prefix
    file newer than its extension was dropped on reload: 4 of 423 entries in a soak)."""
    from refusion_mlx.decode.prefill import prefill as run_prefill
    from refusion_mlx.serve.caches.cache_files import attach
    from refusion_mlx.serve.caches.prompt_cache import PromptCache

    model, _ = demo

    def prefilled(ids):
        cache = CommittedCache.for_model(model)
        run_prefill(model, cache, ids)
        return cache

    entries = PromptCache(1 << 30)
    attach(entries, model, tmp_path, 1 << 30)
    entries.insert(prefilled(list(range(5, 40))))
    entries.insert(prefilled(list(range(60, 70))))
    entries.insert(prefilled(list(range(5, 20))))  # the first entry's first 15 rows
    keys = list(entries.entries)
    assert [len(k[1]) for k in keys] == [10, 35]  # no new entry; the one holding its rows is the most recent
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    assert entries.lookup(list(range(5, 20)) + [3])[0] == 15
    reread = PromptCache(1 << 30)
    attach(reread, model, tmp_path, 1 << 30)
    assert list(reread.entries) == keys


def test_an_entry_over_the_budget_is_not_kept_and_evicts_nothing(demo, tmp_path):
    """One entry larger than --prompt-cache-bytes (or the folder's budget) emptied the cache, memory and disk."""
    from refusion_mlx.decode.prefill import prefill as run_prefill
    from refusion_mlx.serve.caches.cache_files import attach
    from refusion_mlx.serve.caches.prompt_cache import PromptCache

    model, _ = demo

    def prefilled(ids):
        cache = CommittedCache.for_model(model)
        run_prefill(model, cache, ids)
        return cache

    small = prefilled(list(range(5, 25)))
    budget = small.nbytes // small.capacity * 40  # 40 rows
    entries = PromptCache(budget)
    attach(entries, model, tmp_path, budget)
    entries.insert(small)
    entries.insert(prefilled(list(range(30, 90))))  # 60 rows
    assert [len(k[1]) for k in entries.entries] == [20]
    assert len(list(tmp_path.glob("*.safetensors"))) == 1


def test_the_prompt_cache_index_answers_as_a_scan_of_its_sequences():
    """serve/caches/token_trie.py against a scan of the sequences it holds, through random adds and
    removes (sequences that begin others included): the longest shared prefix, a sequence that begins
    with a query, those a query begins with; no node but the root is left empty or with one edge."""
    import random

    from refusion_mlx.decode.prefix import prefix_length
    from refusion_mlx.serve.caches.token_trie import TokenTrie

    def shape(node, root=True):
        assert root or node.end is not None or len(node.edges) > 1
        for token, (run, child) in node.edges.items():
            assert run[0] == token
            shape(child, False)

    rng = random.Random(0)
    for _ in range(40):
        trie, kept = TokenTrie(), set()
        for _ in range(100):
            seq = tuple(rng.randrange(3) for _ in range(rng.randrange(1, 8)))
            if rng.random() < 0.6 and seq not in kept:
                trie.add(seq)
                kept.add(seq)
            elif kept:
                gone = rng.choice(sorted(kept))
                trie.remove(gone)
                kept.discard(gone)
            shape(trie.root)
            query = tuple(rng.randrange(3) for _ in range(rng.randrange(9)))
            n, s = trie.longest(query)
            assert n == max((prefix_length(k, query) for k in kept), default=0) and bool(trie) == bool(kept)
            assert (s is None) == (not kept) and (s is None or s in kept and prefix_length(s, query) == n)
            cover = trie.covering(query)
            assert cover in kept if any(k[:len(query)] == query for k in kept) else cover is None
            assert sorted(trie.prefixes(query)) == sorted(k for k in kept if query[:len(k)] == k)
