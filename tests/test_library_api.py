"""The Python API as an mlx-lm user calls it: what a prompt may be (one
clear DecodeError for anything else), a batch's prompts, a preset at any
budget, NumPy's numbers, the constraint keywords, a cache let go of mid-answer
or shared by two answers, the tokenizer's other end ids, and the scorers'
inputs."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import openai
import pytest

import refusion_mlx as rm
from refusion_mlx.decode.scoring import score_ar, score_mc
from refusion_mlx.errors import DecodeError
from refusion_mlx.models.loading import DEMO_MODEL


@pytest.fixture(scope="module")
def demo():
    return rm.load()


@pytest.fixture(scope="module")
def prompt(demo):
    return rm.chat_prompt(demo[1], "Who is Sven?")


def test_a_prompt_is_text_or_integer_ids_and_nothing_else(demo, prompt):
    model, tok = demo
    answer = rm.generate(model, tok, prompt, max_tokens=8)
    for same in (mx.array(prompt), np.array(prompt), [np.int64(t) for t in prompt], tuple(prompt)):
        assert rm.generate(model, tok, same, max_tokens=8) == answer
    for bad, says in ((b"Who is Sven?", "got bytes"), ([1.7] * 5, "got 1.7"), ([True, False], "got True"),
                      (mx.array([prompt]), "shape (1, 12)"), (np.array(prompt, np.float32), "float32"),
                      (7, "got int")):
        with pytest.raises(DecodeError, match=says.replace("(", r"\(").replace(")", r"\)")):
            rm.generate(model, tok, bad, max_tokens=8)
    with pytest.raises(DecodeError, match="not valid UTF-8 text"):
        rm.generate(model, tok, "Who is \ud800 Sven?", max_tokens=8)


def test_a_batch_takes_a_list_of_prompts_and_a_bad_one_fails_alone(demo, prompt):
    model, tok = demo
    for one in ("Who is Sven?", prompt, mx.array(prompt)):
        with pytest.raises(DecodeError, match="for one prompt, pass"):
            rm.batch_generate(model, tok, one, max_tokens=4)
    good, bad = rm.batch_generate(model, tok, [prompt, "bad \ud800"], max_tokens=8)
    assert good.finish_reason in ("stop", "length") and good.text == rm.generate(model, tok, prompt, max_tokens=8)
    assert bad.finish_reason == "error" and bad.error.startswith("prompts[1] is not valid UTF-8 text")


def test_a_preset_at_another_budget_keeps_its_block_length_as_the_cli_does(demo, prompt):
    from refusion_mlx.cli.flags import add_decoding_args, params_from_args
    import argparse

    parser = argparse.ArgumentParser()
    add_decoding_args(parser)
    for name in rm.PRESETS:
        made = rm.make_params(preset=name, max_tokens=100)  # 5 of 8 presets failed here: 512 tokens' block count
        assert made == params_from_args(parser.parse_args(["--preset", name, "--max-tokens", "100"])), name
        assert made.block_length == 512 // rm.PRESETS[name]["serial_num_blocks"], name
    assert rm.make_params(preset="gsm8k").layout().describe()["blocks"] == 4  # its own budget: its own layout
    assert rm.make_params(preset="gsm8k", max_tokens=100, block_length=32).block_length == 32
    text, stats = rm.generate(*demo, prompt, max_tokens=100, preset="gsm8k", return_stats=True)
    assert stats.layout["block_length"] == 128 and text
    with pytest.raises(DecodeError, match="unknown preset 'nope'"):
        rm.make_params(preset="nope")


def test_numpy_numbers_are_taken_as_mlx_lm_takes_them(demo, prompt):
    numpy = rm.make_params(max_tokens=np.int64(8), temp=np.float32(0.5), seed=np.uint64(3), top_k=np.int32(3),
                           slot_threshold=np.float64(0.6))
    assert numpy == rm.make_params(max_tokens=8, temp=0.5, seed=3, top_k=3)
    assert type(numpy.gen_length) is int and type(numpy.temperature) is float
    for bad in (np.float32(8.5), 0, -1, 1.5):  # the name the caller wrote is in it (it said gen_length alone)
        with pytest.raises(DecodeError, match=r"gen_length \(max_tokens\) must be a positive integer"):
            rm.make_params(max_tokens=bad)


def test_stream_generate_takes_max_tokens_fourth_as_mlx_lm_does(demo, prompt):
    """mlx-lm's stream_generate(model, tokenizer, prompt, max_tokens); its generate's fourth is verbose,
    as here (stream_generate took no fourth argument)."""
    model, tok = demo
    *_, last = rm.stream_generate(model, tok, prompt, 4)
    assert last.generation_tokens == 4 and last.finish_reason == "length"
    assert "".join(r.text for r in rm.stream_generate(model, tok, prompt, 4)) == rm.generate(model, tok, prompt,
                                                                                             max_tokens=4)
    with pytest.raises(TypeError, match="give params or decoding keywords, not both"):
        next(rm.stream_generate(model, tok, prompt, 4, params=rm.make_params()))


def test_the_constraint_keywords(demo, prompt):
    model, tok = demo
    with pytest.raises(DecodeError, match="not json_schema and grammar"):  # {} (any JSON) counts as given
        rm.generate(model, tok, prompt, json_schema={}, grammar='start: "yes"')
    assert rm.generate(model, tok, prompt, grammar=rm.Constraint.lark('start: "yes"'), max_tokens=8) == "yes"
    with pytest.raises(DecodeError, match="a grammar in Lark format, as text, got dict"):
        rm.generate(model, tok, prompt, grammar={"type": "object"})
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    dict_given, made = rm.batch_generate(model, tok, [prompt, prompt], max_tokens=24,
                                         constraints=[schema, rm.Constraint.json_schema(schema)])
    assert dict_given.text == made.text and dict_given.finish_reason == made.finish_reason
    _, wrong = rm.batch_generate(model, tok, [prompt, prompt], max_tokens=4, constraints=[None, 5])
    assert wrong.finish_reason == "error" and "a Constraint" in wrong.error


def test_chat_prompt_takes_text_parts(demo):
    tok = demo[1]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Who is "}, {"type": "text", "text": "Sven?"}]}]
    assert rm.chat_prompt(tok, parts) == rm.chat_prompt(tok, "Who is Sven?")
    with pytest.raises(DecodeError, match="list of text parts"):
        rm.chat_prompt(tok, [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])


def test_chat_prompt_prefills_only_an_assistant_message(demo):
    """prefill leaves the last message open for the answer to continue: an assistant's, as the server's
    continue_final_message requires (a user's was left open, the answer written into the question)."""
    tok = demo[1]
    asked = [{"role": "user", "content": "Who is Sven?"}]
    begun = rm.chat_prompt(tok, asked + [{"role": "assistant", "content": "Sven lives"}], prefill=True)
    assert tok.decode(begun).endswith("<|im_start|>assistant\nSven lives")
    for prompt, last in (("Who is Sven?", "the last is a user message"), (asked, "the last is a user message"),
                         ([], "there is none")):
        with pytest.raises(DecodeError, match=f"^prefill: the last message must be an assistant's, which the answer "
                                              rf"continues \({last}\)$"):
            rm.chat_prompt(tok, prompt, prefill=True)


def test_a_cache_let_go_of_mid_answer_keeps_what_was_answered_and_serves_one_answer_at_a_time(demo):
    model, tok = demo
    first = rm.chat_prompt(tok, "Count from 17 to 60.")
    cache = rm.CommittedCache.for_model(model)
    stream = rm.stream_generate(model, tok, first, cache=cache, max_tokens=128, block_length=32,
                                slot_threshold=0.3)
    shown = next(stream)
    assert shown.finish_reason is None  # the answer goes on beyond this step
    with pytest.raises(DecodeError, match="the cache is in use"):
        rm.generate(model, tok, rm.chat_prompt(tok, "Who is Zoe?"), cache=cache, max_tokens=8)
    stream.close()
    assert cache.positions == list(range(len(first) + len(shown.tokens)))  # no holes, nothing unseen
    assert cache.tokens[len(first):] == shown.tokens
    again = rm.generate(model, tok, rm.chat_prompt(tok, "Who is Zoe?"), cache=cache, max_tokens=16)
    assert again.startswith("Zoe")


@pytest.mark.parametrize("question, settings, fail_at", [
    ("Count from 40 down to 1.", {"max_tokens": 96, "block_length": 32}, 2),  # a slot committed past a gap
    ("Count from 17 to 60.", {"max_tokens": 128, "block_length": 32, "slot_threshold": 0.3}, 3),  # text out
])
def test_an_answer_that_fails_midway_leaves_the_cache_what_was_answered(demo, monkeypatch, question, settings,
                                                                        fail_at):
    """A request that fails mid-answer settles the caller's cache as one let go of does: the prompt and
    the text released, no holes, free for the next answer (it once kept slots committed beyond a gap)."""
    from refusion_mlx.decode import commit

    model, tok = demo
    first = rm.chat_prompt(tok, question)
    real, calls = commit.after_verify, []

    def fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == fail_at:
            raise RuntimeError("simulated fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(commit, "after_verify", fails)
    cache, released = rm.CommittedCache.for_model(model), []
    with pytest.raises(RuntimeError, match="simulated fault"):
        for r in rm.stream_generate(model, tok, first, cache=cache, **settings):
            released += r.tokens
    monkeypatch.undo()
    assert cache.positions == list(range(len(first) + len(released)))
    assert cache.tokens == first + released
    again = rm.generate(model, tok, tok.encode("<|im_end|>\n<|im_start|>user\nWho is Sven?<|im_end|>\n"
                                               "<|im_start|>assistant\n", add_special_tokens=False),
                        cache=cache, max_tokens=16)
    assert again.startswith("Sven")


def test_the_tokenizers_other_end_ids_end_an_answer(tmp_path, prompt):
    folder = tmp_path / "model"
    shutil.copytree(DEMO_MODEL, folder)
    model, tok = rm.load(str(folder))
    whole = rm.generate(model, tok, prompt, max_tokens=64)
    dot = tok.encode(".")[0]
    assert whole.count(".") > 1
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [tok.eos_token_id, dot]}))
    model, tok = rm.load(str(folder))  # as mlx-lm's load: generation_config.json's list
    assert tok.eos_token_ids == {tok.eos_token_id, dot}
    cache = rm.CommittedCache.for_model(model)
    *_, last = rm.stream_generate(model, tok, prompt, max_tokens=64, cache=cache)
    text = rm.generate(model, tok, prompt, max_tokens=64)
    assert text == whole[:whole.index(".")] and last.finish_reason == "stop"
    assert cache.tokens[-1] == dot and cache.positions == list(range(len(cache.positions)))  # settled there
    batch = rm.batch_generate(model, tok, [prompt, rm.chat_prompt(tok, "Who is Zoe?")], max_tokens=64)
    assert [b.finish_reason for b in batch] == ["stop", "stop"] and batch[0].text == text
    assert "." not in batch[1].text

    from refusion_mlx.serve.http_server import RefusionServer

    with RefusionServer(str(folder), port=0) as server:
        client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0)
        answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Who is Sven?"}],
                                                max_tokens=64, logprobs=True)
    choice = answer.choices[0]
    assert choice.message.content == text and choice.finish_reason == "stop"
    assert "".join(e.token for e in choice.logprobs.content) == text  # the end id has no entry, as EOS


def test_the_scorers_check_their_ids(demo, prompt):
    model, _ = demo
    with pytest.raises(DecodeError, match="token id 5000 is outside the vocabulary"):
        score_mc(model, prompt + [5000, 9999], len(prompt), model.args.mask_token_id, mc_num=8)  # was a crash
    with pytest.raises(DecodeError, match="token id 5000 is outside the vocabulary"):
        score_ar(model, [prompt + [5000]])
    with pytest.raises(DecodeError, match="mc_num must be a positive integer"):
        score_mc(model, prompt + [5, 6], len(prompt), model.args.mask_token_id, mc_num=0)
    assert len(score_ar(model, [prompt + [5]])[0].logprobs) == len(prompt) + 1
    vocab = model.args.vocab_size
    for top in (vocab, 1.5, True, -1):  # were MLX's and pybind's own errors, or (-1) taken as 0
        with pytest.raises(DecodeError, match=f"top must be an integer from 0 to {vocab - 1}"):
            score_ar(model, [prompt], top=top)
        with pytest.raises(DecodeError, match=f"draft_top must be an integer from 0 to {vocab - 1}"):
            score_mc(model, prompt + [5, 6], len(prompt), model.args.mask_token_id, mc_num=1, draft_top=top)
    assert len(score_ar(model, [prompt], top=np.int64(3))[0].top[1]) == 3


def test_the_scorers_refuse_a_sequence_past_the_context(demo):
    """As the decoder and the server refuse them (it once scored positions the model never learned)."""
    model, mask = demo[0], demo[0].args.mask_token_id
    limit = model.args.max_position_embeddings
    fits = [5] * limit
    assert len(score_ar(model, [fits])[0].logprobs) == limit
    for call in (lambda: score_ar(model, [fits + [5]]), lambda: score_ar(model, [fits], next_mask=mask),
                 lambda: score_mc(model, fits + [5], limit - 2, mask, mc_num=1),
                 lambda: score_mc(model, fits, limit - 2, mask, mc_num=1, draft_top=0)):
        with pytest.raises(DecodeError, match=f"exceeds the model's context of {limit} positions"):
            call()
    assert len(score_mc(model, fits, limit - 2, mask, mc_num=1).logprobs) == limit


def test_a_server_config_takes_a_models_path_and_the_decoding_made_by_make_params(demo):
    from refusion_mlx.errors import RefusionError
    from refusion_mlx.serve.server_config import ServerConfig

    with pytest.raises(RefusionError, match="model must be a model folder's path .* got Model"):
        ServerConfig(demo[0], port=0)  # a loaded model was taken, and failed only when the server started
    config = ServerConfig(DEMO_MODEL, port=0, max_batch=4, decoding=rm.make_params(max_tokens=256))
    assert config.model == str(DEMO_MODEL) and config.decoding.gen_length == 256
