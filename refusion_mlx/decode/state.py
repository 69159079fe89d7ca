"""One request's decoding state, and the only operations that change it.

The decoding steps (``plan``, ``verify``, ``infill``, ``commit``) are
functions that read a :class:`DecodeState` and return a pass or a decision;
they never assign to it. What changes the state is one of its methods:

* :meth:`DecodeState.open_block` starts the next block's slots;
* :meth:`DecodeState.next_key` draws the key of a sampled planning pass;
* :meth:`DecodeState.commit_prompt_tail` commits the prompt's last tokens,
  which the first planning pass prefilled;
* :meth:`DecodeState.commit` applies a commit decision: the tokens join the
  committed cache, the statistics count them, the decided slots close
  (:meth:`DecodeState.record_scores` keeps their scores when asked);
* :meth:`DecodeState.decide` hands tokens decided in position order to the
  request's grammar matcher (constrained mode, ``constrain.py``), and
  :meth:`DecodeState.commit_run` commits a run of consecutive positions;
  :meth:`DecodeState.end_step` counts a step of that mode;
* :meth:`DecodeState.count_pass` books a forward in the statistics
  (:meth:`DecodeState.count_masks` the host's grammar-mask time);
* :meth:`DecodeState.finish` counts the answer and settles the cache
  (:meth:`DecodeState.settle`: committed rows beyond the answer's end -- its
  EOS, or the cut at ``gen_length`` -- are dropped), and
  :meth:`DecodeState.end_at` ends it early (:meth:`DecodeState.cut_at`);
  :meth:`DecodeState.record_peak` keeps the peak memory.

Ownership of the committed cache: whoever passes a cache in (a chat session,
the server's prompt cache) owns it; without one the state makes its own.
While the request decodes, the state's methods commit the answer's rows and
the prompt's tail; the passes write their rows through
``CommittedCache.extend`` / ``infill``, and before them the decoder reserves
every row the request can write (``CommittedCache.reserve``) and prefills
the prompt's head (``prefill.passes``, which commits each chunk). When
the request finishes, the cache is settled to prompt + answer and handed
back with the final response (``GenerationResponse.cache``) for the owner
to keep, reuse or drop; the state keeps no reference a caller must free.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set

import mlx.core as mx
import numpy as np

from ..errors import GrammarLimit
from .cache import CommittedCache
from .params import BlockLayout, RefusionParams
from .penalties import Penalties
from .stats import DecodeStats, SlotCommit, Step


@dataclass
class DecodeState:
    """A request's decoding state: settings, committed cache, the open slots
    of the current block, the sampling key, statistics, and whether EOS has
    been committed."""

    params: RefusionParams
    layout: BlockLayout
    mask_id: int
    eos_id: int
    vocab: int
    cache: CommittedCache
    start: int  # committed rows before this request's prompt (a conversation so far)
    response_start: int  # the answer's first position
    stats: DecodeStats
    key: Optional[mx.array] = None
    open_slots: List[int] = field(default_factory=list)  # slot offsets in the response, in position order
    eos_committed: bool = False
    matcher: Optional[Any] = None  # grammar.Matcher: the constrained mode's (None: unconstrained)
    logprobs: Optional[int] = None  # the answer's logprobs are kept, with this many top tokens (None: not kept)
    scores: Dict[int, tuple] = field(default_factory=dict)  # position -> (logprob, top pairs) of committed tokens
    penalties: Optional[Penalties] = None  # what its passes add to their logits (None: nothing)
    xtc_keep: Sequence[int] = ()  # tokens XTC never drops besides EOS (mlx-lm's special ones: end ids, newline)

    @functools.cached_property
    def xtc_kept(self) -> mx.array:
        """(vocab,) booleans: the tokens XTC never drops (probs.XTC), EOS and ``xtc_keep``."""
        keep = np.zeros(self.vocab, dtype=bool)
        keep[[t for t in {self.eos_id, *self.xtc_keep} if 0 <= t < self.vocab]] = True
        return mx.array(keep)

    @property
    def top(self) -> int:
        """Top tokens the passes give per head row (0: none)."""
        return self.logprobs or 0

    @property
    def slot_size(self) -> int:
        return self.params.slot_size

    # -- the operations that change the state ---------------------------------

    def open_block(self, block_start: int, block_length: int) -> None:
        """The slots of the block ``[block_start, block_start + block_length)`` are open."""
        self.open_slots = list(range(block_start, block_start + block_length, self.slot_size))

    def next_key(self) -> Optional[mx.array]:
        """A fresh key for one sampled pass, split from the request's own
        (None without a seed): its draws never depend on other requests."""
        if self.key is None:
            return None
        self.key, key = mx.random.split(self.key)
        return key

    def commit_prompt_tail(self, tail: Sequence[int]) -> None:
        """The prompt's last tokens, which the first planning pass prefilled, join the committed cache
        (the rows before the answer's first position)."""
        if len(tail):
            self.cache.commit(list(tail), list(range(self.response_start - len(tail), self.response_start)))

    def commit(self, phase: str, flat: np.ndarray, end: int, positions: List[int], closed: Set[int]) -> Step:
        """Commit ``flat[:end]`` at ``positions[:end]`` (whole slots, the last
        maybe cut after EOS), close the open slots whose indices are in
        ``closed``; the Step says which slots were committed."""
        S = self.slot_size
        tokens = flat[:end].tolist()
        self.cache.commit(tokens, positions[:end])
        self._counted(tokens)
        self.eos_committed |= self.eos_id in tokens
        commits = [SlotCommit(positions[i:min(i + S, end)], flat[i:min(i + S, end)].tolist())
                   for i in range(0, end, S)]
        self.open_slots = [o for i, o in enumerate(self.open_slots) if i not in closed]
        self.stats.steps += 1
        return Step(phase, commits, self.stats)

    def record_scores(self, positions: List[int], entries: List[tuple]) -> None:
        """Keep the committed tokens' scores (``token_scores``), by position."""
        self.scores.update(zip(positions, entries))

    def decide(self, tokens: Sequence[int]) -> None:
        """Constrained mode: ``tokens`` are decided, in position order after
        everything decided before; the grammar matcher takes them (each was
        checked allowed before)."""
        taken = self.matcher.consume(tokens)
        if taken != len(tokens):
            error, name = (self.matcher.error() or "").split("\n", 1)[0], self.matcher.compiled.constraint.name
            if error:  # the engine gave up on the grammar (a limit): the constraint's fault
                raise GrammarLimit(f"{name}: past the grammar engine's limits while decoding ({error})", name)
            # the engine allowed a token and then refused it: its inconsistency, this constraint's alone
            raise GrammarLimit(f"{name}: the grammar engine refused token {list(tokens)[taken]}, which it had "
                               "allowed (a schema or grammar it cannot follow here)", name)

    def commit_run(self, tokens: Sequence[int], first: int) -> List[SlotCommit]:
        """Constrained mode: commit ``tokens`` at positions ``first, first+1, ...``
        (the next scratch rows hold their K/V); returns them as slot commits
        (cut at the slots' edges)."""
        if not len(tokens):
            return []
        tokens = [int(t) for t in tokens]
        positions = list(range(first, first + len(tokens)))
        self.cache.commit(tokens, positions)
        self._counted(tokens)
        self.eos_committed |= self.eos_id in tokens
        S, out, at = self.slot_size, [], 0
        while at < len(tokens):
            edge = at + S - (positions[at] - self.response_start) % S
            out.append(SlotCommit(positions[at:edge], tokens[at:edge]))
            at = edge
        return out

    def _counted(self, tokens: List[int]) -> None:
        """Answer tokens committed: the statistics and the penalties count them."""
        self.stats.committed_tokens += len(tokens)
        if self.penalties is not None:
            self.penalties.count(tokens)

    def logit_bias(self) -> Optional[mx.array]:
        """What each head row of the next pass adds to its logits (``penalties.py``; None: nothing)."""
        return None if self.penalties is None else self.penalties.vector()

    def logit_divisors(self) -> Optional[mx.array]:
        """The repetition penalty of each token for the next pass's head rows (``penalties.py``; None: none)."""
        return None if self.penalties is None else self.penalties.divisors()

    def end_step(self, phase: str, commits: List[SlotCommit]) -> Step:
        """Constrained mode: a step that committed ``commits``."""
        self.stats.steps += 1
        return Step(phase, commits, self.stats)

    def count_masks(self, seconds: float, rows: int) -> None:
        """Book the host's time computing ``rows`` grammar masks."""
        self.stats.mask_seconds += seconds
        self.stats.masks += rows

    def settle(self) -> None:
        """Drop committed rows beyond the answer's end (its EOS, or the cut at
        ``params.gen_length``), so the cache holds exactly the conversation
        so far and a next turn can continue it."""
        self.cut_at(self.response_start + len(self.response()))

    def cut_at(self, end: int) -> None:
        """Keep in the cache the conversation before this response and its rows below position ``end``."""
        rows = [r for p, r, _ in self.cache.in_position_order() if r < self.start or p < end]
        rows.sort()  # commit order kept
        if len(rows) < len(self.cache):
            self.cache.keep(rows)

    def count_pass(self, phase: str, seconds: float, host_sync: bool) -> None:
        """Book one forward this request took part in (its phase's wall time);
        ``host_sync``: it ended in a blocking evaluation (``PassResult.synced``)."""
        self.stats.forwards += 1
        self.stats.host_syncs += bool(host_sync)
        self.stats.seconds[phase] += seconds

    def finish(self) -> None:
        """The response is complete: count the answer and settle the cache."""
        self.stats.generated_tokens = len(self.response())
        self.settle()

    def end_at(self, end: int) -> None:
        """The response ends before its loop does: the cache keeps the conversation before position
        ``end`` (:meth:`cut_at`), and the answer counted is what lies before it."""
        self.cut_at(end)
        self.stats.generated_tokens = max(end - self.response_start, 0)

    def record_peak(self, peak_memory_gb: float) -> None:
        """MLX's peak memory when the response ended (weights and cache included): the process's peak, never
        reset here (as mlx-lm reads it; a caller's own measurement around it stands)."""
        self.stats.peak_memory_gb = peak_memory_gb

    # -- reading it -----------------------------------------------------------

    def response(self) -> List[int]:
        """Committed response ids in position order, up to and including the
        first EOS, and cut after ``params.gen_length`` ids besides EOS (the
        budget is whole slots; the answer is at most ``gen_length``)."""
        out, most = [], self.params.gen_length
        for p, _, t in self.cache.in_position_order(self.start):
            if p < self.response_start:
                continue
            if t != self.eos_id and len(out) == most:
                break  # the cut: an EOS right after it still ends the answer
            out.append(t)
            if t == self.eos_id:
                break
        return out
