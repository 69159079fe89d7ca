"""A batch's attention (decode/packed.py): on the GPU paths one kernel call
per layer over a padded batch, with the same results as each pass alone."""

import mlx.core as mx
import numpy as np

from refusion_mlx.decode import forward as forward_module
from refusion_mlx.decode.cache import CommittedCache
from refusion_mlx.decode.decoder import RefusionDecoder
from refusion_mlx.decode.forward import forward, run_passes
from refusion_mlx.decode.packed import PackedWrite
from refusion_mlx.decode.params import RefusionParams

# (golden case, passes run before): a prefill (51 rows, causal), a plan
# (40 rows, causal), two infill drafts (28 and 24 rows, block-diagonal masks)
# over 49 to 71 visible rows: every length and view differs
MIX = [(3, 0), (6, 2), (1, 2), (10, 4)]


def pending_pass(model, tokenizer, case, before: int):
    """A fresh decoder of ``case`` (its own cache), after ``before`` passes: its next pass."""
    params = RefusionParams(gen_length=case["gen_length"], slot_size=case["slot_size"],
                            serial_num_blocks=case["serial_num_blocks"],
                            slot_threshold=case["slot_threshold"], token_threshold=case["token_threshold"])
    decoder = RefusionDecoder(model, case["prompt_ids"], params, mask_id=model.args.mask_token_id,
                              eos_id=tokenizer.eos_token_id)
    for _ in range(before):
        decoder.take(run_passes(model, [decoder.next_pass()])[0])
    return decoder.next_pass()


def pending_passes(model, tokenizer, golden_cases):
    return [pending_pass(model, tokenizer, golden_cases[i], before) for i, before in MIX]


def count_kernel_calls(monkeypatch):
    calls = []
    kernel = mx.fast.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", counted)
    return calls


def test_gpu_paths_attend_a_batch_in_one_kernel_call_per_layer(demo, golden_cases, set_paths, monkeypatch):
    set_paths("gpu")
    model, tokenizer = demo
    passes = pending_passes(model, tokenizer, golden_cases)
    lengths = [len(p) for p in passes]
    assert len(set(lengths)) == len(passes) and sum(p.write.rows is not None for p in passes) == 2
    alone = [forward(model, [p]) for p in passes]  # each pass by itself (writes the same K/V rows)
    mx.eval(alone)

    calls = count_kernel_calls(monkeypatch)
    assert PackedWrite([p.write for p in passes], lengths).batched  # the GPU paths' default
    packed = forward(model, passes)
    mx.eval(packed)
    layers = model.args.num_hidden_layers
    assert len(calls) == layers
    assert set(calls) == {(len(passes), model.args.num_attention_heads, max(lengths), model.args.head_dim)}

    np.testing.assert_allclose(np.array(packed), np.concatenate([np.array(a) for a in alone]), atol=2e-5)
    logits = [model.head(h).argmax(-1) for h in (packed, mx.concatenate(alone))]
    assert np.array_equal(*map(np.array, logits))

    calls.clear()  # the request-by-request way: one call per request per layer, same values
    monkeypatch.setattr(forward_module, "PackedWrite", lambda w, n: PackedWrite(w, n, batched=False))
    each = forward(model, passes)
    mx.eval(each)
    assert len(calls) == layers * len(passes)
    np.testing.assert_allclose(np.array(each), np.array(packed), atol=2e-5)


def test_cpu_paths_keep_the_request_by_request_way(demo, set_paths):
    set_paths("cpu")
    model, _ = demo
    writes = [CommittedCache.for_model(model).extend(n) for n in (3, 5)]
    assert not PackedWrite(writes, [3, 5]).batched
    assert PackedWrite(writes, [3, 5], batched=True).batched


def test_gpu_paths_batch_of_equal_passes_needs_no_padding(demo, golden_cases, set_paths, monkeypatch):
    """Two requests at the same point (one infill draft each, own caches):
    no padding rows, reshapes only; the same hidden states as alone."""
    set_paths("gpu")
    model, tokenizer = demo
    i, before = MIX[2]
    passes = [pending_pass(model, tokenizer, golden_cases[i], before) for _ in range(2)]
    assert passes[0].write.cache is not passes[1].write.cache and len(passes[0]) == len(passes[1])
    alone = forward(model, passes[:1])
    mx.eval(alone)
    packed_write = PackedWrite([p.write for p in passes], [len(p) for p in passes])
    padding = packed_write.padding(model.args.num_attention_heads, model.args.num_key_value_heads, mx.float32)
    assert padding.pad_index is None and padding.unpad_index is None
    calls = count_kernel_calls(monkeypatch)
    packed = forward(model, passes)
    mx.eval(packed)
    assert len(calls) == model.args.num_hidden_layers
    n = len(passes[0])
    np.testing.assert_allclose(np.array(packed[:n]), np.array(alone), atol=2e-5)
    np.testing.assert_allclose(np.array(packed[n:]), np.array(alone), atol=2e-5)


def test_bucket_ladders():
    """Keys read in steps of 256 up to 512, then two lengths an octave (at
    most half as many again as seen); query rows padded to a power of two."""
    from refusion_mlx.models import backend

    assert [backend.key_bucket(n) for n in (1, 256, 257, 512, 513, 768, 769, 1025, 1537, 3000, 4097)] == \
        [256, 256, 512, 512, 768, 768, 1024, 1536, 2048, 3072, 6144]
    for n in range(1, 20000, 7):
        b = backend.key_bucket(n)
        assert n <= b <= max(512, 1.5 * n) and b % 256 == 0 and backend.key_bucket(b) == b
    assert [backend.row_bucket(n) for n in (1, 2, 3, 5, 16, 17, 33)] == [1, 2, 4, 8, 16, 32, 64]


def decode_cases(model, tokenizer, cases, batch: bool):
    from refusion_mlx.decode.batch import batch_generate

    params = [RefusionParams(gen_length=c["gen_length"], slot_size=c["slot_size"],
                             serial_num_blocks=c["serial_num_blocks"], slot_threshold=c["slot_threshold"],
                             token_threshold=c["token_threshold"]) for c in cases]
    if batch:
        return [r.output_ids for r in batch_generate(model, tokenizer, [c["prompt_ids"] for c in cases], params,
                                                     max_batch=len(cases))]
    out = []
    for case, p in zip(cases, params):
        decoder = RefusionDecoder(model, case["prompt_ids"], p, mask_id=model.args.mask_token_id,
                                  eos_id=tokenizer.eos_token_id)
        for _ in decoder.steps():
            pass
        out.append(decoder.response())
    return out


def fused_shapes(monkeypatch):
    """(query shape, key shape, mask dtype) of every fused call of several query rows."""
    calls = []
    kernel = mx.fast.scaled_dot_product_attention

    def counted(q, k, v, **kwargs):
        if q.shape[2] > 1:
            mask = kwargs.get("mask")
            calls.append((q.shape, k.shape, getattr(mask, "dtype", mask)))
        return kernel(q, k, v, **kwargs)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", counted)
    return calls


def test_bucketed_attention_plans_a_few_shapes_and_stays_token_exact(demo, golden_cases, set_paths, monkeypatch):
    """REFUSION_MLX_ATTENTION=bucketed: every fused call of several rows (each
    lone request's passes too) has power-of-two query rows, a bucketed key
    length and an additive mask in the queries' dtype; a whole decode plans
    a handful of shapes, and the answers are the golden ones, alone and batched."""
    from refusion_mlx.models import backend

    monkeypatch.setenv(backend.ATTENTION_ENV, "bucketed")
    set_paths("gpu")
    model, tokenizer = demo
    cases = golden_cases[:6]
    calls = fused_shapes(monkeypatch)
    assert decode_cases(model, tokenizer, cases, batch=False) == [c["output_ids"] for c in cases]
    layers = model.args.num_hidden_layers
    lone = set(calls)
    assert len(calls) >= 10 * layers and len(lone) <= len(calls) // (3 * layers)
    for (B, H, T, D), (_, K, L, _), mask_dtype in lone:
        assert B == 1 and T == backend.row_bucket(T) and L == backend.key_bucket(L) and mask_dtype == mx.float32
    calls.clear()
    assert decode_cases(model, tokenizer, cases, batch=True) == [c["output_ids"] for c in cases]
    assert calls and {c[0][0] for c in calls} > {1}  # batches of several requests, bucketed alike
    assert all(T == backend.row_bucket(T) and L == backend.key_bucket(L) for (_, _, T, _), (_, _, L, _), _ in calls)


def test_bucketed_shapes_past_the_budget_attend_unfused(demo, golden_cases, set_paths, monkeypatch):
    """A thread plans at most half of MLX's SDPA cache (MLX_CUDA_SDPA_CACHE_SIZE)
    in new shapes, so cuDNN never evicts and never reaches its thrashing
    error; past that, new shapes attend unfused, with the same answers."""
    import threading

    from refusion_mlx.models import backend, cpu_paths

    monkeypatch.setenv(backend.ATTENTION_ENV, "bucketed")
    monkeypatch.setenv(backend.SDPA_CACHE_ENV, "4")
    set_paths("gpu")
    model, tokenizer = demo
    cases = golden_cases[6:9]
    calls = fused_shapes(monkeypatch)
    unfused = []
    plain = cpu_paths.unfused_attend
    monkeypatch.setattr(cpu_paths, "unfused_attend", lambda q, *a: unfused.append(q.shape) or plain(q, *a))
    got = []
    worker = threading.Thread(target=lambda: got.append(decode_cases(model, tokenizer, cases, batch=False)))
    worker.start()  # a new thread: nothing planned on it yet
    worker.join()
    assert got == [[c["output_ids"] for c in cases]]
    assert len({(q, k) for q, k, _ in calls}) == 2 and unfused
    assert all(T == backend.row_bucket(T) for _, _, T, _ in unfused)  # still padded, only not fused
