"""Decoder parameters and invariants over random models and settings."""

import random

import numpy as np
import pytest

from refusion_mlx.decode.cache import CommittedCache
from refusion_mlx.decode.decoder import RefusionDecoder
from refusion_mlx.decode.params import DEFAULT_BLOCK_TOKENS, RefusionParams, default_block_length, make_params
from refusion_mlx.errors import DecodeError

from tests.helpers import random_config, random_model


# -- parameters -------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(slot_size=0), "slot_size must be a positive integer"),
    (dict(slot_size=-4), "slot_size must be a positive integer"),
    (dict(gen_length=0), r"gen_length \(max_tokens\) must be a positive integer"),
    (dict(serial_num_blocks=0), "serial_num_blocks must be a positive integer"),
    (dict(block_length=-8), "block_length must be a positive integer"),
    (dict(block_length=6, slot_size=4), "not a multiple of slot_size"),
    (dict(gen_length=100, slot_size=4, serial_num_blocks=32), "whole slots"),
    (dict(gen_length=128, serial_num_blocks=3), "whole slots"),
    (dict(serial_num_blocks=4, block_length=16), "not both"),
    (dict(slot_threshold=1.5), r"within \[0, 1\]"),
    (dict(token_threshold=-0.1), r"within \[0, 1\]"),
    (dict(temperature=-1.0), r"temperature must be within \[0, 2\]"),
    (dict(temperature=float("nan")), r"temperature must be within \[0, 2\]"),
    (dict(temperature=float("inf")), r"temperature must be within \[0, 2\]"),
    (dict(temperature=2.5), r"temperature must be within \[0, 2\]"),  # a request's bound, every interface's
    (dict(slot_size=2.5), "slot_size must be a positive integer"),
    # a bool is no float setting's number, as it is no int setting's (True was taken as 1.0)
    (dict(temperature=True), r"temperature must be within \[0, 2\], got True"),
    (dict(top_p=True), r"top_p must be within \(0, 1\], got True"),
    (dict(slot_threshold=True), r"slot_threshold must be within \[0, 1\], got True"),
    (dict(token_threshold=False), r"token_threshold must be within \[0, 1\], got False"),
    (dict(min_p=True), r"min_p must be within \[0, 1\], got True"),
    (dict(seed=-2 ** 63 - 1), r"seed must be an integer in \[-2\*\*63, 2\*\*64\)"),  # a 64-bit integer
    (dict(seed=2 ** 64), r"seed must be an integer in \[-2\*\*63, 2\*\*64\)"),
])
def test_invalid_parameters_raise_clear_errors(kwargs, message):
    with pytest.raises(DecodeError, match=message):
        RefusionParams(**kwargs).layout()


def test_block_layouts():
    assert RefusionParams().layout().block_lengths == [16] * 32              # the reference default
    assert RefusionParams(gen_length=30, slot_size=4).layout().gen_length == 32  # rounded up
    assert RefusionParams(gen_length=100, slot_size=4).layout().block_lengths == [16] * 6 + [4]
    assert RefusionParams(gen_length=40, slot_size=4, block_length=16).layout().block_lengths == [16, 16, 8]
    assert RefusionParams(gen_length=64, slot_size=8, serial_num_blocks=2).layout().block_lengths == [32, 32]


@pytest.mark.parametrize("budget", [64, 96, 128, 200, 256, 512])
@pytest.mark.parametrize("slot_size", [4, 8])
def test_default_layout_is_parallel_at_every_budget(budget, slot_size):
    """Without a layout, blocks have a fixed length in tokens (whole slots), so
    short budgets plan several slots per block, not one."""
    layout = RefusionParams(gen_length=budget, slot_size=slot_size).layout()
    block = default_block_length(slot_size)
    assert block % slot_size == 0 and block >= DEFAULT_BLOCK_TOKENS
    assert all(n == block for n in layout.block_lengths[:-1]) and 0 < layout.block_lengths[-1] <= block
    assert sum(layout.block_lengths) == layout.gen_length
    described = layout.describe()
    assert described == {"block_length": block, "blocks": len(layout.block_lengths),
                         "slots_per_block": block // slot_size}
    assert described["slots_per_block"] >= 2


def test_default_layout_keeps_the_references_at_its_own_defaults():
    """512 tokens in 4-token slots: the reference's 32 blocks, exactly."""
    assert RefusionParams().layout() == RefusionParams(serial_num_blocks=32).layout()
    assert RefusionParams(gen_length=128).layout().block_lengths == [16] * 8


def test_explicit_layouts_keep_their_meaning():
    assert RefusionParams(gen_length=128, serial_num_blocks=32).layout().block_lengths == [4] * 32
    assert RefusionParams(gen_length=128, serial_num_blocks=2).layout().block_lengths == [64, 64]
    assert RefusionParams(gen_length=64, block_length=8).layout().block_lengths == [8] * 8
    from refusion_mlx.decode.presets import PRESETS, preset

    for name in ("reference", "gsm8k", "gpqa", "arc-c"):
        p = make_params(**preset(name))
        blocks = p.layout().block_lengths
        assert sum(blocks) == 512 and len(blocks) == PRESETS[name]["serial_num_blocks"]


def test_prompt_plus_budget_over_context_is_refused():
    model = random_model(random_config(max_position_embeddings=64), seed=0)
    with pytest.raises(DecodeError, match="exceeds the model's context of 64"):
        RefusionDecoder(model, [1] * 40, RefusionParams(gen_length=32, slot_size=4),
                        mask_id=805, eos_id=801)
    RefusionDecoder(model, [1] * 32, RefusionParams(gen_length=32, slot_size=4), mask_id=805, eos_id=801)
    with pytest.raises(DecodeError) as err:  # the budget the caller gave, and what whole slots made of it
        RefusionDecoder(model, [1] * 33, RefusionParams(gen_length=31, slot_size=4), mask_id=805, eos_id=801)
    assert str(err.value) == ("prompt (33 tokens) + max_tokens 31, 32 in whole slots exceeds the model's context "
                              "of 64 positions (31 are left after the prompt)")


def test_bad_ids_are_refused():
    model = random_model(random_config(vocab_size=50, mask_token_id=49), seed=0)
    with pytest.raises(DecodeError, match="empty"):
        RefusionDecoder(model, [], RefusionParams(gen_length=8), mask_id=49, eos_id=1)
    with pytest.raises(DecodeError, match="outside the vocabulary"):
        RefusionDecoder(model, [3, 77], RefusionParams(gen_length=8), mask_id=49, eos_id=1)
    with pytest.raises(DecodeError, match="mask token id 50"):
        RefusionDecoder(model, [3], RefusionParams(gen_length=8), mask_id=50, eos_id=1)


# -- invariants ---------------------------------------------------------------

def random_setting(rng: random.Random):
    S = rng.choice([1, 2, 3, 4, 8])
    slots = rng.randint(1, 12)
    gen = S * slots - rng.randint(0, S - 1)
    if rng.random() < 0.5:
        n = rng.choice([d for d in range(1, slots + 1) if slots % d == 0])
        blocks = dict(serial_num_blocks=n)
    else:
        blocks = dict(block_length=S * rng.randint(1, slots))
    return RefusionParams(
        gen_length=gen, slot_size=S, **blocks,
        slot_threshold=rng.choice([0.0, 0.3, 0.6, 0.9, 1.0, rng.random()]),
        token_threshold=rng.choice([0.0, 0.1, 0.3, 0.9, 1.0, rng.random()]),
        temperature=rng.choice([0.0, 0.0, 0.8]), seed=rng.randint(0, 99))


def likely_token(model, config, avoid):
    """A token the decoder produces, but not its favourite, as EOS: random
    runs then stop early in some settings and spend the budget in others."""
    probe = RefusionDecoder(model, [1, 2, 3], RefusionParams(gen_length=32, slot_size=4),
                            mask_id=avoid, eos_id=avoid)
    for _ in probe.steps():
        pass
    answer = [t for t in probe.response() if t != avoid]
    ranked = sorted(set(answer), key=lambda t: (-answer.count(t), t))
    return ranked[min(1, len(ranked) - 1)]


MODELS = [
    dict(vocab_size=40, mask_token_id=39),                 # small vocabulary: EOS comes often
    dict(vocab_size=48, mask_token_id=0, tie=True),        # mask id first, tied embeddings
    dict(vocab_size=64, mask_token_id=20, heads=2, kv_heads=1, head_dim=32),  # mask id in the middle
]


@pytest.mark.parametrize("m", range(len(MODELS)))
def test_invariants_over_random_settings(m):
    config = random_config(**MODELS[m])
    # strong layers, so outputs depend on context (tied heads would echo the input)
    model = random_model(config, seed=10 + m, scale=2.0, layer_std=1.0)
    mask_id = config["mask_token_id"]
    eos_id = likely_token(model, config, avoid=mask_id)
    rng = random.Random(m)
    eos_seen, phases = 0, set()
    for trial in range(25):
        params = rng.choice([random_setting(rng)])
        layout = params.layout()
        prompt = [rng.randrange(config["vocab_size"]) for _ in range(rng.randint(1, 12))]
        prompt = [t if t != mask_id else 1 for t in prompt]
        dec = RefusionDecoder(model, prompt, params, mask_id=mask_id, eos_id=eos_id)
        streamed = []
        for step in dec.steps():
            phases.add(step.phase)
            assert step.commits, "every step commits at least one token"
            for c in step.commits:
                assert len(c.positions) == len(c.tokens) <= params.slot_size
                streamed += list(zip(c.positions, c.tokens))
        answer = dec.response()
        start = len(prompt)
        # the budget holds, nothing follows EOS, and there is no hole before the end; the answer
        # is cut at gen_length exactly (the budget is whole slots: the last slot may hold more)
        assert 1 <= len(answer) <= layout.gen_length
        assert eos_id not in answer[:-1]
        assert len([t for t in answer if t != eos_id]) <= params.gen_length
        if answer[-1] == eos_id:
            eos_seen += 1
        else:
            assert len(answer) == params.gen_length
        # the cache holds exactly prompt + answer, with the answer's positions
        cache = dec.cache
        assert len(cache) == len(cache.tokens) == len(cache.positions) == start + len(answer)
        assert sorted(cache.positions) == list(range(start + len(answer)))
        by_pos = dict(zip(cache.positions, cache.tokens))
        assert [by_pos[start + i] for i in range(len(answer))] == answer
        # what steps reported is what was committed
        streamed = dict(streamed)
        assert all(streamed[start + i] == t for i, t in enumerate(answer))
        stats = dec.stats
        assert stats.generated_tokens == len(answer)
        assert stats.committed_tokens >= len(answer)
        assert stats.forwards >= 2 * stats.steps
        assert stats.host_syncs >= stats.steps
    assert 0 < eos_seen < 25, "some runs stop at EOS, some spend the budget"
    assert phases == {"verify", "infill"}


def test_seeded_sampling_is_reproducible():
    config = random_config(vocab_size=64, mask_token_id=63)
    model = random_model(config, seed=4, scale=0.5)

    def run(seed):
        dec = RefusionDecoder(model, [1, 2, 3], RefusionParams(gen_length=24, slot_size=4, temperature=1.0,
                                                               seed=seed), mask_id=63, eos_id=7)
        for _ in dec.steps():
            pass
        return dec.response()

    assert run(1) == run(1)
    assert len({tuple(run(s)) for s in range(6)}) > 1
    assert run(-1) == run(2 ** 64 - 1) and run(-2 ** 63) == run(2 ** 63)  # a signed seed is its 64 bits


@pytest.mark.parametrize("temperature", [1e-40, 1e-50, 1e-7])
def test_a_vanishing_temperature_draws_the_greedy_answer(temperature):
    """1/T overflows float32 below ~3e-39 (1e-50 is 0 in float32): the draws
    must still be the argmax, not NaN-driven garbage."""
    config = random_config(vocab_size=64, mask_token_id=63)
    model = random_model(config, seed=4, scale=0.5)

    def run(temp, seed):
        dec = RefusionDecoder(model, [1, 2, 3], RefusionParams(gen_length=24, slot_size=4, temperature=temp,
                                                               seed=seed), mask_id=63, eos_id=7)
        for _ in dec.steps():
            pass
        return dec.response()

    greedy = run(0.0, 0)
    assert len(greedy) > 4
    assert run(temperature, 1) == greedy == run(temperature, 2)


def test_threshold_one_still_progresses():
    """τs = τt = 1 can never be exceeded: one slot per step, infill accepts one token per round."""
    config = random_config(vocab_size=64, mask_token_id=63)
    model = random_model(config, seed=5)
    dec = RefusionDecoder(model, [1, 2], RefusionParams(gen_length=16, slot_size=4, serial_num_blocks=1,
                                                         slot_threshold=1.0, token_threshold=1.0),
                          mask_id=63, eos_id=999 % 64)
    steps = list(dec.steps())
    assert all(len(s.commits) == 1 and s.phase == "infill" for s in steps)
    assert dec.stats.forwards == len(steps) * (2 + 2 * 3)  # plan, verify, 3 draft/verify rounds


def test_conversation_continues_the_cache():
    """A second turn appends after the first: positions continue, the prompt prefill is only the new turn."""
    config = random_config(vocab_size=40, mask_token_id=39)
    model = random_model(config, seed=6, scale=2.0)
    cache = CommittedCache.for_model(model)
    first = RefusionDecoder(model, [1, 2, 3, 4], RefusionParams(gen_length=16, slot_size=4),
                            mask_id=39, eos_id=7, cache=cache)
    for _ in first.steps():
        pass
    held = len(cache)
    assert sorted(cache.positions) == list(range(held))
    second = RefusionDecoder(model, [5, 6], RefusionParams(gen_length=8, slot_size=4),
                             mask_id=39, eos_id=7, cache=cache)
    assert second.response_start == held + 2
    for _ in second.steps():
        pass
    assert cache.tokens[held:held + 2] == [5, 6]
    assert cache.positions[held:held + 2] == [held, held + 1]
    assert sorted(cache.positions) == list(range(len(cache)))


def test_long_prompts_prefill_in_chunks():
    """A prompt longer than prefill_chunk is prefilled chunk by chunk, to the same answer."""
    config = random_config(vocab_size=64, mask_token_id=63)
    model = random_model(config, seed=8, scale=2.0, layer_std=1.0)
    prompt = list(np.random.default_rng(1).integers(0, 60, 300))
    params = RefusionParams(gen_length=16, slot_size=4, block_length=8)
    runs = {}
    for chunk in (1000, 64):
        dec = RefusionDecoder(model, prompt, params, mask_id=63, eos_id=62, prefill_chunk=chunk)
        for _ in dec.steps():
            pass
        runs[chunk] = (dec.response(), dec.stats.forwards, dec.cache.tokens[:300])
    assert runs[64][2] == runs[1000][2] == [int(t) for t in prompt]
    assert runs[64][1] == runs[1000][1] + 4  # 300 = 4 chunks of 64 + a 44-token tail with the masks
    assert runs[64][0] == runs[1000][0]


def test_steps_decide_and_only_the_state_commits():
    """A request's decoding state is one object: the commit step returns a
    decision and leaves the state alone; DecodeState.commit applies it."""
    import copy

    from refusion_mlx.decode import commit
    from refusion_mlx.decode.state import DecodeState
    from refusion_mlx.decode.stats import DecodeStats

    model = random_model(random_config(), seed=0)
    params = RefusionParams(gen_length=16, slot_size=4)
    cache = CommittedCache.for_model(model)
    cache.reserve(40)
    cache.extend(3)
    cache.commit([1, 2, 3], [0, 1, 2])
    state = DecodeState(params=params, layout=params.layout(), mask_id=805, eos_id=801, vocab=806, cache=cache,
                        start=0, response_start=3, stats=DecodeStats())
    state.open_block(0, 16)
    assert state.open_slots == [0, 4, 8, 12]
    tokens = np.array([[10, 11, 12, 13], [801, 0, 0, 0]])  # slots 0 and 2 selected; the second holds EOS
    accepted = np.ones_like(tokens, dtype=bool)
    positions = [3, 4, 5, 6, 11, 12, 13, 14]
    before = copy.deepcopy((state.open_slots, state.stats, state.eos_committed, len(state.cache)))
    decision = commit.after_verify(state, tokens, accepted, positions, selected=[0, 2])
    assert (state.open_slots, state.stats, state.eos_committed, len(state.cache)) == before
    assert decision.end == 5 and decision.closed == {0, 2, 3}  # EOS closes its slot and every later one
    cache.extend(8)
    step = state.commit(decision.phase, decision.tokens, decision.end, decision.positions, decision.closed)
    assert state.open_slots == [4] and state.eos_committed and state.stats.committed_tokens == 5
    assert [c.tokens for c in step.commits] == [[10, 11, 12, 13], [801]]
    assert state.response() == [10, 11, 12, 13, 801]  # committed ids in position order, up to EOS


def test_only_the_states_methods_change_it():
    """decode/state.py's contract: the steps and the loops read a DecodeState, and what changes it (a
    field, a statistic, the committed rows of its cache) is one of its methods. The decoder set
    stats.generated_tokens itself, and it and the constrained loop each committed the prompt's tail."""
    import ast
    import re
    from pathlib import Path

    import refusion_mlx.decode as decode

    wrong = []
    for path in Path(decode.__file__).parent.glob("*.py"):
        if path.name == "state.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Call):
                targets = []
                if re.search(r"\bstate\.cache\.(commit|keep|load_arrays)$", ast.unparse(node.func)):
                    wrong.append(f"{path.name}:{node.lineno} {ast.unparse(node.func)}")
            else:
                continue
            wrong += [f"{path.name}:{node.lineno} {ast.unparse(t)} =" for t in targets
                      if re.search(r"\bstate\.\w", ast.unparse(t))]
    assert not wrong, wrong


def test_a_short_answer_of_a_large_budget_holds_memory_for_what_it_wrote(demo):
    """The cache is not allocated for the whole budget at the start (at a 32k context a request cut to the
    context reserved ~5 GB at the 8B shape): a 1,536-token budget whose answer ends within a few dozen
    tokens holds one growth step, not prompt + budget."""
    model, tokenizer = demo
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Who is Sven?"}], add_generation_prompt=True)
    decoder = RefusionDecoder(model, prompt, RefusionParams(gen_length=1536), mask_id=model.args.mask_token_id,
                              eos_id=tokenizer.eos_token_id)
    for _ in decoder.steps():
        pass
    cache = decoder.state.cache
    assert len(decoder.response()) < 64 and cache.capacity == cache.growth, (len(decoder.response()), cache.capacity)
