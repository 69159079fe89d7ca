"""A continued conversation's cache holds exactly the rows the decode left, with the keys and values each
row was decoded with: checked against a rebuild, for the terminal chat (``ChatSession``) and for the
server's prompt-cache entries (read back from ``--prompt-cache-dir``).

The answers with and without reuse may differ (docs/serving.md, "Prompt cache"), so comparing answers
cannot catch a reuse bug: a stale or wrong-token row, a wrong position, a mis-trimmed or reordered row
would go unseen wherever the answers still agree. Here every row ever committed is recorded with the rows
it saw then, as the contract says (docs/design.md): a prompt row every row the cache held and the prompt's
earlier rows; a row a global verify committed, the rows committed before the step and the step's earlier
rows (its drafts, in position order); a row an infill committed, the rows committed before the step and
its own slot's earlier rows. One forward with that visibility as its mask rebuilds every row's keys and
values, the rows since dropped (slots past the EOS, rows past a cut) included, since kept rows saw them.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from refusion_mlx.decode.cache import CommittedCache, KVWrite
from refusion_mlx.decode.conversation import ChatSession
from refusion_mlx.decode.params import make_params
from refusion_mlx.decode.stream import chat_prompt
from tests.helpers import FIXTURE_MODEL, decode_hidden
from tests.test_web import sse

TURNS = ["Compute 45 + 27.", "Please multiply 23 and 11.", "Tell me about Uma."]
MAX_TOKENS = 32  # whole slots: every committed row is within the answer's budget


class Visibility:
    """Every row a conversation's cache was given, in commit order: position, token, the rows it saw
    (indices into ``rows``), and whether the cache should still hold it."""

    def __init__(self):
        self.rows = []  # [position, token, seen, alive]

    def alive(self) -> set:
        return {i for i, r in enumerate(self.rows) if r[3]}

    def held(self) -> list:
        """(position, token) of the rows the cache should hold, by position."""
        return sorted((r[0], r[1]) for r in self.rows if r[3])

    def prompt(self, ids, reused: int) -> None:
        """A turn's prompt: the cache was cut after its first ``reused`` tokens, which must be ``ids``'."""
        for r in self.rows:
            r[3] = r[3] and r[0] < reused
        assert self.held() == list(enumerate(ids[:reused]))
        self._add(zip(range(reused, len(ids)), ids[reused:]), self.alive())

    def step(self, phase: str, slots) -> None:
        """One step's commits, ``slots``: (positions, tokens) each."""
        before = self.alive()
        if phase == "verify":  # the selected slots' drafts in one pass, in position order
            self._add(sorted((p, t) for positions, tokens in slots for p, t in zip(positions, tokens)), before)
        else:
            assert phase == "infill", phase
            for positions, tokens in slots:  # each slot alone after the committed rows
                self._add(sorted(zip(positions, tokens)), before)

    def settle(self, end: int) -> None:
        """The answer ended: rows past position ``end`` (its EOS or the budget's last) are dropped."""
        for r in self.rows:
            r[3] = r[3] and r[0] <= end

    def _add(self, rows, seen: set) -> None:
        mine = []
        for p, t in rows:
            self.rows.append([int(p), int(t), seen | set(mine), True])
            mine.append(len(self.rows) - 1)

    def rebuild(self, model) -> dict:
        """Each layer's keys and values of every recorded row, from what it saw: {layer: (keys, values)},
        (kv_heads, rows, head_dim) each, rows as recorded."""
        n = len(self.rows)
        mask = np.eye(n, dtype=bool)
        for i, r in enumerate(self.rows):
            mask[i, list(r[2])] = True
        return forward_kv(model, [r[1] for r in self.rows], [r[0] for r in self.rows], mx.array(mask))


def forward_kv(model, tokens, positions, mask) -> dict:
    """Each layer's keys and values of one forward over ``tokens`` at ``positions`` under ``mask`` (a
    (rows, rows) bool array, or "causal")."""
    cache = CommittedCache.for_model(model)
    cache.reserve(len(tokens))
    write = KVWrite(cache, start=0, rows=None, visible=len(tokens), mask=mask)
    mx.eval(decode_hidden(model, tokens, positions, write), cache.state())
    cache.commit(tokens, positions)
    return kv_of(cache)


def kv_of(cache) -> dict:
    arrays = cache.to_arrays()
    return {int(k.split(".")[1]): (np.array(arrays[k][0]), np.array(arrays["values" + k[4:]][0]))
            for k in arrays if k.startswith("keys.")}


def check(model, cache, seen: Visibility) -> None:
    """``cache`` holds the rows ``seen`` says, at positions 0, 1, ...; (a) layer 0 of each row is what its
    token and position alone give (to 1e-5 of the largest key or value: float32 matmuls of other widths
    round otherwise), (b) every layer what the row saw when it was decoded gives (to 1e-4)."""
    tokens, positions = list(cache.tokens), list(cache.positions)
    assert sorted(zip(positions, tokens)) == seen.held(), "the cache holds other rows than the decode left"
    assert sorted(positions) == list(range(len(positions)))
    held = kv_of(cache)
    k0, v0 = forward_kv(model, tokens, positions, "causal")[0]  # layer 0 depends on the row alone: any mask
    scale = max(1.0, np.abs(k0).max(), np.abs(v0).max())
    assert max(np.abs(held[0][0] - k0).max(), np.abs(held[0][1] - v0).max()) < 1e-5 * scale, "layer 0"
    rebuilt = seen.rebuild(model)
    row_of = {p: i for i, p in enumerate(positions)}
    alive = sorted(seen.alive(), key=lambda i: seen.rows[i][0])
    mine = [row_of[seen.rows[i][0]] for i in alive]
    for layer, (keys, values) in held.items():
        rk, rv = rebuilt[layer]
        worst = max(np.abs(keys[:, mine] - rk[:, alive]).max(), np.abs(values[:, mine] - rv[:, alive]).max())
        assert worst < 1e-4, f"layer {layer}: {worst:.3g} from the rebuild"


def record_turn(seen: Visibility, ids, reused: int, steps, eos: int) -> None:
    """One turn: its prompt (``reused`` tokens from the cache), its steps' commits (phase, [(positions,
    tokens)]: absolute positions) and the settling at the answer's end (its first EOS, else the budget)."""
    seen.prompt(ids, reused)
    for phase, slots in steps:
        seen.step(phase, slots)
    ends = [p for p, t, _, alive in seen.rows if alive and p >= len(ids) and t == eos]
    seen.settle(min(ends) if ends else len(ids) + MAX_TOKENS - 1)


def edited(answer: str) -> str:
    """The last turn's answer as an edited history sends it: its last two characters gone (the cache is cut
    inside the answer, as where an answer re-tokenizes differently: rows kept may have seen rows cut)."""
    return answer[:-2]


def some_rows_saw_what_a_fresh_prefill_does_not(seen: Visibility) -> bool:
    """Whether a kept row missed a kept row of an earlier position, or saw a later one or a dropped one."""
    alive = seen.alive()
    return any(r[2] & alive != {j for j in alive if seen.rows[j][0] < r[0]} or r[2] - alive
               for i, r in enumerate(seen.rows) if i in alive)


def test_a_chat_sessions_cache_holds_what_each_row_saw(demo):
    model, tokenizer = demo
    session = ChatSession(model, tokenizer, make_params(max_tokens=MAX_TOKENS))
    seen = Visibility()
    for k, text in enumerate(TURNS):
        if k == len(TURNS) - 1:
            session.messages[-1]["content"] = edited(session.messages[-1]["content"])
        ids = chat_prompt(tokenizer, session.messages + [{"role": "user", "content": text}])
        steps = [(r.phase, [(c.positions, c.tokens) for c in r.commits]) for r in session.stream(text) if r.commits]
        turn = session.turns[-1]
        assert turn.prompt_tokens == len(ids) and (turn.reused_tokens > 0) == (k > 0)
        record_turn(seen, ids, turn.reused_tokens, steps, tokenizer.eos_token_id)
        check(model, session.cache, seen)
    assert some_rows_saw_what_a_fresh_prefill_does_not(seen)


def test_a_prompt_cache_entry_holds_what_each_row_saw(demo, tmp_path):
    """The server's entries (forked in position order from each finished request, continued by the next
    turn's request), read back from --prompt-cache-dir once the server has stopped."""
    from refusion_mlx.serve.caches.cache_files import attach
    from refusion_mlx.serve.caches.prompt_cache import PromptCache
    from refusion_mlx.serve.http_server import RefusionServer

    model, tokenizer = demo
    seen, messages = Visibility(), []
    with RefusionServer(str(FIXTURE_MODEL), port=0, dtype="float32", prompt_cache_dir=str(tmp_path)) as srv:
        for k, text in enumerate(TURNS):
            if k == len(TURNS) - 1:
                messages[-1]["content"] = edited(messages[-1]["content"])
            messages.append({"role": "user", "content": text})
            ids = chat_prompt(tokenizer, messages)
            chunks = sse(srv, {"messages": messages, "max_tokens": MAX_TOKENS, "stream": True,
                               "stream_options": {"include_usage": True, "include_commits": True}})
            usage = chunks[-1]["usage"]
            assert usage["prompt_tokens"] == len(ids)
            steps = [(c["commits"]["phase"], [([len(ids) + p for p in s["positions"]], s["ids"])
                                              for s in c["commits"]["slots"]])
                     for c in chunks if c.get("commits", {}).get("slots")]
            record_turn(seen, ids, usage["prompt_tokens_details"]["cached_tokens"], steps, tokenizer.eos_token_id)
            messages.append({"role": "assistant", "content": "".join(
                c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))})
    entries = PromptCache(1 << 30)
    attach(entries, model, tmp_path, 1 << 30)
    (_, tokens), entry = max(entries.entries.items(), key=lambda item: len(item[0][1]))
    assert len(tokens) > len(ids) and some_rows_saw_what_a_fresh_prefill_does_not(seen)
    check(model, entry, seen)
