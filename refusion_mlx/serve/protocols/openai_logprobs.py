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


def _utf8(text: str) -> List[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(entries: List[dict]) -> dict:
    """Chat completions' ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": _utf8(e["token"]),
                         "top_logprobs": [{"token": s, "logprob": v, "bytes": _utf8(s)} for s, v in e["top"]]}
                        for e in entries]}


def completion_logprobs(entries: List[dict], offset: int = 0) -> dict:
    """Text completions' legacy ``logprobs`` (``text_offset`` from ``offset``)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    tops = []
    for e in entries:
        top = {}
        for s, v in e["top"]:
            top.setdefault(s, v)
        tops.append(top)
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": tops, "text_offset": offsets}
