"""ReFusion's slot-level plan-and-infill decoding loop (REFUSION.md §4).

For each block, while it has open slots:

(a) **plan**: one pass over the block's open slots, all masks, proposes a
    draft for every position; slots whose first token is confident enough are
    selected (at least the most confident one);
(b) **verify**: one pass over the selected drafts checks them left to right;
    an accepted prefix of whole slots (or up to an EOS) is **committed**;
(c) otherwise **infill**: the selected slots are decoded in parallel, each
    against the shared committed cache plus its own tokens, draft/verify
    rounds until every token is accepted; their K/V are then committed as is.

Everything numeric stays on the device; the host fetches only what a decision
needs: the slot confidences after planning, the verified probabilities after
verification and after each infill round.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..errors import DecodeError
from .cache import CommittedCache
from .params import RefusionParams
from .probs import LOGITS_BUDGET_BYTES, draft_tokens, next_token_probs, token_probs
from .stats import DecodeStats, SlotCommit, Step


# --------------------------------------------------------------------------
# The loop


class RefusionDecoder:
    """Runs one response: plan, verify, infill and commit over a committed cache."""

    def __init__(self, model, prompt: Sequence[int], params: RefusionParams, *,
                 mask_id: int, eos_id: int, cache: Optional[CommittedCache] = None,
                 prefill_step: int = 512):
        self.model = model
        self.params = params
        self.layout = params.layout()
        self.mask_id = int(mask_id)
        self.eos_id = int(eos_id)
        self.cache = cache if cache is not None else CommittedCache.for_model(model)
        self.prompt = [int(t) for t in prompt]
        if not self.prompt:
            raise DecodeError("the prompt is empty")
        self.start = len(self.cache)  # committed rows before this prompt (chat reuse)
        self.first_position = (max(self.cache.positions) + 1) if self.cache.positions else 0
        self.response_start = self.first_position + len(self.prompt)
        limit = model.args.max_position_embeddings
        if self.response_start + self.layout.gen_length > limit:
            raise DecodeError(
                f"prompt ({self.response_start} tokens) + budget ({self.layout.gen_length}) "
                f"exceeds the model's context of {limit} positions")
        vocab = model.args.vocab_size
        for name, tid in (("mask", self.mask_id), ("eos", self.eos_id)):
            if not 0 <= tid < vocab:
                raise DecodeError(f"{name} token id {tid} is outside the vocabulary of {vocab}")
        bad = [t for t in self.prompt if not 0 <= t < vocab]
        if bad:
            raise DecodeError(f"prompt token id {bad[0]} is outside the vocabulary of {vocab}")
        self.prefill_step = max(int(prefill_step), 1)
        self.stats = DecodeStats(prompt_tokens=len(self.prompt))
        self.key = mx.random.key(params.seed) if params.seed is not None else None
        self.eos_committed = False
        self._pending_prompt = True

    # -- bookkeeping -------------------------------------------------------

    @contextmanager
    def _phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stats.seconds[name] += time.perf_counter() - t0

    def _fetch(self, *arrays: mx.array, also: Sequence[mx.array] = ()) -> List[np.ndarray]:
        """The one host synchronisation of a decision point.

        ``also`` is evaluated in the same sync but stays on the device (so
        what it was computed from, e.g. logits, can be freed now).
        """
        self.stats.host_syncs += 1
        mx.eval(*arrays, *also)
        return [np.array(a) for a in arrays]

    def _forward(self, tokens, positions, write) -> mx.array:
        self.stats.forwards += 1
        tokens = mx.array(tokens, dtype=mx.int32)[None] if not isinstance(tokens, mx.array) else tokens[None]
        positions = mx.array(positions, dtype=mx.int32) if not isinstance(positions, mx.array) else positions
        return self.model.hidden(tokens, positions, write)[0]

    def _logits(self, hidden: mx.array) -> mx.array:
        logits = self.model.head(hidden)
        return logits if logits.dtype == mx.float32 else logits.astype(mx.float32)

    def _per_slots(self, hidden: mx.array, width: int, reduce) -> tuple:
        """``reduce(logits)`` over chunks of whole slots (``width`` rows each).

        ``reduce(logits, first_row)`` returns a tuple of arrays whose first
        axis is rows or slots; the chunks' results are concatenated. Chunks
        start on slot boundaries, where no row needs the previous row's logits.
        """
        rows = hidden.shape[0]
        per_chunk = width * max(1, LOGITS_BUDGET_BYTES // (4 * self.model.args.vocab_size * width))
        parts = [reduce(self._logits(hidden[i:i + per_chunk]), i) for i in range(0, rows, per_chunk)]
        if len(parts) == 1:
            return parts[0]
        return tuple(mx.concatenate(p, axis=0) for p in zip(*parts))

    def _commit(self, tokens: Sequence[int], positions: Sequence[int]) -> None:
        self.cache.commit(tokens, positions)
        self.stats.committed_tokens += len(tokens)
        if self.eos_id in tokens:
            self.eos_committed = True

    # -- (a) plan ----------------------------------------------------------

    def plan(self, open_slots: List[int]) -> tuple:
        """Draft every open slot from masks.

        Returns the drafts (n, S), each slot's confidence (its first token's
        probability, on the device) and the selected slot indices in order.
        """
        S = self.params.slot_size
        positions = [self.response_start + o + j for o in open_slots for j in range(S)]
        tokens = [self.mask_id] * len(positions)
        phase = "plan"
        if self._pending_prompt:  # the very first pass runs prompt and masks together
            phase = "prefill"
            with self._phase(phase):
                tail = self._prefill_head()
            tokens, positions = tail + tokens, list(range(self.response_start - len(tail), self.response_start)) + positions
        with self._phase(phase):
            n = len(open_slots) * S
            hidden = self._forward(tokens, positions, self.cache.extend(len(tokens)))
            if phase == "prefill":
                self._commit_prompt(tokens[: len(tokens) - n], positions[: len(tokens) - n])
            keys = None
            if self.params.temperature > 0 and self.key is not None:
                self.key, key = mx.random.split(self.key)
                keys = mx.random.split(key, n)  # one per row: chunk noise does not repeat

            def reduce(logits, first):
                drafts = draft_tokens(logits, self.params.temperature, None if keys is None else keys[first])
                return drafts, token_probs(logits[::S], drafts[::S])

            drafts, confidence = self._per_slots(hidden[-n:], S, reduce)
            drafts = drafts.reshape(-1, S)
            (conf,) = self._fetch(confidence, also=[drafts])
        selected = [i for i, c in enumerate(conf) if c > self.params.slot_threshold]
        if not selected:
            selected = [int(np.argmax(conf))]
        return drafts, confidence, selected

    def _prefill_head(self) -> List[int]:
        """Prefill all but the last ``prefill_step`` prompt tokens in chunks.

        Chunks bound the attention scores a long prompt materialises (a
        2048-token prompt on the 0.6B shape: 3.04 GB peak in chunks of 512,
        3.41 GB in one pass, and faster).

        Returns the prompt tail that the first planning pass still carries.
        """
        prompt, step = self.prompt, self.prefill_step
        done = 0
        while len(prompt) - done > step:
            chunk = prompt[done: done + step]
            positions = list(range(self.first_position + done, self.first_position + done + step))
            self._forward(chunk, positions, self.cache.extend(len(chunk)))
            self.cache.commit(chunk, positions)
            mx.eval(self.cache.state())
            done += step
        return prompt[done:]

    def _commit_prompt(self, tokens, positions) -> None:
        self.cache.commit(tokens, positions)
        self._pending_prompt = False

    # -- (b) global verification ------------------------------------------

    def verify(self, drafts: mx.array, confidence: mx.array, selected: List[int],
               open_slots: List[int]):
        """Check the selected drafts in one pass; return tokens and accept flags."""
        S = self.params.slot_size
        index = mx.array(selected, dtype=mx.int32)
        chosen = mx.take(drafts, index, axis=0).reshape(-1)
        positions = [self.response_start + open_slots[i] + j for i in selected for j in range(S)]
        with self._phase("verify"):
            hidden = self._forward(chosen, positions, self.cache.extend(len(positions)))
            (verified,) = self._per_slots(
                hidden, S, lambda lg, first: (next_token_probs(lg, chosen[first:first + lg.shape[0]]),))
            verified = verified.reshape(-1, S)
            first = mx.take(confidence, index)
            probs = mx.concatenate([first[:, None], verified[:, 1:]], axis=1)
            tokens, probs = self._fetch(chosen.reshape(-1, S), probs)
        accepted = probs > self.params.token_threshold
        accepted[:, 0] = True
        return tokens, accepted, positions

    # -- (c) parallel infill -----------------------------------------------

    def infill(self, tokens: np.ndarray, accepted: np.ndarray, positions: List[int]):
        """Decode the selected slots in parallel until all their tokens are accepted.

        Returns the surviving slots' final tokens (k', S) -- slots after the
        first one holding an accepted EOS are dropped -- and whether EOS was
        found. The slots' K/V are left in their scratch rows, in slot order.
        """
        S = self.params.slot_size
        tau = self.params.token_threshold
        tokens = tokens.copy()
        tags = np.cumprod(accepted, axis=1).astype(bool)
        pos = np.array(positions, dtype=np.int32).reshape(-1, S)
        a, eos_found = 0, False
        for _ in range(S):
            if tags.all():
                break
            k = tokens.shape[0]
            window_pos = mx.array(pos[:, a:].reshape(-1))
            held = mx.array(tags[:, a:].reshape(-1))
            known = mx.array(tokens[:, a:].reshape(-1))
            write = self.cache.infill(k, S, a)  # the same rows and mask for draft and verify
            with self._phase("infill_draft"):
                masked = mx.where(held, known, self.mask_id)
                hidden = self._forward(masked, window_pos, write)
                (proposed,) = self._per_slots(hidden, S - a, lambda lg, _: (mx.argmax(lg, axis=-1),))
                filled = mx.where(held, known, proposed.astype(known.dtype))
                mx.eval(filled)
            with self._phase("infill_verify"):
                hidden = self._forward(filled, window_pos, write)
                window = filled.reshape(k, S - a)

                def reduce(logits, first):
                    rows = window[first // (S - a): (first + logits.shape[0]) // (S - a)]
                    return (next_token_probs(logits.reshape(rows.shape[0], S - a, -1), rows),)

                (probs,) = self._per_slots(hidden, S - a, reduce)
                filled_np, probs_np = self._fetch(filled.reshape(k, S - a), probs)
            tokens[:, a:] = filled_np
            # accepted: confident, or right after a token accepted before this
            # round, or the window's first token; then made prefix-closed
            before = np.concatenate([np.ones((k, 1), bool), tags[:, a:-1]], axis=1)
            tags[:, a:] = np.cumprod((probs_np > tau) | before, axis=1).astype(bool)
            eos_rows = np.any((tokens[:, a:] == self.eos_id) & tags[:, a:], axis=1)
            if eos_rows.any():
                first = int(np.argmax(eos_rows))
                tokens, tags, pos = tokens[: first + 1], tags[: first + 1], pos[: first + 1]
                tags[first] = True
                eos_found = True
            m = int(tags[:, a:].sum(axis=1).min())
            a += m - 1 if not tags.all() else m
        return tokens, eos_found

    # -- the loop ----------------------------------------------------------

    def steps(self) -> Iterator[Step]:
        """Run the whole response, yielding each step that commits tokens."""
        S = self.params.slot_size
        mx.reset_peak_memory()  # peak of this response (weights and cache included)
        # every row this response can write: one allocation, no growth mid-decode
        self.cache.reserve(len(self.prompt) + self.layout.gen_length)
        block_start = 0
        for block_len in self.layout.block_lengths:
            open_slots = list(range(block_start, block_start + block_len, S))
            block_start += block_len
            while open_slots:
                drafts, confidence, selected = self.plan(open_slots)
                tokens, accepted, positions = self.verify(drafts, confidence, selected, open_slots)
                step = self._after_verify(tokens, accepted, positions, selected, open_slots)
                if step is None:
                    step = self._infill_and_commit(tokens, accepted, positions, selected, open_slots)
                self.stats.steps += 1
                yield step
            if self.eos_committed:
                break
        self.stats.generated_tokens = len(self.response())
        self.settle()
        self.stats.peak_memory_gb = mx.get_peak_memory() / 1e9

    def settle(self) -> None:
        """Drop committed rows beyond the answer's EOS, so the cache holds
        exactly the conversation so far and a next turn can continue it."""
        answer = self.response()
        if not answer or answer[-1] != self.eos_id:
            return
        last = self.response_start + len(answer) - 1
        rows = [r for r, p in enumerate(self.cache.positions) if r < self.start or p <= last]
        if len(rows) < len(self.cache):
            self.cache.keep(rows)

    def _after_verify(self, tokens, accepted, positions, selected, open_slots) -> Optional[Step]:
        """Commit the verification's accepted prefix if it holds EOS or a whole slot."""
        S = self.params.slot_size
        flat = tokens.reshape(-1)
        prefix = int(np.cumprod(accepted.reshape(-1)).sum())
        eos_at = np.flatnonzero(flat[:prefix] == self.eos_id)
        if eos_at.size:
            end, eos_slot = int(eos_at[0]) + 1, int(eos_at[0]) // S
            closed = self._close_from(set(selected[: eos_slot + 1]), selected, open_slots, eos_slot)
        elif prefix >= S:
            end = (prefix // S) * S
            closed = set(selected[: prefix // S])
        else:
            return None
        return self._commit_slots("verify", flat, end, positions, closed, open_slots)

    def _infill_and_commit(self, tokens, accepted, positions, selected, open_slots) -> Step:
        """Infill the selected slots and commit them up to the first EOS."""
        final, eos_found = self.infill(tokens, accepted, positions)
        flat = final.reshape(-1)
        eos_at = np.flatnonzero(flat == self.eos_id)
        end = int(eos_at[0]) + 1 if eos_at.size else flat.size
        closed = set(selected)
        if eos_found:  # REFUSION.md §5.1: close by the EOS slot's block position, no holes
            closed = self._close_from(closed, selected, open_slots, eos_slot=final.shape[0] - 1)
        return self._commit_slots("infill", flat, end, positions, closed, open_slots)

    @staticmethod
    def _close_from(closed: set, selected, open_slots, eos_slot: int) -> set:
        """Add every open slot at or after the EOS slot's position to ``closed``."""
        eos_start = open_slots[selected[eos_slot]]
        return closed | {i for i, o in enumerate(open_slots) if o >= eos_start}

    def _commit_slots(self, phase: str, flat: np.ndarray, end: int, positions: List[int],
                      closed: set, open_slots: List[int]) -> Step:
        """Commit ``flat[:end]`` (whole slots, the last maybe cut after EOS); close slots."""
        S = self.params.slot_size
        self._commit(flat[:end].tolist(), positions[:end])
        commits = [SlotCommit(positions[i:min(i + S, end)], flat[i:min(i + S, end)].tolist())
                   for i in range(0, end, S)]
        open_slots[:] = [o for i, o in enumerate(open_slots) if i not in closed]
        return Step(phase, commits, self.stats)

    # -- the answer --------------------------------------------------------

    def response(self) -> List[int]:
        """Committed response ids in position order, up to and including the first EOS."""
        pairs = sorted((p, t) for p, t in zip(self.cache.positions[self.start:], self.cache.tokens[self.start:])
                       if p >= self.response_start)
        out = []
        for _, t in pairs:
            out.append(t)
            if t == self.eos_id:
                break
        return out
