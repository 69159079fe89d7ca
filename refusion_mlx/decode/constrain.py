"""Constrained mode: every committed token is one the grammar allows after
everything before it in *position* order, and slots still go in parallel
(docs/constrained.md).

The grammar engines are left-to-right matchers, so this mode keeps one
*frontier*: every position before it is committed and the request's matcher
has taken those tokens in position order. Each step is **one pass** over three
runs at their true positions after the committed cache:

* ``known`` -- tokens decided, allowed, not yet in the cache: the last step's
  bonus token and what the grammar forces after it (a schema's fixed keys,
  braces, quotes; EOS once the grammar is complete). They are committed with
  this pass's K/V, so everything to their right is conditioned on them;
* ``drafts`` -- the model's drafts for the next positions (planned by mask
  rows of earlier passes; at most ``block_length`` of them), verified as ReFusion's global verification does:
  a slot's first token is accepted when the grammar allows it (its slot was
  selected by its planning confidence, as REFUSION.md §4a), every other token
  when its probability under the logits one position before it, *masked by
  the grammar's state after the tokens before it*, is above
  ``token_threshold`` (a token the grammar refuses scores 0). The longest
  accepted prefix is committed;
* ``masks`` -- the mask id over the next ``block_length`` positions:
  ReFusion's planning drafts for the steps to come, conditioned on all of the
  above; the first one is drafted under the grammar's mask.

The **bonus** token is the grammar-masked draft of the position after the
accepted prefix, from the row the model's conventions (REFUSION.md §1) give it:
the token before it when it is inside a slot, the mask row at it when it
opens a slot (there is one when every draft was accepted; else the next
step's first mask row plans it). It is always allowed and opens the next
step's ``known`` run. So a step commits at least one token unless a slot's
first token is pending, and as many as the model is sure of.

The masks are computed on the host from tokens the host already holds, while
the device runs the pass's layers (``Pass.masks``: ``run_passes`` starts the
layers with ``mx.async_eval`` and applies the masks at the head), so the step
keeps its one host synchronisation. EOS is allowed only where the grammar
accepts: an answer that ends with EOS is complete and valid; one cut by the
budget finishes "length".
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Generator, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from .forward import HeadOutput, Pass, PassResult
from .plan import drafting
from .state import DecodeState
from .stats import Step


class Run:
    """One step's runs: ``known`` from ``frontier``, then ``drafts``, then
    ``masks`` mask ids; the head rows are the last known row (when there is
    one: it scores the first draft), every draft row and every mask row."""

    def __init__(self, frontier: int, known: List[int], drafts: List[int], masks: int):
        self.frontier, self.known, self.drafts, self.masks = frontier, known, drafts, masks
        self.kend = frontier + len(known)
        self.dend = self.kend + len(drafts)
        self.known_row = 1 if known else 0

    @property
    def head(self) -> int:
        return self.known_row + len(self.drafts) + self.masks if (self.drafts or self.masks) else 0

    def row_before(self, i: int) -> int:
        """The head row whose logits predict draft ``i``'s position (or, for
        ``i == len(drafts)``, the first mask position): -1 when none."""
        return self.known_row + i - 1


def decode(state: DecodeState, tail: List[int],
           emit: Callable[[Step], None]) -> Generator[Pass, PassResult, None]:
    """The constrained loop of one response: passes until EOS or the budget.

    ``tail``: prompt tokens the first pass still prefills. ``emit`` receives
    each step that committed tokens.
    """
    S, p = state.slot_size, state.params
    window = state.layout.block_lengths[0]
    # the answer's positions are before the budget asked, not the whole slots it is decoded in (EOS may be at it)
    end = state.response_start + p.gen_length
    frontier = state.response_start
    known = after(state, [], frontier, end)
    buffered: Dict[int, Tuple[int, float]] = {}  # position -> (draft, confidence) of the latest mask rows
    while known or frontier < end:
        kend = frontier + len(known)
        done = bool(known) and known[-1] == state.eos_id
        # at most a window of drafts: while the grammar refused them, each pass verified all it had buffered
        # and planned a window more (813-row passes, every step of the batch slowed 30x)
        drafts = [] if done or not known else select(buffered, kend, min(end, kend + window), state.response_start,
                                                      S, p.slot_threshold)
        masks = 0 if done else max(min(window, end - kend - len(drafts)), 0)
        run = Run(frontier, known, drafts, masks)
        passed = yield constrained_pass(state, tail, run)
        state.commit_prompt_tail(tail)  # the first pass also prefilled the prompt's tail
        tail = []
        commits = state.commit_run(known, frontier)
        frontier = run.kend
        if state.eos_committed or run.head == 0:
            if commits:
                emit(state.end_step("verify", commits))
            break
        host = {k: np.asarray(v) for k, v in passed.host.items()}
        accepted = verified(run, host["p_follow"], state, S, p.token_threshold)
        state.decide(drafts[:accepted])
        commits += state.commit_run(drafts[:accepted], frontier)
        frontier += accepted
        if commits:
            emit(state.end_step("verify", commits))
        if state.eos_committed:
            break
        first_mask = run.known_row + len(drafts)
        for j in range(masks):  # the mask rows' drafts, for the steps to come
            buffered[run.dend + j] = (int(host["draft"][first_mask + j]), float(host["p_draft"][first_mask + j]))
        for q in [q for q in buffered if q <= frontier]:
            del buffered[q]
        b = bonus(run, accepted, host["draft"], state.response_start, S, end)
        known = after(state, [] if b is None else [b], frontier, end)


def after(state: DecodeState, decided: List[int], first: int, end: int) -> List[int]:
    """``decided`` (allowed tokens from position ``first``) and what the
    grammar forces after them, all handed to the matcher; EOS once the
    grammar is complete (nothing else may follow). Positions stop at ``end``;
    an EOS the model drafts may stand at ``end`` itself (the answer then holds
    exactly ``gen_length`` tokens and ends as "stop"). A grammar that still
    accepts more at the budget's end is cut there, as an unconstrained answer
    is ("length"): forcing EOS would report a cut answer as finished."""
    state.decide(decided)
    out = list(decided)
    if not (out and out[-1] == state.eos_id):
        forced = state.matcher.forced()[:max(end - first - len(out), 0)]
        state.decide(forced)
        out += forced
        if state.matcher.stopped:
            state.decide([state.eos_id])
            out.append(state.eos_id)
    return out


def slot_start(q: int, response_start: int, S: int) -> bool:
    return (q - response_start) % S == 0


def select(buffered: Dict[int, Tuple[int, float]], start: int, end: int, response_start: int, S: int,
           threshold: float) -> List[int]:
    """The drafts to verify: the buffered run from ``start`` to the end of its
    slot, then each next whole slot while its first draft's planning
    confidence is above ``threshold`` (the slot threshold, REFUSION.md §4a)."""
    out: List[int] = []
    q = start
    while q < end and q in buffered:
        if out and slot_start(q, response_start, S) and buffered[q][1] <= threshold:
            break
        out.append(buffered[q][0])
        q += 1
    return out


def verified(run: Run, p_follow: np.ndarray, state: DecodeState, S: int, threshold: float) -> int:
    """How many leading drafts are accepted: a slot's first token when the
    grammar allows it, any other when its masked probability under the row
    before it is above ``threshold`` (0 for a token the grammar refuses)."""
    allowed = state.matcher.valid_prefix(run.drafts)
    accepted = 0
    for i in range(allowed):
        q = run.kend + i
        if not slot_start(q, state.response_start, S):
            row = run.row_before(i)
            if row < 0 or not p_follow[row] > threshold:
                break
        accepted += 1
    return accepted


def bonus(run: Run, accepted: int, drafts: np.ndarray, response_start: int, S: int, end: int) -> Optional[int]:
    """The grammar-masked draft of the position after the accepted prefix, or
    None (past the budget, or a slot's first token with no mask row at it)."""
    q = run.kend + accepted
    if q >= end:
        return None
    row = run.row_before(accepted)
    if not slot_start(q, response_start, S) and row >= 0:
        return int(drafts[row])
    if q == run.dend and run.masks:
        return int(drafts[run.known_row + len(run.drafts)])
    return None


def constrained_pass(state: DecodeState, tail: List[int], run: Run) -> Pass:
    """One pass: ``tail`` (prompt), the run's known tokens, drafts and mask
    ids, at consecutive positions from ``run.frontier - len(tail)``."""
    known, drafts, head = run.known, run.drafts, run.head
    tokens = tail + known + drafts + [state.mask_id] * run.masks
    positions = list(range(run.frontier - len(tail), run.dend + run.masks))
    phase = "prefill" if tail else ("verify" if known or drafts else "plan")
    if head == 0:  # only known tokens (the last ones, up to EOS or the budget)
        return Pass(phase, mx.array(tokens, dtype=mx.int32), mx.array(positions, dtype=mx.int32),
                    state.cache.extend(len(tokens)))
    # each row scores the token after it: the last known row the first draft, draft i draft i + 1
    follow = ([drafts[0] if drafts else 0] if known else []) + drafts[1:] + [0] * head
    matcher = state.matcher

    def grammar_masks() -> np.ndarray:
        """Per head row, the grammar's state before the token that row
        predicts (computed while the device runs the layers); rows whose
        state is unknown (after a refused draft, later mask rows) allow all."""
        t0 = time.perf_counter()
        walk = matcher.masks(drafts)  # now, after drafts[:1], after drafts[:2], ...
        rows = np.full((head, walk.shape[1]), -1, dtype=np.int32)
        if known:
            rows[0] = walk[0]
        rows[run.known_row:run.known_row + len(drafts)] = walk[1:]
        if run.masks:
            rows[run.known_row + len(drafts)] = walk[len(drafts)]
        state.count_masks(time.perf_counter() - t0, len(walk))
        return rows

    def derive(h: HeadOutput):
        return {"draft": h.draft, "p_draft": h.p_draft, "p_follow": h.p_follow}, {}

    return Pass(phase, mx.array(tokens, dtype=mx.int32), mx.array(positions, dtype=mx.int32),
                state.cache.extend(len(tokens)), head_rows=head, drafting=drafting(state, head),
                follow=mx.array(follow[:head], dtype=mx.int32), derive=derive, masks=grammar_masks)
