"""The model's tokenizer over HTTP, as vLLM and SGLang serve it, for
evaluation tools: ``GET /tokenizer_info``, ``POST /tokenize``, ``POST
/detokenize``.

lm-evaluation-harness (0.4.9 and later) looks for exactly these when its
``local-completions`` model gets no ``tokenizer`` (``tokenizer_backend``
auto): with them it computes its context lengths through the server's own
tokenizer, so no tokenizer need be named or downloaded.
"""

from __future__ import annotations

from typing import List

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field

from ..core.refusal import Reason, Refusal
from .bodies import STRICT


class TokenizeRequest(BaseModel):
    model_config = STRICT
    prompt: str = Field(description="text, tokenized as is (no chat template)")
    add_special_tokens: bool = Field(False, description="add the tokenizer's BOS (if it has one)")


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    tokens: List[int] = Field(description="token ids")


def add_routes(app: FastAPI, answering) -> None:

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """The special tokens, the chat template and the context."""
        tok = answering.lanes.small.tokenizer
        return {"eos_token": tok.eos_token, "bos_token": getattr(tok, "bos_token", None),
                "pad_token": getattr(tok, "pad_token", None), "chat_template": getattr(tok, "chat_template", None),
                "model_max_length": answering.context, "tokenizer_class": type(tok).__name__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        def encode():
            lane = answering.lanes.current()
            with lane.lock:
                return list(lane.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))

        tokens = await answering.off_loop(request, encode)  # a long text takes seconds: never on the event loop
        return {"tokens": tokens, "count": len(tokens), "max_model_len": answering.context}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request):
        vocab = answering.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise Refusal(Reason.INVALID_VALUE, f"token id {bad[0]} is outside the vocabulary of {vocab}", "tokens")
        def decode():
            lane = answering.lanes.current()
            with lane.lock:
                return lane.tokenizer.decode(body.tokens)

        return {"prompt": await answering.off_loop(request, decode)}
