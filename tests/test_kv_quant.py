"""A quantized KV cache (``--kv-bits``, decode/kv_quant.py): rows kept as
computed until committed, decoding at 8 and 4 bits alone and batched on both
device paths, the prompt cache in memory and on disk, memory admission, the
server's /health and /metrics, and the flags' errors. (The store's contract,
shared with the other stores: tests/test_cache.py.)"""

from __future__ import annotations

import json
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from refusion_mlx.decode.cache import CommittedCache
from refusion_mlx.decode.kv_quant import QuantizedStore
from refusion_mlx.decode.kv_store import KVStorage
from refusion_mlx.errors import DecodeError, RefusionError
from refusion_mlx.models.base import CacheSpec

CASES = (0, 5, 10, 17, 25, 30)  # golden cases decoded here (of 32): every slot size and path


def golden_params(case):
    from refusion_mlx.decode.params import RefusionParams

    return RefusionParams(gen_length=case["gen_length"], slot_size=case["slot_size"],
                          serial_num_blocks=case["serial_num_blocks"],
                          slot_threshold=case["slot_threshold"], token_threshold=case["token_threshold"])


def test_a_pass_rows_stay_as_computed_until_committed():
    """Scratch rows are the pass's own arrays, read back exactly (no round
    trip); committing quantizes them once, within half a step of each group."""
    spec = CacheSpec(layers=1, kv_heads=2, head_dim=64, dtype=mx.float32, held=range(1))
    store = QuantizedStore(spec, bits=8, group_size=64)
    store.grow(16)
    keys = mx.random.normal((1, 2, 5, 64), key=mx.random.key(1))
    store.write(keys, -keys, start=0)
    assert store.scratch[0] is keys  # kept, not copied or quantized
    assert np.array_equal(np.array(store.read(5)[0]), np.array(keys))
    held = store.nbytes
    store.set_committed(3)  # three rows committed: quantized now, the other two dropped
    assert store.scratch is None and store.nbytes == held - keys.nbytes * 2
    got = np.array(store.read(3)[0])
    step = (np.array(keys[:, :, :3]).max(-1) - np.array(keys[:, :, :3]).min(-1)) / 255
    error = np.abs(got - np.array(keys[:, :, :3])).max(-1)
    assert (error <= step / 2 + 1e-6).all() and error.max() > 0  # quantized, within half a step


@pytest.mark.parametrize("paths", ["cpu", "gpu"])
def test_dequantize_is_mlx_dequantize(paths, set_paths):
    """The CPU paths read the codes' bytes themselves: the same numbers as mx.dequantize."""
    from refusion_mlx.decode.kv_quant import dequantize

    set_paths(paths)
    x = mx.random.normal((2, 3, 5, 128), key=mx.random.key(2)).astype(mx.bfloat16)
    for bits in (8, 4):
        for group in (32, 64, 128):
            codes = mx.quantize(x, group_size=group, bits=bits)
            got, want = dequantize(codes, bits, group), mx.dequantize(*codes, group_size=group, bits=bits)
            assert got.dtype == want.dtype and np.array_equal(np.array(got.astype(mx.float32)),
                                                             np.array(want.astype(mx.float32)))


@pytest.mark.parametrize("paths, bits", [("cpu", 8), ("gpu", 8), ("gpu", 4)])
def test_quantized_decoding_alone_and_batched(demo, golden_cases, set_paths, paths, bits):
    """Golden cases decoded with quantized caches, alone and in one batch
    (the GPU paths' padded batch reads the codes through
    ``kv_quant.batched_attend``; the CPU paths' batch runs each request's
    own attention, as alone): token for token the same, since the same
    codes are read. At 8 bits they agree with float on most cases (all 32 on
    this machine's CPU, both paths: docs/benchmarks.md); at 4 bits they run
    (on the CPU paths too: the chat test below)."""
    from refusion_mlx.decode.batch import BatchGenerator
    from refusion_mlx.decode.decoder import RefusionDecoder

    set_paths(paths)
    model, tokenizer = demo
    cases = [golden_cases[i] for i in CASES]
    storage = KVStorage.of(bits, model=model)
    alone = []
    for c in cases:
        cache = CommittedCache.for_model(model, storage=storage)
        d = RefusionDecoder(model, c["prompt_ids"], golden_params(c), mask_id=model.args.mask_token_id,
                            eos_id=tokenizer.eos_token_id, cache=cache)
        for _ in d.steps():
            pass
        alone.append(d.response())
        held = [s for s in cache.stores if s is not None]
        assert all(isinstance(s, QuantizedStore) and s.committed == len(cache) for s in held)
    gen = BatchGenerator(model, tokenizer, max_batch=len(cases), storage=KVStorage.of(bits))
    uids = [gen.insert(c["prompt_ids"], golden_params(c)) for c in cases]
    out = {uid: [] for uid in uids}
    while gen.has_work:
        for r in gen.step():
            assert r.error is None
            out[r.uid] += r.tokens
    assert [out[u] for u in uids] == alone
    assert all(a for a in alone)
    same = sum(a == c["output_ids"] for a, c in zip(alone, cases))
    if bits == 8:
        assert same >= len(cases) - 1


def test_python_api_chat_and_prompt_cache(demo):
    """kv_bits in generate and ChatSession (a conversation continues its
    quantized cache turn after turn); the in-memory prompt cache counts the
    quantized bytes its entries hold."""
    from refusion_mlx.decode.conversation import ChatSession
    from refusion_mlx.decode.stream import generate, stream_generate
    from refusion_mlx.serve.caches.prompt_cache import PromptCache

    model, tokenizer = demo
    assert generate(model, tokenizer, "Who is Sven?", max_tokens=16, kv_bits=8)
    chat = ChatSession(model, tokenizer, kv_bits=4, kv_group_size=32)
    chat.send("Who is Sven?")
    first = len(chat.cache)
    chat.send("Tell me about Zoe.")
    assert chat.turns[1].reused_tokens >= first - 1 > 0
    store = chat.cache.stores[0]
    assert isinstance(store, QuantizedStore) and (store.bits, store.group_size) == (4, 32)
    with pytest.raises(DecodeError, match="kv_bits"):  # a cache of another form is refused, not misread
        list(stream_generate(model, tokenizer, [1, 2, 3], cache=chat.cache, kv_bits=8, max_tokens=4))
    fresh = CommittedCache.for_model(model)  # one never used takes the form asked, as mlx-lm's prompt cache does
    assert generate(model, tokenizer, "Who is Sven?", max_tokens=16, kv_bits=8, cache=fresh) == \
        generate(model, tokenizer, "Who is Sven?", max_tokens=16, kv_bits=8)
    assert isinstance(fresh.stores[0], QuantizedStore) and fresh.stores[0].bits == 8

    entries = PromptCache(1 << 30)
    entries.insert(chat.cache)
    (entry,) = entries.entries.values()
    spec = model.cache_spec()
    assert entries.nbytes == entry.nbytes == spec.layers * entry.capacity * chat.storage.row_bytes(spec)
    assert entries.nbytes * 4 < entry.capacity * spec.layers * KVStorage().row_bytes(spec)  # under a quarter of the float rows


def test_batch_generator_takes_kv_bits_as_the_docs_say(demo):
    """docs/serving.md lists BatchGenerator among the calls that take kv_bits= and kv_group_size=; it took
    only storage= (a TypeError). Now as stream_generate: the same answer as the storage made of them."""
    from refusion_mlx.decode.batch import BatchGenerator
    from refusion_mlx.decode.params import make_params

    model, tokenizer = demo
    gen = BatchGenerator(model, tokenizer, kv_bits=8, kv_group_size=32)
    assert gen.storage == KVStorage.of(8, 32)
    answers = []
    for g in (gen, BatchGenerator(model, tokenizer, storage=KVStorage.of(8, 32))):
        uid = g.insert("Who is Sven?", make_params(max_tokens=8))
        answers.append("".join(r.text for _ in range(64) if g.has_work for r in g.step() if r.uid == uid))
    assert answers[0] == answers[1] and answers[0]
    with pytest.raises(DecodeError, match="not both"):
        BatchGenerator(model, tokenizer, kv_bits=8, storage=KVStorage.of(8))
    with pytest.raises(DecodeError, match="kv_group_size"):
        BatchGenerator(model, tokenizer, kv_bits=4, kv_group_size=48)


def test_prompt_cache_files_round_trip_quantized_and_refuse_other_settings(demo, tmp_path):
    """Entries are written as codes and come back as codes bit for bit; a
    server keeping another form (float, other bits or groups) skips them, and
    a store of another form refuses the arrays rather than misreading them."""
    from refusion_mlx.decode.prefill import prefill
    from refusion_mlx.serve.caches.cache_files import attach
    from refusion_mlx.serve.caches.prompt_cache import PromptCache

    model, _ = demo
    q8 = KVStorage.of(8, model=model)
    writer = PromptCache(1 << 30)
    attach(writer, model, tmp_path, 1 << 30, storage=q8)
    cache = CommittedCache.for_model(model, storage=q8)
    prefill(model, cache, [5, 6, 7, 8, 9, 10])
    writer.insert(cache)
    arrays = mx.load(str(next(tmp_path.glob("*.safetensors"))))
    assert arrays["keys_packed.0"].dtype == mx.uint32 and "keys.0" not in arrays
    readers = {name: PromptCache(1 << 30) for name in ("q8", "float", "q4", "q8g32")}
    for name, storage in (("q8", q8), ("float", None), ("q4", KVStorage.of(4)), ("q8g32", KVStorage.of(8, 32))):
        attach(readers[name], model, tmp_path, 1 << 30, storage=storage)
    assert {n: len(r) for n, r in readers.items()} == {"q8": 1, "float": 0, "q4": 0, "q8g32": 0}
    (entry,) = readers["q8"].entries.values()
    (held,) = writer.entries.values()
    for a, b in zip(entry.stores, held.stores):
        assert all(np.array_equal(np.array(x[:, :, :6]), np.array(y[:, :, :6])) for x, y in zip(a.codes, b.codes))
    for other in (KVStorage.of(4, model=model), None):
        fresh = CommittedCache.for_model(model, storage=other)
        with pytest.raises(ValueError):
            fresh.load_arrays(cache.to_arrays())
        assert len(fresh) == 0 and fresh.nbytes == 0


def test_admission_counts_quantized_bytes(demo):
    """A request reserves its rows at the quantized row cost, plus the rows
    of its widest decoding pass (a block: plan, verify, infill) in float: at
    8 bits the demo's request costs about a third of the float one."""
    from refusion_mlx.decode.params import make_params
    from refusion_mlx.serve.core.memory import KVCost, kv_rows

    model, _ = demo
    spec = model.cache_spec()
    request = SimpleNamespace(prompt_ids=list(range(40)), params=make_params(max_tokens=200))
    plain, q8 = KVCost.of(model, None), KVCost.of(model, KVStorage.of(8, model=model))
    assert (plain.row_bytes, plain.scratch_row_bytes) == (spec.layers * 2 * 2 * 64 * 4, 0)
    assert q8.row_bytes == spec.layers * 2 * 2 * (64 + 8) and q8.scratch_row_bytes == plain.row_bytes
    assert plain.need(request) == kv_rows(40, 200) * plain.row_bytes
    assert q8.need(request) == kv_rows(40, 200) * q8.row_bytes + 16 * plain.row_bytes  # + a 16-token block
    assert plain.need(request) > 2.9 * q8.need(request)
    assert q8.as_dict()["bits"] == 8 and "--kv-bits" in q8.refusal(request, 10, 5).message


def test_scoring_reads_through_the_quantized_cache_and_reserves_what_it_holds(demo, monkeypatch):
    """Scoring built a float cache whatever --kv-bits said (a server's echo scores were the float
    server's, bit for bit): score_ar / score_mc and the server's ScoringTask now keep keys and values as
    the storage says, and admission reserves what the scorer's cache holds at its widest, in the cache's
    growth steps (a 5-token score reserved 6 rows; its cache holds 256)."""
    from refusion_mlx.decode.params import RefusionParams
    from refusion_mlx.decode.scoring import score_ar, score_mc
    from refusion_mlx.serve.core.engine_request import EngineRequest
    from refusion_mlx.serve.core.loglikelihood import Scoring, ScoringTask
    from refusion_mlx.serve.core.memory import KVCost

    model, tok = demo
    mask = int(model.args.mask_token_id)
    ids = np.random.default_rng(1).integers(10, 800, 300).tolist()
    q8 = KVStorage.of(8, model=model)
    plain, coded = score_ar(model, [ids], 1, mask)[0], score_ar(model, [ids], 1, mask, kv_bits=8)[0]
    assert plain.logprobs != coded.logprobs and np.mean(np.abs(np.subtract(plain.logprobs[1:], coded.logprobs[1:]))) < 0.1
    assert score_ar(model, [ids], 1, mask, storage=q8)[0] == coded
    mc = score_mc(model, ids, 200, mask, 8, kv_bits=4)
    assert mc.logprobs != score_mc(model, ids, 200, mask, 8).logprobs and mc == score_mc(model, ids, 200, mask, 8,
                                                                                         storage=KVStorage.of(4))
    held, free = [], CommittedCache.free
    monkeypatch.setattr(CommittedCache, "free", lambda cache: (held.append(cache.nbytes), free(cache)))
    for storage in (None, q8):
        cost = KVCost.of(model, storage)
        # the Monte Carlo request's steps are the widest passes here (10 samples of 100 tokens, 1,000 rows
        # past the context): two of them show the cache does not grow from one step to the next, as four did
        # (samples of 200 tokens showed the same at twice the CPU)
        for spec, n in ((Scoring("ar", 1, 1), 5), (Scoring("ar", 0, 0), 300), (Scoring("mc", 1, 1, 20, 100), 200),
                        (Scoring("mc", 0, 0, 8, 298), 300)):
            request = EngineRequest(ids[:n], RefusionParams(), scoring=spec)
            task = ScoringTask(request, mask, storage)
            while task.step(model, tok) is None:
                held.append(task.scorer.cache.nbytes)
            assert task.scorer.cache.storage == (storage or KVStorage())
            assert max(held) == cost.need(request), (storage, spec)
            held.clear()


ECHO = {"prompt": "Sven lives in Paris and Zoe lives in Rome.", "echo": True, "logprobs": 1, "max_tokens": 1}


def test_server_admits_more_under_the_same_max_kv_bytes_and_reloads_its_codes(tmp_path):
    """A server with --kv-bits 8: /health and /metrics say so, a request's
    kv_bits is a 400, more slow requests run at once under 2 MiB than the
    float server's two, nothing is lost, and its prompt cache on disk comes
    back after a restart with the same setting (and not with float); its echo scores are read through
    the codes (they were the float server's, bit for bit)."""
    from tests.test_server_ops import GROWTH_BYTES, ask, call, five_slow_watched, metrics, serve, wait_idle

    folder = str(tmp_path / "cache")
    f32 = {"dtype": "float32"}  # GROWTH_BYTES' arithmetic, whichever paths run (the GPU paths default to bf16)
    with serve(kv_bits=8, max_kv_bytes=2 * GROWTH_BYTES, prompt_cache_dir=folder, **f32) as srv:
        status, health = call(srv, "GET", "/health")
        kv = health["kv"]
        assert (kv["bits"], kv["group_size"], kv["bytes_per_token"]) == (8, 64, 4 * 2 * 2 * (64 + 8))
        assert metrics(srv)["refusion_kv_bits"] == 8
        status, err = ask(srv, kv_bits=4)
        assert status == 400 and err["error"]["param"] == "kv_bits" and "--kv-bits" in err["error"]["message"]
        out, seen = five_slow_watched(srv)
        need = 256 * kv["bytes_per_token"] + 16 * kv["scratch_bytes_per_token"]
        state = wait_idle(srv)
        ask(srv, "Who is Sven?", max_tokens=8)
        _, coded = call(srv, "POST", "/v1/completions", ECHO)
    assert [s for s, _ in out] == [200] * 5 and len({json.dumps(o["choices"][0]["text"]) for _, o in out}) == 1
    assert max(h["active"] for h in seen) == min(5, 2 * GROWTH_BYTES // need) >= 4  # float: 2 (tests/test_server_ops.py)
    assert state["kv"]["reserved_bytes"] == 0
    with serve(kv_bits=8, prompt_cache_dir=folder, **f32) as srv:
        _, again = ask(srv, "Who is Sven?", max_tokens=8)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    with serve(prompt_cache_dir=folder, **f32) as srv:  # float: the quantized files are skipped, never misread
        _, plain = ask(srv, "Who is Sven?", max_tokens=8)
        _, scored = call(srv, "POST", "/v1/completions", ECHO)
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    values = [r["choices"][0]["logprobs"]["token_logprobs"][1:] for r in (coded, scored)]
    assert values[0] != values[1] and np.allclose(*values, atol=0.5)  # echo scores read through the codes too


def test_bad_settings_are_one_line_errors(demo, capsys):
    """--kv-bits 3: a usage error (exit 2); a group size the head does not
    divide, or one without bits: one line and exit 1; the same in Python."""
    from refusion_mlx.decode.stream import generate
    from refusion_mlx.generate import main
    from refusion_mlx.serve.server_config import ServerConfig

    with pytest.raises(SystemExit) as exit_info:
        main(["--kv-bits", "3"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--kv-bits: invalid choice: 3" in err
    for argv, fragment in ((("--kv-bits", "8", "--kv-group-size", "128"), "does not divide the model's head "
                            "dimension 64"), (("--kv-group-size", "32"), "--kv-group-size needs --kv-bits")):
        code = main(["--max-tokens", "8", *argv])
        out, err = capsys.readouterr()
        assert code == 1 and out == "" and err.count("\n") == 1 and fragment in err, (argv, err)
    model, tokenizer = demo
    with pytest.raises(DecodeError, match="kv_bits must be 4 or 8"):
        generate(model, tokenizer, "Who is Sven?", kv_bits=3)
    with pytest.raises(DecodeError, match="does not divide"):
        generate(model, tokenizer, "Who is Sven?", kv_bits=4, kv_group_size=128)
    with pytest.raises(RefusionError, match="kv_bits must be 4 or 8"):
        ServerConfig(kv_bits=2)


def test_shape_kv_memory_per_token_and_conversation():
    """--shape's KV table, from the shape's config alone: ReFusion-8B in
    bfloat16 keeps 144 KiB a token, 76.5 KiB at 8 bits, 40.5 KiB at 4."""
    from refusion_mlx.bench.kv_memory import format_kv_memory, kv_memory
    from refusion_mlx.bench.shapes import shape_config

    kv = kv_memory(shape_config("refusion-8b"), "bfloat16", kv_bits=8)
    forms = {f["kv_bits"]: f for f in kv["forms"]}
    assert {b: f["bytes_per_token"] for b, f in forms.items()} == {None: 147456, 8: 78336, 4: 41472}
    assert forms[8]["chosen"] and not forms[None]["chosen"]
    assert forms[8]["conversation_bytes"]["32768"] == 32768 * 78336
    assert forms[None]["pass_bytes"] == 0 and forms[8]["pass_bytes"] == 16 * 147456
    table = format_kv_memory(kv)
    assert "* bfloat16 quantized to 8 bits" in table and "1.88x" in table
