"""Batched decoding: a request's answer does not depend on its neighbours."""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from refusion_mlx.decode.batch import BatchGenerator, batch_generate, stream_batch
from refusion_mlx.decode.params import RefusionParams
from refusion_mlx.errors import DecodeError

from tests.helpers import FIXTURE_MODEL, decode_hidden


def params_of(case):
    return RefusionParams(gen_length=case["gen_length"], slot_size=case["slot_size"],
                          serial_num_blocks=case["serial_num_blocks"],
                          slot_threshold=case["slot_threshold"], token_threshold=case["token_threshold"])


def test_every_golden_case_in_one_batch_is_token_exact(demo, golden_cases):
    """32 requests, 8 settings, one forward per step: each gives the reference's tokens."""
    model, tokenizer = demo
    results = batch_generate(model, tokenizer, [c["prompt_ids"] for c in golden_cases],
                             [params_of(c) for c in golden_cases], max_batch=len(golden_cases))
    wrong = [i for i, (r, c) in enumerate(zip(results, golden_cases)) if r.output_ids != c["output_ids"]]
    assert not wrong
    for r, c in zip(results, golden_cases):
        assert r.finish_reason == ("stop" if c["output_ids"][-1] == tokenizer.eos_token_id else "length")
        assert r.text == tokenizer.decode([t for t in c["output_ids"] if t != tokenizer.eos_token_id])
        assert r.stats.generated_tokens == len(c["output_ids"]) and r.stats.forwards > 0


def test_requests_join_and_leave_mid_batch(demo, golden_cases):
    """Requests admitted at different steps, a batch cap below the load, one
    cancelled on the way: every finished request is still token-exact."""
    model, tokenizer = demo
    gen = BatchGenerator(model, tokenizer, max_batch=5)
    cases = {}
    out = {}
    order = list(range(0, 32, 3)) + list(range(1, 32, 3))
    for n, i in enumerate(order[:6]):
        cases[gen.insert(golden_cases[i]["prompt_ids"], params_of(golden_cases[i]))] = i
    pending, cancelled, steps = order[6:], None, 0
    while gen.has_work:
        for r in gen.step():
            out.setdefault(r.uid, []).append(r)
        steps += 1
        if steps % 3 == 0 and pending:  # newcomers join at step boundaries
            i = pending.pop(0)
            cases[gen.insert(golden_cases[i]["prompt_ids"], params_of(golden_cases[i]))] = i
        if steps == 4:
            cancelled = next(r.uid for r in gen.active)
            assert gen.remove(cancelled) and not gen.remove(cancelled)
        assert len(gen.active) <= 5
    assert not pending and cancelled is not None
    for uid, i in cases.items():
        if uid == cancelled:
            assert not out.get(uid) or out[uid][-1].finish_reason is None
            continue
        ids = [t for r in out[uid] for t in r.tokens]
        assert ids == golden_cases[i]["output_ids"], i
        assert out[uid][-1].finish_reason in ("stop", "length") and out[uid][-1].cache is not None


def test_a_bad_request_fails_alone(demo, golden_cases):
    model, tokenizer = demo
    good = golden_cases[5]
    prompts = [good["prompt_ids"], [1] * 2048, good["prompt_ids"], [tokenizer.eos_token_id, 99999]]
    params = [params_of(good), params_of(good), RefusionParams(slot_size=0), params_of(good)]
    results = batch_generate(model, tokenizer, prompts, params)
    assert results[0].output_ids == good["output_ids"] and results[0].error is None
    assert results[1].finish_reason == "error" and "the model's context is 2048" in results[1].error
    assert results[2].finish_reason == "error" and "slot_size" in results[2].error
    assert results[3].finish_reason == "error" and "outside the vocabulary" in results[3].error
    with pytest.raises(DecodeError, match="2 parameter sets for 3 prompts"):
        batch_generate(model, tokenizer, prompts[:3], params[:2])


def test_streamed_text_arrives_in_order(demo, golden_cases):
    model, tokenizer = demo
    cases = golden_cases[8:14]
    texts = [""] * len(cases)
    for i, r in stream_batch(model, tokenizer, [c["prompt_ids"] for c in cases], [params_of(c) for c in cases]):
        texts[i] += r.text
    assert texts == [c["text"] for c in cases]


def test_seeded_sampling_does_not_depend_on_neighbours(demo, golden_cases):
    model, tokenizer = demo
    sampled = RefusionParams(gen_length=32, slot_size=4, temperature=1.0, seed=7)
    prompt = golden_cases[3]["prompt_ids"]
    alone = batch_generate(model, tokenizer, [prompt], sampled)[0].output_ids
    others = [c["prompt_ids"] for c in golden_cases[:5]]
    together = batch_generate(model, tokenizer, others + [prompt] + others,
                              [params_of(c) for c in golden_cases[:5]] + [sampled] +
                              [RefusionParams(gen_length=32, slot_size=4, temperature=0.8, seed=s) for s in range(5)])
    assert together[5].output_ids == alone


def test_top_k_one_samples_the_argmax(demo, golden_cases):
    """top_k=1 leaves only the argmax to sample: even a hot temperature then decodes as greedy does;
    without the filter some seed decodes differently (the filter is applied)."""
    model, tokenizer = demo
    case = golden_cases[16]
    greedy = params_of(case)
    filtered = RefusionParams(**{**greedy.__dict__, "temperature": 2.0, "top_k": 1, "seed": 3})
    plain = [RefusionParams(**{**greedy.__dict__, "temperature": 2.0, "seed": s}) for s in range(3, 7)]
    a, b, *c = batch_generate(model, tokenizer, [case["prompt_ids"]] * 6, [greedy, filtered, *plain])
    assert a.output_ids == b.output_ids == case["output_ids"]
    assert any(r.output_ids != case["output_ids"] for r in c)  # the hottest temperature, 2: some seed strays


def test_generator_rejects_bad_input_at_insert(demo):
    model, tokenizer = demo
    gen = BatchGenerator(model, tokenizer, max_batch=2)
    with pytest.raises(DecodeError, match="empty"):
        gen.insert([], RefusionParams())
    with pytest.raises(DecodeError, match="max_batch"):
        BatchGenerator(model, tokenizer, max_batch=0)
    for bad in (-1, 100000, 2.5, True, "3"):  # each failed at its first step with MLX's message
        with pytest.raises(DecodeError, match="logprobs must be an integer from 0"):
            gen.insert([1, 2, 3], RefusionParams(), logprobs=bad)
    assert not gen.has_work and gen.step() == []


def test_cancelled_request_frees_its_cache(demo, golden_cases):
    import gc
    import weakref

    model, tokenizer = demo
    gen = BatchGenerator(model, tokenizer)
    uid = gen.insert(golden_cases[0]["prompt_ids"], RefusionParams(gen_length=64))
    gen.step()
    ref = weakref.ref(gen.active[0].decoder.cache)
    gc.disable()  # freed by reference counting alone, not by a later collection
    try:
        gen.remove(uid)
        assert ref() is None and not gen.has_work
    finally:
        gc.enable()


def test_leaving_a_stream_batch_early_frees_its_caches(demo):
    """A loop that breaks out of ``stream_batch`` frees every request's cache then (by reference counting,
    without a later collection): ten abandoned batches of 1024-token budgets used to hold ~5 MB each."""
    import gc

    model, tokenizer = demo
    prompts = ["Who is Sven?", "Count from 1 to 9."]
    gc.disable()
    try:
        for _ in range(2):  # the first one warms what stays (compiled kernels)
            for _ in stream_batch(model, tokenizer, prompts, max_tokens=1024, slot_size=2, block_length=8):
                break
        mx.synchronize()
        before = mx.get_active_memory()
        for _ in range(10):
            for _ in stream_batch(model, tokenizer, prompts, max_tokens=1024, slot_size=2, block_length=8):
                break
        mx.synchronize()
        assert mx.get_active_memory() - before < 1 << 20
    finally:
        gc.enable()


def test_prompts_file_cli(tmp_path, golden_cases):
    cases = golden_cases[:4]
    lines = [json.dumps({"prompt": c["prompt"], "max_tokens": c["gen_length"], "slot_size": c["slot_size"],
                         "serial_num_blocks": c["serial_num_blocks"], "slot_threshold": c["slot_threshold"],
                         "token_threshold": c["token_threshold"]}) for c in cases]
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(lines) + "\n")
    r = subprocess.run([sys.executable, "-m", "refusion_mlx.generate", "--model", str(FIXTURE_MODEL),
                        "--prompts-file", str(f), "--json", "--batch-size", "3"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["output_ids"] for row in rows] == [c["output_ids"] for c in cases]
    assert [row["index"] for row in rows] == [0, 1, 2, 3]


@pytest.mark.parametrize("content, needle", [
    ('{"prompt": "hi", "slot_size": 0}\n', "prompts.jsonl:1: slot_size must be a positive integer"),
    ('{"prompt": "hi"}\n{"prompt": "x", "colour": 1}\n', "prompts.jsonl:2: unknown field(s) colour"),
    ('{"prompt": "hi"}\n{nope\n', "prompts.jsonl:2: not valid JSON"),
    # a plain prompt that starts with "{" made the file JSONL: the line says so
    ('{a} is a set; explain\nhi\n', "first prompt starts with '{' is read as JSONL: write it as {\"prompt\""),
    ('{"text": "hi"}\n', "give 'prompt'"),
    ('\n\n', "no prompts"),
])
def test_prompts_file_errors_are_one_line(tmp_path, content, needle):
    f = tmp_path / "prompts.jsonl"
    f.write_text(content)
    r = subprocess.run([sys.executable, "-m", "refusion_mlx.generate", "--prompts-file", str(f)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_packed_forward_equals_separate_forwards(demo):
    """The packed forward's hidden rows equal each request's own forward."""
    from refusion_mlx.decode.cache import CommittedCache
    from refusion_mlx.decode.forward import Pass, forward

    model, _ = demo
    rng = np.random.default_rng(0)
    caches, passes, alone = [], [], []
    for n_prompt, n in ((5, 4), (9, 8), (3, 12)):
        ids = rng.integers(0, 800, n_prompt + n).tolist()
        positions = mx.array(rng.permutation(np.arange(n_prompt, n_prompt + n)))
        for packed in (False, True):
            c = CommittedCache.for_model(model)
            decode_hidden(model, mx.array([ids[:n_prompt]]), mx.arange(n_prompt), c.extend(n_prompt))
            c.commit(ids[:n_prompt], list(range(n_prompt)))
            p = Pass("plan", mx.array(ids[n_prompt:]), positions, c.extend(n))
            (passes if packed else alone).append(p)
            caches.append(c)
    together = forward(model, passes)
    separate = mx.concatenate([forward(model, [p]) for p in alone])
    assert together.shape == separate.shape
    assert np.allclose(np.array(together), np.array(separate), atol=1e-5)
