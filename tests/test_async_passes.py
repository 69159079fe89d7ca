"""Device-only passes (infill drafts) end in ``mx.async_eval``, not a host synchronisation."""

import mlx.core as mx

from refusion_mlx.decode import batch, forward
from refusion_mlx.decode.batch import BatchGenerator
from refusion_mlx.decode.decoder import RefusionDecoder

from tests.test_golden import params_of


def infill_case(golden_cases):
    """A golden case that infills (thresholds 0.9: three infills in 36 forwards)."""
    case = golden_cases[6]
    assert case["slot_threshold"] == case["token_threshold"] == 0.9
    return case


def spy_evals(monkeypatch):
    """Count blocking and asynchronous evaluations in run_passes."""
    calls = {"eval": 0, "async_eval": 0}
    real_eval, real_async = mx.eval, mx.async_eval

    class Spy:
        def __getattr__(self, name):
            return getattr(mx, name)

        @staticmethod
        def eval(*a):
            calls["eval"] += 1
            return real_eval(*a)

        @staticmethod
        def async_eval(*a):
            calls["async_eval"] += 1
            return real_async(*a)

    monkeypatch.setattr(forward, "mx", Spy())
    return calls


def test_infill_drafts_do_not_block_and_tokens_are_unchanged(demo, golden_cases, monkeypatch):
    model, tokenizer = demo
    case = infill_case(golden_cases)
    calls = spy_evals(monkeypatch)
    decoder = RefusionDecoder(model, case["prompt_ids"], params_of(case),
                              mask_id=model.args.mask_token_id, eos_id=tokenizer.eos_token_id)
    phases = []
    while not decoder.done:
        p = decoder.next_pass()
        (result,) = forward.run_passes(model, [p])
        phases.append((p.phase, result.synced))
        decoder.take(result)
    assert decoder.response() == case["output_ids"]
    stats = decoder.stats
    drafts = [s for ph, s in phases if ph == "infill_draft"]
    assert drafts and not any(drafts)  # every infill draft ran asynchronously
    assert all(s for ph, s in phases if ph != "infill_draft")
    assert stats.host_syncs == stats.forwards - len(drafts) < stats.forwards
    assert calls["async_eval"] >= len(drafts)


def test_golden_infill_case_through_steps(demo, golden_cases):
    model, tokenizer = demo
    case = infill_case(golden_cases)
    decoder = RefusionDecoder(model, case["prompt_ids"], params_of(case),
                              mask_id=model.args.mask_token_id, eos_id=tokenizer.eos_token_id)
    steps = list(decoder.steps())
    assert any(s.phase == "infill" for s in steps)
    assert decoder.response() == case["output_ids"]
    assert decoder.stats.host_syncs < decoder.stats.forwards


def test_a_batch_with_one_request_planning_keeps_blocking(demo, golden_cases, monkeypatch):
    """Request A drafts an infill while request B plans: that forward blocks
    (B's plan needs the host); both answers stay token-exact."""
    model, tokenizer = demo
    case = infill_case(golden_cases)
    gen = BatchGenerator(model, tokenizer, max_batch=2)
    a = gen.insert(case["prompt_ids"], params_of(case))
    da = gen.waiting[0].decoder
    gen.step()  # A admitted alone
    while da.next_pass().phase != "infill_draft":
        gen.step()
    b = gen.insert(case["prompt_ids"], params_of(case))
    db = gen.waiting[0].decoder
    seen = []
    real = forward.run_passes

    def watch(model_, passes):
        results = real(model_, passes)
        seen.append(([p.phase for p in passes], [r.synced for r in results]))
        return results

    monkeypatch.setattr(batch, "run_passes", watch)
    out = {a: [], b: []}
    while gen.has_work:
        for r in gen.step():
            out[r.uid] += r.tokens
    phases, synced = seen[0]  # A drafts, B prefills or plans: B needs the host
    assert phases[0] == "infill_draft" and phases[1] in ("prefill", "plan") and synced == [True, True]
    mixed = [s for ph, s in seen if "infill_draft" in ph and set(ph) != {"infill_draft"}]
    assert mixed and all(all(s) for s in mixed)
    alone = [s for ph, s in seen if set(ph) == {"infill_draft"}]
    assert all(not any(s) for s in alone)
    for d in (da, db):
        assert d.response() == case["output_ids"]
        assert d.stats.host_syncs <= d.stats.forwards
