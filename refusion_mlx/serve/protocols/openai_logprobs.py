"""The generated tokens' log-probabilities in OpenAI's shapes (chat:
``logprobs: true, top_logprobs: k``; text completions: ``logprobs: k``).

Each number is the probability under which the decoder accepted the token
(:mod:`refusion_mlx.decode.token_scores`: the plan's for a slot's first
token, the verification's for the others), as a natural log; the top
tokens are the most likely ones of the same row of logits. They come in
answer order with the text they belong to: the engine posts a step's text
and its final tokens' entries (:func:`..core.job.token_entries`) as one
``("logprobs", (text, entries))`` event, which these functions shape.
"""

from __future__ import annotations

from typing import List


def chat_logprobs(entries: List[dict]) -> dict:
    """Chat completions' ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``; ``bytes`` are
    the token's own (part of a character, where a character spans tokens), ``token`` their text."""
    return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": list(e["bytes"]),
                         "top_logprobs": [{"token": s, "logprob": v, "bytes": list(raw)} for s, raw, v in e["top"]]}
                        for e in entries]}


def legacy_top(pairs, token: str, logprob: float) -> dict:
    """One token's ``top_logprobs`` in OpenAI's legacy shape: the (name, log-probability) ``pairs``, most
    likely first (a name seen twice keeps its first), then the token itself when it is not among them, as
    OpenAI's and vLLM's legacy logprobs have it (up to ``logprobs`` + 1 entries; ``logprobs`` 0: the token)."""
    top = {}
    for s, v in pairs:
        top.setdefault(s, v)
    top.setdefault(token, logprob)
    return top


def completion_logprobs(entries: List[dict], offset: int = 0) -> dict:
    """Text completions' legacy ``logprobs`` (``text_offset``: where each token starts in the text, from
    ``offset``)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += e["chars"]
    tops = [legacy_top([(s, v) for s, _, v in e["top"]], e["token"], e["logprob"]) for e in entries]
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": tops, "text_offset": offsets}
