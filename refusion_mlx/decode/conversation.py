"""A conversation with ReFusion that keeps its committed KV cache between turns.

After a turn the cache holds exactly the prompt and the answer (the decoder
settles it), so the next turn renders the whole conversation with the chat
template, finds how much of it the cache already holds, and prefills only
the new suffix. ``ChatSession`` is the Python API; ``python -m
refusion_mlx.chat`` is a terminal loop over it (:mod:`refusion_mlx.cli.repl`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional

from .prefix import common_prefix


@dataclass
class TurnRecord:
    """What one turn cost: ``prompt_tokens`` is what a fresh start would prefill
    (the whole rendered conversation), ``prefill_tokens`` what was prefilled."""

    turn: int
    prompt_tokens: int
    prefill_tokens: int
    reused_tokens: int
    answer_tokens: int
    finish_reason: str
    seconds: float
    stats: object  # DecodeStats
    max_tokens: int = 0  # the turn's budget: the session's, or less where the conversation left less room


    def as_dict(self) -> dict:
        return {"turn": self.turn, "prompt_tokens": self.prompt_tokens,
                "prefill_tokens": self.prefill_tokens, "reused_tokens": self.reused_tokens,
                "answer_tokens": self.answer_tokens, "finish_reason": self.finish_reason,
                "max_tokens": self.max_tokens, "seconds": round(self.seconds, 4), "decode": self.stats.as_dict()}


class ChatSession:
    """A conversation over one CommittedCache, reused from turn to turn.

    ``stream(text)`` yields the GenerationResponses of the answer (text in
    order, as it becomes final); the answer joins the history when the turn
    completes. A turn that fails or is interrupted leaves no trace: the user
    message is dropped and the cache cut back to what it held before. Each
    turn's budget is ``params``' cut to the whole slots the conversation
    leaves in the model's context (``fit.py``, the server's rule), as
    ``turn_params`` (the turn's settings) and its record's ``max_tokens`` say.
    ``kv_bits`` / ``kv_group_size``: keep the conversation's keys and values
    quantized (``decode/kv_quant.py``), turn after turn (or ``storage``, a
    :class:`~.kv_store.KVStorage` already made). ``template_kwargs``: the
    chat template's own variables, every turn (``{"enable_thinking": False}``).
    """

    def __init__(self, model, tokenizer, params=None, system: Optional[str] = None, reuse: bool = True, *,
                 kv_bits: Optional[int] = None, kv_group_size: Optional[int] = None,
                 storage=None, template_kwargs: Optional[Dict[str, Any]] = None):
        from .kv_store import KVStorage
        from .params import RefusionParams, a_params
        from .stream import template_options

        self.template_kwargs = template_options(template_kwargs) if template_kwargs else None

        self.storage = KVStorage.given(storage, kv_bits, kv_group_size, model)  # a bad setting fails here
        self.model = model
        self.tokenizer = tokenizer
        self.params = RefusionParams() if params is None else a_params(params)
        self.params.layout()  # bad settings fail here, not at the first turn; every turn reads this layout
        self.system = system
        self.reuse = reuse
        self.messages: List[Dict[str, str]] = []
        self.turns: List[TurnRecord] = []
        self.cache = self._new_cache()
        self.response_start = 0  # the answer's first position in the current turn
        self.turn_params = self.params  # the current turn's settings: its budget fitted to the context

    def _new_cache(self):
        from .cache import CommittedCache

        return CommittedCache.for_model(self.model, storage=self.storage)

    def reset(self) -> None:
        """Forget the conversation and its cache."""
        self.messages.clear()
        self.turns.clear()
        self.cache = self._new_cache()

    def prompt_ids(self) -> List[int]:
        from .stream import chat_prompt

        return chat_prompt(self.tokenizer, self.messages, system=self.system, template_kwargs=self.template_kwargs)

    def _reusable(self, ids: List[int]) -> int:
        """Cut the cache to the longest prefix of ``ids`` it holds; return its length."""
        if not self.reuse:
            self.cache = self._new_cache()
            return 0
        n, rows = common_prefix(self.cache, ids)
        if n == len(ids):  # all cached (cannot happen after a new user message); prefill one
            n, rows = n - 1, rows[:-1]
        if len(rows) != len(self.cache):
            self.cache.keep(rows)
        return n

    def _rollback(self, keep: int) -> None:
        """After a failed turn: keep only the cached positions below ``keep``."""
        c = self.cache
        try:
            if len(c.tokens) != len(c.positions):
                raise ValueError("inconsistent cache")
            c.keep([r for p, r, _ in c.in_position_order() if p < keep])
        except Exception:  # interrupted mid-update: start the cache afresh
            self.cache = self._new_cache()

    def stream(self, text: str) -> Iterator:
        """Answer ``text`` in the conversation; yields GenerationResponses.
        While an earlier turn's answer is still streaming, a DecodeError that changes nothing."""
        from .decoder import check_free
        from .fit import fit_budget, own_blocks
        from .stream import stream_generate

        check_free(self.cache)  # before the history or the cache is touched: the open turn's, both
        self.messages.append({"role": "user", "content": text})
        try:
            ids = self.prompt_ids()
            params = fit_budget(len(ids), self.model.args.max_position_embeddings, self.params,
                                own_blocks(self.params)).params
        except Exception:
            self.messages.pop()
            raise
        reused = self._reusable(ids)
        self.response_start, self.turn_params = len(ids), params
        t0 = time.perf_counter()
        pieces, last, done = [], None, False
        try:
            for last in stream_generate(self.model, self.tokenizer, ids[reused:], cache=self.cache, params=params):
                pieces.append(last.text)
                yield last
            done = True
        finally:
            if not done:
                self.messages.pop()
                self._rollback(reused)
        self.messages.append({"role": "assistant", "content": "".join(pieces)})
        self.turns.append(TurnRecord(len(self.turns) + 1, len(ids), len(ids) - reused, reused,
                                     last.generation_tokens, last.finish_reason,
                                     time.perf_counter() - t0, last.stats, params.gen_length))

    def send(self, text: str) -> str:
        """The whole answer to ``text`` (no streaming)."""
        return "".join(r.text for r in self.stream(text))

    def totals(self) -> dict:
        """Prefill over the conversation so far, with reuse and as a fresh start per turn would be."""
        return {"turns": len(self.turns),
                "prefill_tokens": sum(t.prefill_tokens for t in self.turns),
                "prefill_tokens_without_reuse": sum(t.prompt_tokens for t in self.turns)}
