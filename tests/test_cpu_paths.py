"""CPU paths: a wide decode pass of a small model runs as two row groups on
two CPU streams (decode/runner.py: row_groups), with the same results; linear
layers are laid out for the BLAS (models/cpu_paths.py: lay_out_linears): weights
stored (in, out), or kept (out, in) and multiplied weight-major under threaded MKL."""

import mlx.core as mx
import numpy as np
import pytest

from refusion_mlx import _blas
from refusion_mlx.decode import forward as forward_module
from refusion_mlx.decode.batch import batch_generate
from refusion_mlx.decode.cache import CommittedCache
from refusion_mlx.decode.decoder import RefusionDecoder
from refusion_mlx.decode import runner
from refusion_mlx.models import cpu_paths
from refusion_mlx.models.projections import hf_parameters

from tests.helpers import FIXTURE_MODEL, decode_hidden
from tests.test_backend import params_of


@pytest.fixture
def two_cores(monkeypatch, set_paths):
    """CPU paths, a small model's one BLAS thread, two cores."""
    set_paths("cpu")
    monkeypatch.setattr(_blas, "_small_model", True)
    monkeypatch.setattr(runner.os, "cpu_count", lambda: 2)


@pytest.fixture
def splits(monkeypatch):
    """Count the passes that ran as more than one row group."""
    seen = []
    real = runner.row_groups

    def counting(write, rows):
        groups = real(write, rows)
        seen.append(len(groups))
        return groups

    monkeypatch.setattr(runner, "row_groups", counting)
    return seen


def committed(model, n=24):
    cache = CommittedCache.for_model(model)
    cache.reserve(256)
    write = cache.extend(n)
    mx.eval(decode_hidden(model, mx.arange(3, 3 + n)[None], mx.arange(n), write))
    cache.commit(list(range(3, 3 + n)), list(range(n)))
    return cache


def test_wide_causal_passes_split_in_two(demo, two_cores):
    cache = committed(demo[0])
    groups = runner.row_groups(cache.extend(100), 100)
    assert [(lo, hi) for lo, hi, _, _ in groups] == [(0, 55), (55, 100)]
    first, second = groups[0][2], groups[1][2]
    assert (first.start, first.visible) == (24, 24 + 55)  # sees the committed rows and itself
    assert (second.start, second.visible) == (24 + 55, 124)  # and the first group's rows
    assert groups[0][3] != groups[1][3]  # two streams
    assert len(runner.row_groups(cache.extend(runner.SPLIT_ROWS - 1), runner.SPLIT_ROWS - 1)) == 1


def test_wide_infill_passes_split_between_slots(demo, two_cores):
    """25 slots, windows of 3 (cursor 1): the first group takes whole slots
    (55% of 75 rows is 41, rounded to 14 slots = 42 rows) and sees only the
    committed rows and their own; the second the rest."""
    cache = committed(demo[0])
    whole = cache.infill(25, 4, 1)
    groups = runner.row_groups(whole, 75)
    assert [(lo, hi) for lo, hi, _, _ in groups] == [(0, 42), (42, 75)]
    first, second = groups[0][2], groups[1][2]
    assert (first.slots, second.slots) == ((14, 4, 3), (11, 4, 3))
    assert first.visible == 24 + 14 * 4 and second.visible == whole.visible
    np.testing.assert_array_equal(np.array(first.rows), np.array(whole.rows[:42]))
    np.testing.assert_array_equal(np.array(first.mask), np.array(whole.mask[:42, :first.visible]))
    np.testing.assert_array_equal(np.array(second.mask), np.array(whole.mask[42:]))
    assert not np.array(second.mask)[:, 24:first.visible].any()  # never the first group's slots
    assert cache.infill(1, 4, 0).split(2) is None  # one slot: nothing to cut


def test_no_split_on_the_gpu_paths_a_big_model_or_one_core(demo, two_cores, set_paths, monkeypatch):
    cache = committed(demo[0])
    monkeypatch.setattr(runner.os, "cpu_count", lambda: 1)
    assert len(runner.row_groups(cache.extend(100), 100)) == 1
    monkeypatch.setattr(runner.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(_blas, "_small_model", False)
    assert len(runner.row_groups(cache.extend(100), 100)) == 1
    monkeypatch.setattr(_blas, "_small_model", True)
    set_paths("gpu")
    assert len(runner.row_groups(cache.extend(100), 100)) == 1


def split_and_whole(model, monkeypatch, splits, tokens, make_write):
    """A pass run split, then in one group, each over a fresh cache: the
    outputs (hidden states, a layer's keys, another's values) must agree to
    float32 rounding."""
    outputs = []
    for split_rows in (runner.SPLIT_ROWS, 10**9):
        monkeypatch.setattr(runner, "SPLIT_ROWS", split_rows)
        cache = committed(model)
        n = tokens.shape[1]
        hidden = decode_hidden(model, tokens, mx.arange(24, 24 + n), make_write(cache))
        mx.eval(hidden, cache.state())
        rows = cache.capacity
        outputs.append((np.array(hidden), np.array(cache.stores[2].read(rows)[0]), np.array(cache.stores[3].read(rows)[1])))
    assert splits == [1, 2, 1, 1]  # (the committed rows, then the pass) twice
    for split, whole in zip(*outputs):
        np.testing.assert_allclose(split, whole, rtol=1e-5, atol=1e-5)


def test_a_split_pass_computes_what_one_group_does(demo, two_cores, monkeypatch, splits):
    split_and_whole(demo[0], monkeypatch, splits, mx.array([[805] * 90 + [17] * 6]), lambda c: c.extend(96))


def test_a_split_infill_pass_computes_what_one_group_does(demo, two_cores, monkeypatch, splits):
    split_and_whole(demo[0], monkeypatch, splits, mx.array([[805, 17, 18, 805] * 16]),
                    lambda c: c.infill(16, 4, 0))


def wrong_alone(model, tokenizer, cases):
    """The golden cases (indices) that decode otherwise, each alone."""
    wrong = []
    for i, case in enumerate(cases):
        decoder = RefusionDecoder(model, case["prompt_ids"], params_of(case),
                                  mask_id=model.args.mask_token_id, eos_id=tokenizer.eos_token_id)
        for _ in decoder.steps():
            pass
        if decoder.response() != case["output_ids"]:
            wrong.append(i)
    return wrong


def wrong_batched(model, tokenizer, cases):
    """The golden cases that decode otherwise, all in one batch."""
    results = batch_generate(model, tokenizer, [c["prompt_ids"] for c in cases], [params_of(c) for c in cases],
                             max_batch=len(cases))
    return [i for i, (r, c) in enumerate(zip(results, cases)) if r.output_ids != c["output_ids"]]


def test_golden_cases_stay_token_exact_when_split(demo, golden_cases, two_cores, monkeypatch, splits):
    """Every pass from 8 tokens on split: each case alone and all in one batch
    (a batch's packed passes split between requests)."""
    monkeypatch.setattr(runner, "SPLIT_ROWS", 8)
    model, tokenizer = demo
    assert wrong_alone(model, tokenizer, golden_cases) == []
    assert splits.count(2) > len(golden_cases)
    alone = len(splits)
    assert wrong_batched(model, tokenizer, golden_cases) == []
    assert splits[alone:].count(2) > 10  # the batch's steps ran split too


def test_a_batch_splits_between_requests(demo, two_cores):
    """A packed batch is cut at the request boundary nearest 55% of its rows;
    each half keeps its requests' own writes."""
    from refusion_mlx.decode.packed import PackedWrite

    caches = [committed(demo[0]) for _ in range(3)]
    writes = [caches[0].extend(30), caches[1].infill(5, 4, 0), caches[2].extend(40)]
    packed = PackedWrite(writes, [30, 20, 40])
    groups = runner.row_groups(packed, 90)
    assert [(lo, hi) for lo, hi, _, _ in groups] == [(0, 50), (50, 90)]
    assert [w for w, _, _ in groups[0][2].segments] == writes[:2]
    assert [(w, a, b) for w, a, b in groups[1][2].segments] == [(writes[2], 0, 40)]
    assert PackedWrite(writes[:1], [30]).split(15) is None  # one request: its own write splits, if any


def test_a_step_cuts_its_rows_once(demo, two_cores, splits):
    """run_passes makes the row groups and the runner runs those: no second cut."""
    model = demo[0]
    cache = committed(model)
    splits.clear()
    p = forward_module.Pass("plan", mx.full((80,), 805), mx.arange(24, 104), cache.extend(80))
    forward_module.run_passes(model, [p])
    assert splits == [2]


def test_split_passes_run_with_one_blas_thread(demo, two_cores, monkeypatch):
    """Each group's stream has a core: the BLAS keeps one thread for a split
    pass (a plan, an infill, a batch's packed passes), and takes every core
    for a wide pass that cannot split (one 64-token slot)."""
    model = demo[0]
    cache, other = committed(model), committed(model)  # their prompts' passes fit the threads too: before
    calls = []
    monkeypatch.setattr(_blas, "_set_threads", lambda n: calls.append(n) or n)
    p = forward_module.Pass("plan", mx.full((80,), 805), mx.arange(24, 104), cache.extend(80))
    forward_module.run_passes(model, [p])
    p = forward_module.Pass("infill_draft", mx.full((80,), 805), mx.arange(24, 104), cache.infill(20, 4, 0))
    forward_module.run_passes(model, [p])
    q = forward_module.Pass("plan", mx.full((40,), 805), mx.arange(24, 64), other.extend(40))
    forward_module.run_passes(model, [p, q])
    p = forward_module.Pass("infill_draft", mx.full((64,), 805), mx.arange(24, 88), cache.infill(1, 64, 0))
    forward_module.run_passes(model, [p])
    assert calls == [1, 1, 1, 2]


def test_each_thread_splits_on_its_own_streams(demo, two_cores):
    """MLX's streams belong to the thread that made them: a pass split on one
    thread (a server's decoding thread) and then on another still runs."""
    import threading

    model = demo[0]
    results = []

    def run():
        cache = committed(model)
        hidden = decode_hidden(model, mx.full((1, 64), 805), mx.arange(24, 88), cache.extend(64))
        results.append(np.array(hidden))

    run()
    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert len(results) == 2
    np.testing.assert_array_equal(results[0], results[1])


def test_cpu_paths_lay_linear_weights_out_in_by_out(set_paths, monkeypatch):
    """``cpu_paths.store_weights_transposed`` (at load, CPU paths): each plain linear weight is
    the transposed view of a row-major (in, out) buffer, so ``x @ weight.T``
    reads it row by row; the values are unchanged, and mlx-lm's side of the
    bench gets row-major copies of the column slices it could not read in place."""
    from mlx.utils import tree_flatten

    from refusion_mlx.bench.runs import share_weights
    from refusion_mlx.models.loading import load
    from refusion_mlx.models.projections import Linear

    set_paths("cpu")  # what the CPU paths do at load, whatever paths the run takes
    monkeypatch.setattr(_blas, "mkl_threads", lambda: 1)  # one BLAS thread (the demo model's, fit_threads)
    model, _ = load(FIXTURE_MODEL, dtype="float32")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and not any(layer.weight_major for layer in linears)
    for layer in linears:
        out_dim, in_dim = layer.weight.shape
        assert memoryview(layer.weight).strides == (4, 4 * out_dim)  # float32, column-major
    before = {k: np.array(v) for k, v in hf_parameters(model).items()}
    assert cpu_paths.store_weights_transposed(model) == len(linears)  # again: the same values
    for k, v in hf_parameters(model).items():
        np.testing.assert_array_equal(np.array(v), before[k])

    from mlx_lm.utils import load_model as ar_load_model

    ar_model, _ = ar_load_model(model.model_path, lazy=True)
    share_weights(ar_model, model)
    q = dict(tree_flatten(ar_model.parameters()))["model.layers.0.self_attn.q_proj.weight"]
    assert memoryview(q).strides == (4 * q.shape[1], 4)  # row-major, as mlx_lm.load gives it
    tokens = mx.array([[10, 11, 12, 13]])
    ours = model(tokens, mx.arange(4))
    np.testing.assert_allclose(np.array(ar_model(tokens)), np.array(ours), atol=1e-4)


@pytest.fixture
def weight_major_calls(monkeypatch):
    """The rows of every weight-major matmul built (``projections.weight_major_matmul``)."""
    from refusion_mlx.models import projections

    rows, real = [], projections.weight_major_matmul

    def counting(x, weight):
        rows.append(x.size // x.shape[-1])
        return real(x, weight)

    monkeypatch.setattr(projections, "weight_major_matmul", counting)
    return rows


@pytest.mark.parametrize("threads, layout", [(None, "transposed"), (1, "transposed"), (2, "weight-major")])
def test_linears_go_weight_major_where_mkl_has_threads(set_paths, monkeypatch, weight_major_calls, threads, layout):
    """MKL on two or more threads (``_blas.mkl_threads``): each linear keeps its (out, in) row-major weight and
    multiplies a pass of 2+ rows as ``(w @ x.T).T``, one row as ``x @ w.T``; the same forward either way.
    Another BLAS (None) or one thread: the weights stored (in, out), nothing weight-major."""
    from refusion_mlx.models.loading import load
    from refusion_mlx.models.projections import Linear

    set_paths("cpu")
    monkeypatch.setattr(_blas, "mkl_threads", lambda: 1)
    plain, _ = load(FIXTURE_MODEL, dtype="float32")
    monkeypatch.setattr(_blas, "mkl_threads", lambda: threads)
    model, _ = load(FIXTURE_MODEL, dtype="float32")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert {m.weight_major for m in linears} == {layout == "weight-major"}
    out_dim, in_dim = linears[0].weight.shape
    row_major = (4 * in_dim, 4)
    assert (memoryview(linears[0].weight).strides == row_major) == (layout == "weight-major")
    assert weight_major_calls == []
    for rows in (1, 4, 16):
        tokens = mx.arange(10, 10 + rows)[None]
        np.testing.assert_allclose(np.array(model(tokens, mx.arange(rows))), np.array(plain(tokens, mx.arange(rows))),
                                   rtol=1e-4, atol=1e-4)
    # 4 and 16 rows: every linear of every layer and the head, weight-major; one row: none
    assert weight_major_calls == ([4] * len(linears) + [16] * len(linears) if layout == "weight-major" else [])


def test_a_tied_head_goes_weight_major_with_its_linears(set_paths, monkeypatch, weight_major_calls):
    """A model whose embedding is its head (the bench's tied shapes, laid out as loading does): 2+ rows of
    the head weight-major, the same logits as ``as_linear``; its gradient through either is the same."""
    from refusion_mlx.bench.shapes import build_models

    set_paths("cpu")
    monkeypatch.setattr(_blas, "mkl_threads", lambda: 2)
    model, _ = build_models("tiny", ar=False)
    embedding = model.model.embed_tokens
    assert model.args.tie_word_embeddings and embedding.weight_major
    h = mx.random.normal((1, 5, model.args.hidden_size))
    np.testing.assert_allclose(np.array(model.head(h)), np.array(embedding.as_linear(h)), rtol=1e-5, atol=1e-5)
    assert weight_major_calls == [5]
    model.head(h[:, :1])
    assert weight_major_calls == [5]  # one row: as_linear

    layer = next(m for m in model.modules() if getattr(m, "weight_major", False) and "weight" in m and m is not embedding)
    x = mx.random.normal((3, layer.weight.shape[1]))

    def loss(weight, x):
        layer.weight = weight
        return (layer(x) ** 2).sum()

    grads = mx.grad(loss, argnums=(0, 1))(layer.weight, x)
    layer.weight_major = False
    plain = mx.grad(loss, argnums=(0, 1))(layer.weight, x)
    for a, b in zip(grads, plain):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-5)


def test_golden_cases_stay_token_exact_weight_major(golden_cases, set_paths, monkeypatch, weight_major_calls):
    """The demo model laid out weight-major (as on a machine whose MKL runs it on several threads):
    every golden case alone and all in one batch, token for token."""
    from refusion_mlx.models.loading import load

    set_paths("cpu")
    monkeypatch.setattr(_blas, "mkl_threads", lambda: 2)
    model, tokenizer = load(FIXTURE_MODEL, dtype="float32")
    assert wrong_alone(model, tokenizer, golden_cases) == [] and weight_major_calls
    assert wrong_batched(model, tokenizer, golden_cases) == []
