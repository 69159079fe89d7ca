"""Evaluation through the server, with lm-evaluation-harness's request shapes
(``local-completions``: ``loglikelihood`` as echo + logprobs, token-id lists
in batches; ``generate_until`` as prompt lists), ``n`` > 1 and prompt lists."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from operator import itemgetter

import numpy as np
import pytest

from refusion_mlx.serve.http_server import RefusionServer
from tests.helpers import FIXTURE_MODEL
from tests.test_scoring import TASK, demo_questions
from tests.test_server import raw

COMPLETIONS = "/v1/completions"
TASK_YAML = TASK.with_suffix(".yaml")


def lm_eval_loglikelihood(requests):
    """lm-eval's local-completions payload for a batch of loglikelihood requests (token ids)."""
    return {"model": "tiny-refusion", "prompt": requests, "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}


def lm_eval_parse_logprobs(out, ctxlens):
    """lm-eval's LocalCompletionsAPI.parse_logprobs, as it reads the answer."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens):
        token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        res.append((sum(token_logprobs), all(t == max(d.values()) for t, d in zip(token_logprobs, top))))
    return res


def lm_eval_requests(tok, row):
    """A multiple-choice document as lm-eval makes its loglikelihood requests from the
    recipe's task file: the context from ``doc_to_text``, each choice after
    ``target_delimiter``, encoded as its ``_encode_pair`` does (the whole, less the context's ids)."""
    import jinja2
    import yaml

    task = yaml.safe_load(TASK_YAML.read_text())
    context = jinja2.Template(task["doc_to_text"]).render(**row)
    context_ids = tok.encode(context)
    seqs = [tok.encode(context + task["target_delimiter"] + c) for c in row["choices"]]
    assert all(s[:len(context_ids)] == context_ids for s in seqs)
    return len(context_ids), seqs


@pytest.fixture(scope="module")
def cases(demo):
    """The demo questions as lm-eval sends them, with the AR estimator's
    scores computed directly before the server starts."""
    from refusion_mlx.decode.scoring import score_ar

    model, tok = demo
    out = []
    for r in demo_questions()[::5]:
        ctxlen, seqs = lm_eval_requests(tok, r)
        direct = [sum(s.logprobs[ctxlen:]) for s in score_ar(model, seqs)]
        out.append((ctxlen, seqs, direct, r["answer"]))
    return out


@pytest.fixture(scope="module")
def server(cases):
    # float32 as the direct scores are, whichever paths run (the GPU paths default to the stored bf16)
    srv = RefusionServer(str(FIXTURE_MODEL), model_id="tiny-refusion", port=0, dtype="float32").start()
    yield srv
    srv.close()


def post(server, body):
    status, payload = raw(server, "POST", COMPLETIONS, body)
    assert status == 200, payload
    return json.loads(payload)


def test_loglikelihood_batches_as_lm_eval_sends_them(server, cases):
    right = 0
    for ctxlen, seqs, direct, answer in cases:  # one question's four choices: lm-eval's --batch_size 4
        out = post(server, lm_eval_loglikelihood(seqs))
        assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
        for choice, ids in zip(out["choices"], seqs):
            lp = choice["logprobs"]
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(ids) + 1
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
                assert top[token] == value and len(top) == (1 if next(iter(top)) == token else 2)
        scores = lm_eval_parse_logprobs(out, [ctxlen] * 4)
        np.testing.assert_allclose([s for s, _ in scores], direct, atol=1e-3)
        right += int(np.argmax([s for s, _ in scores])) == answer
        assert scores[answer][1] == (max(scores)[0] == scores[answer][0]) or not scores[answer][1]
        assert out["usage"]["prompt_tokens"] == sum(len(s) for s in seqs) and out["usage"]["completion_tokens"] == 4
    assert right >= 0.8 * len(cases)


def test_the_same_scores_alone_and_concurrent(server, cases):
    bodies = [lm_eval_loglikelihood([s]) for _, seqs, _, _ in cases for s in seqs]
    alone = [post(server, b)["choices"][0]["logprobs"]["token_logprobs"] for b in bodies[:6]]
    with ThreadPoolExecutor(4) as pool:  # lm-eval's num_concurrent 4
        together = list(pool.map(lambda b: post(server, b)["choices"][0]["logprobs"]["token_logprobs"], bodies))
    assert together[:6] == alone  # bit for bit: each prompt is its own forward, whatever its neighbours


def test_the_mc_estimator_and_echo_text(server, cases):
    ctxlen, seqs, _, answer = cases[0]
    body = {"prompt": seqs, "echo": True, "logprobs": 1, "max_tokens": 0, "logprob_estimator": "mc",
            "mc_num": 16, "context_tokens": ctxlen}
    out = post(server, body)
    scores = [sum(c["logprobs"]["token_logprobs"][ctxlen:]) for c in out["choices"]]
    assert int(np.argmax(scores)) == answer and all(s < 0 for s in scores)
    assert out["choices"][0]["logprobs"]["token_logprobs"][:ctxlen] == [None] * ctxlen
    assert post(server, body)["choices"][1]["logprobs"] == out["choices"][1]["logprobs"]  # seeded: the same
    text = post(server, {"prompt": "Who is Sven?", "echo": True, "max_tokens": 0})["choices"][0]
    assert text["text"] == "Who is Sven?" and text["logprobs"] is None


def test_the_drafted_token_ends_the_text_as_a_generated_one(server):
    """Echo with max_tokens 1: the drafted token's text follows generation's rules. A drafted EOS came
    in the text with finish "length", and stop strings were ignored; now EOS ends it without text and a
    stop string in the drafted token's text cuts it, both "stop" (as vLLM's echo does: its stop strings
    are the generated text's, never the prompt's), while the token's score stays in logprobs, where lm-eval
    drops the last entry whatever it is."""
    chat = "<|im_start|>user\nWhere does Zoe live?<|im_end|>\n<|im_start|>assistant\nZoe lives in Bern"
    ask = {"prompt": chat, "echo": True, "logprobs": 1, "max_tokens": 1}
    eos = post(server, {**ask, "prompt": chat + "."})
    choice = eos["choices"][0]
    assert choice["text"] == chat + "." and choice["finish_reason"] == "stop"
    assert choice["logprobs"]["tokens"][-1] == "<|im_end|>" and eos["usage"]["completion_tokens"] == 1
    plain = post(server, ask)["choices"][0]
    assert plain["text"] == chat + "." and plain["finish_reason"] == "length"
    cut = post(server, {**ask, "stop": ["x", "."]})["choices"][0]
    assert cut["text"] == chat and cut["finish_reason"] == "stop" and cut["logprobs"] == plain["logprobs"]
    assert post(server, {**ask, "stop": ["Bern"]})["choices"][0] == plain  # the prompt's text is not cut


def test_top_logprobs_hold_the_token_itself_as_openai_legacy_does(server):
    """logprobs 0 gave echo a null top_logprobs at every position (the docs: only the first) and an answer
    {} at each: OpenAI's and vLLM's legacy logprobs hold the token itself besides the k most likely (up to
    k + 1 entries). Both do now; lm-eval's is_greedy (its value against the top's best) still reads true
    exactly where the token is the most likely, since the best is always there with k >= 1."""
    prompt = "<|im_start|>user\nWhere does Zoe live?<|im_end|>\n<|im_start|>assistant\nZoe lives in Rome."
    for k in (0, 1, 3):
        lp = post(server, {"prompt": prompt, "echo": True, "logprobs": k, "max_tokens": 1})["choices"][0]["logprobs"]
        assert lp["top_logprobs"][0] is None and lp["token_logprobs"][0] is None
        greedy = []
        for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
            assert top[token] == value and max(k, 1) <= len(top) <= k + 1
            greedy.append(value == max(top.values()))
            if k:
                assert greedy[-1] == (next(iter(top)) == token) and list(top.values())[:k] == sorted(
                    list(top.values())[:k], reverse=True)
        assert k == 0 or not all(greedy)  # "Rome" is not the demo's answer: is_greedy reads false somewhere
        answer = post(server, {"prompt": "Who is Sven?", "max_tokens": 8, "logprobs": k})["choices"][0]["logprobs"]
        for token, value, top in zip(answer["tokens"], answer["token_logprobs"], answer["top_logprobs"]):
            assert token in top and max(k, 1) <= len(top) <= k + 1 and (k or top == {token: value})


def test_generate_until_prompt_lists_and_n(server):
    prompts = ["<|im_start|>user\nWho is Sven?<|im_end|>\n<|im_start|>assistant\n",
               "<|im_start|>user\nSpell the word coffee.<|im_end|>\n<|im_start|>assistant\n"]
    alone = [post(server, {"prompt": p, "max_tokens": 16, "temperature": 0}) for p in prompts]
    out = post(server, {"model": "m", "prompt": prompts, "max_tokens": 16, "temperature": 0, "stop": ["\n\n"],
                        "seed": 1234})  # lm-eval's generate_until batch
    assert [c["text"] for c in sorted(out["choices"], key=itemgetter("index"))] == \
        [a["choices"][0]["text"] for a in alone]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert out["usage"][key] == sum(a["usage"][key] for a in alone)
    sampled = post(server, {"prompt": "Who is Sven?", "n": 2, "max_tokens": 8, "temperature": 1.0, "seed": 3})
    assert [c["index"] for c in sampled["choices"]] == [0, 1]
    assert len({c["text"] for c in sampled["choices"]}) > 1  # independent samples (seed, seed + 1, ...)
    seeded = [post(server, {"prompt": "Who is Sven?", "max_tokens": 8, "temperature": 1.0, "seed": 3 + k})
              for k in range(2)]
    assert [c["text"] for c in sampled["choices"]] == [s["choices"][0]["text"] for s in seeded]
    assert sampled["usage"]["prompt_tokens"] == seeded[0]["usage"]["prompt_tokens"]  # the prompt counted once
    assert sampled["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in seeded)
    top = 2 ** 64 - 1  # the largest seed: the next answer's wraps around to 0 (it was a 500)
    wrapped = post(server, {"prompt": "Who is Sven?", "n": 2, "max_tokens": 8, "temperature": 1.0, "seed": top})
    assert [c["text"] for c in wrapped["choices"]] == [
        post(server, {"prompt": "Who is Sven?", "max_tokens": 8, "temperature": 1.0, "seed": s})["choices"][0]["text"]
        for s in (top, 0)]
    status, payload = raw(server, "POST", COMPLETIONS, {"prompt": prompts, "n": 2, "max_tokens": 8, "stream": True,
                                                        "stream_options": {"include_usage": True}})
    chunks = [json.loads(line[6:]) for line in payload.decode().splitlines()
              if line.startswith("data: {")]
    texts = {}
    for c in chunks[:-1]:
        for choice in c["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert set(texts) == {0, 1, 2, 3} and texts[0] == texts[1]  # temperature 0: the samples agree
    assert chunks[-1]["usage"]["completion_tokens"] > 0 and payload.decode().endswith("data: [DONE]\n\n")


def test_the_tokenizer_endpoints_lm_eval_probes(server, demo):
    _, tok = demo
    info = json.loads(raw(server, "GET", "/tokenizer_info")[1])
    assert info["eos_token"] == tok.eos_token and info["chat_template"] and info["model_max_length"] == 2048
    status, payload = raw(server, "POST", "/tokenize", {"prompt": "Who is Sven?", "add_special_tokens": False})
    assert status == 200 and json.loads(payload)["tokens"] == tok.encode("Who is Sven?")
    status, payload = raw(server, "POST", "/detokenize", {"tokens": tok.encode("Who is Sven?")})
    assert json.loads(payload)["prompt"] == "Who is Sven?"
    status, payload = raw(server, "POST", "/detokenize", {"tokens": [10 ** 7]})
    assert status == 400 and json.loads(payload)["error"]["param"] == "tokens"


def test_chat_n(server):
    body = {"messages": [{"role": "user", "content": "Who is Sven?"}], "n": 2, "max_tokens": 8}
    status, payload = raw(server, "POST", "/v1/chat/completions", body)
    out = json.loads(payload)
    assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1]
    assert out["choices"][0]["message"] == out["choices"][1]["message"]
    status, payload = raw(server, "POST", "/v1/chat/completions", {**body, "top_logprobs": 2})
    assert status == 400 and json.loads(payload)["error"]["param"] == "top_logprobs"
    status, payload = raw(server, "POST", "/v1/chat/completions",
                          {**body, "logprobs": True, "response_format": {"type": "json_object"}})
    assert status == 400 and json.loads(payload)["error"]["param"] == "logprobs"


def test_answer_logprobs_chat_and_text_whole_and_streamed(server):
    chat = {"messages": [{"role": "user", "content": "Who is Sven?"}], "max_tokens": 12, "logprobs": True,
            "top_logprobs": 2}
    status, payload = raw(server, "POST", "/v1/chat/completions", chat)
    whole = json.loads(payload)["choices"][0]
    content = whole["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == whole["message"]["content"]
    for e in content:
        assert e["logprob"] <= 0 and len(e["top_logprobs"]) == 2 and bytes(e["bytes"]).decode() == e["token"]
        assert e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
    status, payload = raw(server, "POST", "/v1/chat/completions", {**chat, "stream": True})
    chunks = [json.loads(line[6:]) for line in payload.decode().splitlines() if line.startswith("data: {")]
    streamed = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert streamed == content  # in answer order, with their text
    assert "".join(ch["delta"].get("content", "") for c in chunks for ch in c["choices"]) == \
        whole["message"]["content"]
    text = post(server, {"prompt": "Who is Sven?", "max_tokens": 8, "logprobs": 1})["choices"][0]
    lp = text["logprobs"]
    assert "".join(lp["tokens"]) == text["text"] and len(lp["token_logprobs"]) == len(lp["top_logprobs"])
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    plain = post(server, {"prompt": "Who is Sven?", "max_tokens": 8})["choices"][0]
    assert plain["text"] == text["text"] and plain["logprobs"] is None  # asking changes no token
    counting = {"messages": [{"role": "user", "content": "Count from 17 to 38."}], "max_tokens": 40,
                "logprobs": True, "stop": ["9"]}
    for stream in (False, True):  # a stop string cut the answer: no token past it (the one it cut, in part)
        status, payload = raw(server, "POST", "/v1/chat/completions", {**counting, "stream": stream})
        if stream:
            chunks = [json.loads(line[6:]) for line in payload.decode().splitlines() if line.startswith("data: {")]
            said = "".join(ch["delta"].get("content", "") for c in chunks for ch in c["choices"])
            tokens = [e["token"] for c in chunks for ch in c["choices"] if ch["logprobs"]
                      for e in ch["logprobs"]["content"]]
        else:
            choice = json.loads(payload)["choices"][0]
            said, tokens = choice["message"]["content"], [e["token"] for e in choice["logprobs"]["content"]]
        assert said == "17 18 1" and "".join(tokens).startswith(said) and len("".join(tokens[:-1])) < len(said)


def test_tokens_that_split_a_character_keep_their_bytes_and_offsets(server):
    """Byte-level BPE spells "ë" and "🎉" in several tokens: each token's ``bytes`` are its own (they join
    into the text's bytes), a part of a character is named ``bytes:\\x..``, and ``text_offset`` indexes the
    text (a character counts at its last token)."""
    text = "Zoë lives in 日本 🎉 done"  # "Zo", "ë" in 2 tokens, " lives", " in", " ", 日 and 本 in 3 each, ...
    echo = post(server, {"prompt": text, "echo": True, "logprobs": 1, "max_tokens": 0})["choices"][0]
    lp = echo["logprobs"]
    assert echo["text"].endswith(text) and any(t.startswith("bytes:\\x") for t in lp["tokens"])
    for word in (" lives", " in", "on"):  # a whole token starts where its text does in the text
        i = max(i for i, t in enumerate(lp["tokens"]) if t == word)
        assert lp["text_offset"][i] == echo["text"].rindex(word)
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] < len(echo["text"])
    chat = {"messages": [{"role": "user", "content": "Who is Zoë?"}], "max_tokens": 24, "logprobs": True,
            "top_logprobs": 1, "temperature": 2.0, "seed": 3}
    for seed in range(3, 9):  # a hot draft: answers that split characters too
        body = json.loads(raw(server, "POST", "/v1/chat/completions", {**chat, "seed": seed})[1])["choices"][0]
        content = body["logprobs"]["content"]
        joined = b"".join(bytes(e["bytes"]) for e in content)
        assert joined.decode("utf-8", "replace") == body["message"]["content"]
        assert all(e["token"] == bytes(e["bytes"]).decode() for e in content if not e["token"].startswith("bytes:"))


def test_answer_logprobs_on_the_responses_api_whole_and_streamed(server):
    """include "message.output_text.logprobs" (and top_logprobs): the output
    text's logprobs as chat completions' content, on the delta events as they
    come; the tokens are those of chat with the same settings; a constrained
    answer refuses them naming the field that asked."""
    ask = {"input": "Who is Sven?", "max_output_tokens": 12, "include": [LOGPROBS], "top_logprobs": 2}
    status, payload = raw(server, "POST", "/v1/responses", ask)
    assert status == 200
    whole = json.loads(payload)
    part = whole["output"][0]["content"][0]
    entries = part["logprobs"]
    assert whole["top_logprobs"] == 2  # echoed, as OpenAI does
    assert entries and "".join(e["token"] for e in entries) == part["text"]
    assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) == 2 and bytes(e["bytes"]).decode() == e["token"]
               for e in entries)
    chat = {"messages": [{"role": "user", "content": "Who is Sven?"}], "max_tokens": 12, "logprobs": True,
            "top_logprobs": 2}
    assert entries == json.loads(raw(server, "POST", "/v1/chat/completions", chat)[1])["choices"][0]["logprobs"]["content"]
    status, payload = raw(server, "POST", "/v1/responses", {**ask, "stream": True})
    events = [json.loads(line[6:]) for line in payload.decode().splitlines() if line.startswith("data: {")]
    deltas = [e for ev in events if ev["type"] == "response.output_text.delta" for e in ev["logprobs"]]
    done = [ev for ev in events if ev["type"] == "response.output_text.done"]
    assert deltas == entries and done[0]["logprobs"] == entries
    only_include = json.loads(raw(server, "POST", "/v1/responses", {**ask, "top_logprobs": None})[1])
    assert [e["top_logprobs"] for e in only_include["output"][0]["content"][0]["logprobs"]] == [[]] * len(entries)
    assert only_include["top_logprobs"] is None
    plain = json.loads(raw(server, "POST", "/v1/responses", {**ask, "include": ["reasoning.encrypted_content"],
                                                             "top_logprobs": None})[1])
    assert plain["output"][0]["content"][0] == {**part, "logprobs": []}  # other include values add nothing
    status, payload = raw(server, "POST", "/v1/responses", {**ask, "text": {"format": {"type": "json_object"}}})
    err = json.loads(payload)["error"]
    assert status == 400 and err["param"] == "top_logprobs"
    assert err["message"] == "top_logprobs: not supported with an answer constrained by text.format"  # its API's name


LOGPROBS = "message.output_text.logprobs"


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "echo": True, "max_tokens": 2}, "echo"),
    ({"prompt": "x y", "echo": True, "logprob_estimator": "mc"}, "context_tokens"),
    ({"prompt": "x y", "echo": True, "logprob_estimator": "mc", "context_tokens": 9}, "context_tokens"),
    ({"prompt": "x y", "echo": True, "mc_num": 4}, "mc_num"),
    ({"prompt": "x y", "echo": True, "max_tokens": 0, "logit_bias": {"5": 1}}, "logit_bias"),
    ({"prompt": "x y", "echo": True, "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "x y", "echo": True, "repetition_penalty": 1.2, "presence_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "mc_num": 4}, "mc_num"),
    ({"prompt": "x", "logprob_estimator": "best"}, "logprob_estimator"),
    ({"prompt": ["a", "b"], "echo": True, "logprob_estimator": "mc", "context_tokens": [1]}, "context_tokens"),
    ({"prompt": ["a"] * 129}, "prompt"),
    ({"prompt": ["a"] * 64, "n": 3}, "n"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": "x", "n": 17}, "n"),
])
def test_bad_scoring_requests_are_one_line_400s(server, body, param):
    status, payload = raw(server, "POST", COMPLETIONS, body)
    err = json.loads(payload)["error"]
    assert status == 400 and err["param"] == param and "\n" not in err["message"], payload


def test_a_context_tokens_that_splits_no_prompt_says_what_it_means_and_which_prompt(server):
    """"must leave 1 to 59 of the prompt's 60 tokens to score, got 0" named neither what the number is nor,
    in a list, which prompt: the message now says both."""
    body = {"prompt": ["a b c", [5, 6, 7, 8]], "echo": True, "logprob_estimator": "mc", "context_tokens": [1, 0]}
    status, payload = raw(server, "POST", COMPLETIONS, body)
    err = json.loads(payload)["error"]
    assert status == 400 and err["param"] == "context_tokens"
    assert err["message"] == ("context_tokens: prompt 1 (of 2) has 4 tokens, so context_tokens (how many of its "
                              "first tokens are the context; the tokens after them are scored) must be 1 to 3; got 0")
    status, payload = raw(server, "POST", COMPLETIONS, {**body, "prompt": [7], "context_tokens": 1})
    assert status == 400 and json.loads(payload)["error"]["message"].startswith(
        'context_tokens: the prompt has 1 token; "mc" needs 2 at least')


def test_n_samples_share_the_prefilled_prompt(server, demo):
    from refusion_mlx.decode.stream import chat_prompt

    _, tok = demo
    question = "Please count from 3 up to 9, then tell me who Sven is and where he lives."
    ids = chat_prompt(tok, question)
    assert len(ids) > 17  # long enough to share (serve/caches/prompt_cache.py SHARED_PREFIX)
    before = json.loads(raw(server, "GET", "/health")[1])["prefill_tokens"]
    body = {"messages": [{"role": "user", "content": question}], "n": 4, "max_tokens": 8}
    out = json.loads(raw(server, "POST", "/v1/chat/completions", body)[1])
    after = json.loads(raw(server, "GET", "/health")[1])["prefill_tokens"]
    assert len(out["choices"]) == 4 and out["usage"]["prompt_tokens"] == len(ids)
    cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]  # earlier tests' entries may hold a prefix
    assert after - before == len(ids) - cached + 3  # the prompt once; each other sample feeds only its last token
