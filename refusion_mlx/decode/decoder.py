"""ReFusion's slot-level plan-and-infill decoding loop for one request (the paper's, arXiv 2512.13586; docs/design.md).

For each block, while it has open slots:

(a) **plan** (``plan.py``): one pass over the block's open slots, all masks,
    proposes a draft for every position; slots whose first token is
    confident enough are selected (at least the most confident one);
(b) **verify** (``verify.py``): one pass over the selected drafts checks them
    left to right; an accepted prefix of whole slots (or up to an EOS) is
    **committed** (``commit.py``);
(c) otherwise **infill** (``infill.py``): the selected slots are decoded in
    parallel, each against the shared committed cache plus its own tokens,
    draft/verify rounds until every token is accepted; their K/V are then
    committed as is.

The request's state (committed cache, open slots, key, statistics, whether
EOS was committed) is one :class:`~refusion_mlx.decode.state.DecodeState`;
the steps read it and return a pass or a decision, and only the state's own
methods change it (``state.py`` says who owns the cache and when).

The loop is a generator that *yields* the pass it needs next and receives
its result, so a request never runs its own forward: alone (``steps``) or
in a batch with other requests (:mod:`refusion_mlx.decode.batch`), the
same loop makes the same decisions. Everything numeric stays on the device;
the host receives only what a decision needs: the slot confidences after
planning, the verified probabilities after verification and each infill
round.
"""

from __future__ import annotations

import time
import weakref
from typing import Generator, Iterator, List, Optional, Sequence

import mlx.core as mx

from .._threads import free_streams_at_thread_end
from ..errors import DecodeError
from . import commit, constrain, plan, prefill, verify
from .cache import CommittedCache
from .forward import Pass, PassResult, run_passes
from .infill import infill
from .params import RefusionParams, seed_bits
from .penalties import Penalties
from .state import DecodeState
from .stats import DecodeStats, Step
from .token_scores import SlotScores

NO_EOS = -1  # eos_id None: an id no token has, so nothing ends the answer early


class RefusionDecoder:
    """One response: plan, verify, infill and commit over a committed cache.

    ``cache``: a CommittedCache to continue (a conversation so far); the
    prompt is then only the new tokens after it. ``prefill_chunk``: the most
    prompt tokens one prefill pass feeds. ``eos_id`` None: no token ends the answer, the whole budget
    is decoded (the speed benchmarks' ``--ignore-eos``). ``grammar``: a
    compiled constraint (:func:`~refusion_mlx.decode.grammar.compile_constraint`):
    the answer is decoded in the constrained mode (``constrain.py``). ``logprobs``: keep the
    probability each answer token was accepted under, with this many top
    tokens (``token_scores``; None: not kept). ``xtc_keep``: tokens besides EOS that XTC never drops (mlx-lm's
    special ones: the tokenizer's other end ids and a newline; ``BatchGenerator`` gives them).
    """

    def __init__(self, model, prompt: Sequence[int], params: RefusionParams, *,
                 mask_id: int, eos_id: Optional[int], cache: Optional[CommittedCache] = None,
                 prefill_chunk: int = prefill.PREFILL_CHUNK,
                 grammar=None, logprobs: Optional[int] = None, xtc_keep: Sequence[int] = ()):
        free_streams_at_thread_end()  # a worker thread that decodes frees its MLX streams as it ends
        self.model = model
        layout = params.layout()
        cache = cache if cache is not None else CommittedCache.for_model(model)
        check_free(cache)
        self.prompt = [int(t) for t in prompt]
        if not self.prompt:
            raise DecodeError("the prompt is empty")
        self.first_position = cache.next_position
        response_start = self.first_position + len(self.prompt)
        check_context(model, response_start, params)
        vocab = model.args.vocab_size
        eos_id = NO_EOS if eos_id is None else eos_id
        for name, tid in (("mask", mask_id), ("eos", eos_id)):
            if not 0 <= int(tid) < vocab and not (name == "eos" and tid == NO_EOS):
                raise DecodeError(f"{name} token id {tid} is outside the vocabulary of {vocab}")
        bad = [t for t in self.prompt if not 0 <= t < vocab]
        if bad:
            raise DecodeError(f"prompt token id {bad[0]} is outside the vocabulary of {vocab}")
        self.prefill_chunk = max(int(prefill_chunk), 1)
        self.state = DecodeState(
            params=params, layout=layout, mask_id=int(mask_id), eos_id=int(eos_id), vocab=vocab, cache=cache,
            start=len(cache), response_start=response_start,
            stats=DecodeStats(prompt_tokens=len(self.prompt), layout=layout.describe()),
            key=mx.random.key(seed_bits(params.seed)) if params.seed is not None else None,
            matcher=grammar.matcher() if grammar is not None else None, logprobs=logprobs,
            penalties=Penalties.of(params, vocab, [*cache.tokens, *self.prompt]), xtc_keep=tuple(xtc_keep))
        self.steps_done: List[Step] = []  # committed steps not yet handed out
        self._loop = self._run()
        self._pass: Optional[Pass] = None
        self.done = False
        cache.decoding = weakref.ref(self)  # one response decodes into a cache at a time

    # -- the state, as callers read it ---------------------------------------

    @property
    def params(self) -> RefusionParams:
        return self.state.params

    @property
    def layout(self):
        return self.state.layout

    @property
    def cache(self) -> CommittedCache:
        return self.state.cache

    @property
    def stats(self) -> DecodeStats:
        return self.state.stats

    @property
    def response_start(self) -> int:
        return self.state.response_start

    # -- driving the loop ----------------------------------------------------

    def next_pass(self) -> Pass:
        """The pass this request needs next (the same until ``take``)."""
        if self._pass is None:
            self._pass = self._biased(next(self._loop))
        return self._pass

    def _biased(self, p: Pass) -> Pass:
        """The loop's next pass, its head rows biased as the request's penalties say (``penalties.py``)."""
        if p.head_rows:
            p.bias, p.repeat = self.state.logit_bias(), self.state.logit_divisors()
        return p

    def take(self, result: PassResult, seconds: float = 0.0) -> List[Step]:
        """Hand over the result of the pass; returns the steps it completed.

        ``seconds``: the wall time of the forward it shared, booked to the
        pass's phase.
        """
        p = self._pass
        self.state.count_pass(p.phase, seconds, result.synced)
        try:
            self._pass = self._biased(self._loop.send(result))
        except StopIteration:
            self._pass = None
            self.done = True
        steps, self.steps_done = self.steps_done, []
        return steps

    def close(self) -> None:
        """Abandon the response: end the paused loop now, so its cache and
        arrays go at once (a paused generator holds them in a cycle)."""
        self._loop.close()
        self._pass, self.done = None, True

    def end_early(self, end: int) -> None:
        """End the response before its loop does (a stop id the decoder does
        not know, or a caller that lets go): the loop closed, and the cache
        kept to the conversation before position ``end`` -- the answer as far
        as it became final, as :meth:`DecodeState.settle` keeps a finished one."""
        self.close()
        self.state.end_at(end)

    def steps(self) -> Iterator[Step]:
        """Run the whole response alone, yielding each step that commits tokens."""
        while not self.done:
            p = self.next_pass()
            t0 = time.perf_counter()
            (result,) = run_passes(self.model, [p])
            yield from self.take(result, time.perf_counter() - t0)
        self.state.record_peak(mx.get_peak_memory() / 1e9)

    # -- the loop ------------------------------------------------------------

    def _run(self) -> Generator[Pass, PassResult, None]:
        state = self.state
        # every row this response can write: the cache doubles up to them as it is written, a few copies in all
        state.cache.plan(len(state.cache) + len(self.prompt) + state.layout.gen_length)
        tail = yield from self._prefill_head()
        if state.matcher is not None:  # constrained: one frontier, checked by the grammar
            yield from constrain.decode(state, tail, lambda step: self.steps_done.append(step))
            state.finish()
            return
        block_start = 0
        for block_len in state.layout.block_lengths:
            state.open_block(block_start, block_len)
            block_start += block_len
            while state.open_slots:
                step = yield from self._step(tail)
                tail = []
                self.steps_done.append(step)
            if state.eos_committed:
                break
        state.finish()

    def _prefill_head(self):
        """Prompt chunks before the first plan (all but the last
        ``prefill_chunk`` tokens); returns the tail that plan carries."""
        done = yield from prefill.passes(self.state.cache, self.prompt, self.first_position,
                                         self.prefill_chunk, leave=self.prefill_chunk)
        return self.prompt[done:]

    def _step(self, tail: List[int]):
        """(a) plan, (b) verify, then commit -- or (c) infill, then commit."""
        state = self.state
        planned = yield plan.plan_pass(state, tail)
        state.commit_prompt_tail(tail)  # the first pass also prefilled the prompt's tail
        confidence = planned["confidence"]
        selected = plan.select(confidence, state.params.slot_threshold)
        checking, positions = verify.verify_pass(state, planned["drafts"], confidence, selected)
        checked = yield checking
        tokens = checked["tokens"]
        accepted = verify.accepted(checked["probs"], state.params.token_threshold)
        scores = SlotScores.after_verify(planned, checked, selected) if state.logprobs is not None else None
        decision = commit.after_verify(state, tokens, accepted, positions, selected)
        if decision is None:
            final, eos_found = yield from infill(state, tokens, accepted, positions, scores)
            decision = commit.after_infill(state, final, eos_found, positions, selected)
        if scores is not None:
            state.record_scores(decision.positions[:decision.end], scores.entries(decision.end))
        return state.commit(decision.phase, decision.tokens, decision.end, decision.positions, decision.closed)

    # -- the answer ----------------------------------------------------------

    def response(self) -> List[int]:
        """Committed response ids in position order, up to and including the first EOS, and cut after
        ``params.gen_length`` ids besides EOS (:meth:`DecodeState.response`)."""
        return self.state.response()


def check_free(cache: CommittedCache) -> None:
    """The DecodeError of a cache a response is still decoding into (one at a time); nothing when it is free."""
    holder = cache.decoding() if cache.decoding is not None else None
    if holder is not None and not holder.done:
        raise DecodeError("the cache is in use: a response is still decoding into it (finish or close it first)")


def check_context(model, response_start: int, params: RefusionParams) -> None:
    """The DecodeError of an answer at ``response_start`` (the prompt's length after the cache's) whose
    budget, in whole slots, runs past the model's context; nothing when it fits."""
    layout = params.layout()
    limit = model.args.max_position_embeddings
    if response_start + layout.gen_length > limit:
        asked = params.gen_length  # the budget the caller gave, decoded in whole slots
        budget = f"max_tokens {asked}" + (f", {layout.gen_length} in whole slots" if asked != layout.gen_length
                                          else "")
        left = limit - response_start
        raise DecodeError(f"prompt ({response_start} tokens) + {budget} exceeds the model's context of {limit} "
                          "positions (" + (f"{left} are left after the prompt)" if left > 0 else
                                           "the prompt alone fills it)" if left == 0 else
                                           "the prompt alone is over it)"))
