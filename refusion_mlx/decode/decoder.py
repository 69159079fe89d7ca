"""ReFusion's slot-level plan-and-infill decoding loop for one request (REFUSION.md §4).

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
from typing import Generator, Iterator, List, Optional, Sequence

import mlx.core as mx

from ..errors import DecodeError
from . import commit, plan, verify
from .cache import CommittedCache
from .forward import Pass, PassResult, run_passes
from .infill import infill
from .params import RefusionParams
from .stats import DecodeStats, Step


class RefusionDecoder:
    """One response: plan, verify, infill and commit over a committed cache.

    ``cache``: a CommittedCache to continue (a conversation so far); the
    prompt is then only the new tokens after it.
    """

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
        self.stats = DecodeStats(prompt_tokens=len(self.prompt), layout=self.layout.describe())
        self.key = mx.random.key(params.seed) if params.seed is not None else None
        self.vocab = vocab
        self.eos_committed = False
        self.steps_done: List[Step] = []  # committed steps not yet handed out
        self._loop = self._run()
        self._pass: Optional[Pass] = None
        self.done = False

    # -- driving the loop ----------------------------------------------------

    def next_pass(self) -> Pass:
        """The pass this request needs next (the same until ``take``)."""
        if self._pass is None:
            self._pass = next(self._loop)
        return self._pass

    def take(self, result: PassResult, seconds: float = 0.0) -> List[Step]:
        """Hand over the result of the pass; returns the steps it completed.

        ``seconds``: the wall time of the forward it shared, booked to the
        pass's phase.
        """
        p = self._pass
        self.stats.forwards += 1
        self.stats.host_syncs += bool(result.host)
        self.stats.seconds[p.phase] += seconds
        try:
            self._pass = self._loop.send(result)
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

    def steps(self) -> Iterator[Step]:
        """Run the whole response alone, yielding each step that commits tokens."""
        mx.reset_peak_memory()  # peak of this response (weights and cache included)
        while not self.done:
            p = self.next_pass()
            t0 = time.perf_counter()
            (result,) = run_passes(self.model, [p])
            yield from self.take(result, time.perf_counter() - t0)
        self.stats.peak_memory_gb = mx.get_peak_memory() / 1e9

    # -- the loop ------------------------------------------------------------

    def _run(self) -> Generator[Pass, PassResult, None]:
        S = self.params.slot_size
        # every row this response can write: one allocation, no growth mid-decode
        self.cache.reserve(len(self.prompt) + self.layout.gen_length)
        tail = yield from self._prefill_head()
        block_start = 0
        for block_len in self.layout.block_lengths:
            open_slots = list(range(block_start, block_start + block_len, S))
            block_start += block_len
            while open_slots:
                step = yield from self._step(open_slots, tail)
                tail = []
                self.stats.steps += 1
                self.steps_done.append(step)
            if self.eos_committed:
                break
        self.stats.generated_tokens = len(self.response())
        self.settle()

    def _prefill_head(self):
        """Prompt chunks before the first plan; returns the tail it carries."""
        done = 0
        for tokens, positions in plan.prefill_chunks(self.prompt, self.first_position, self.prefill_step):
            yield Pass("prefill", mx.array(tokens, dtype=mx.int32), mx.array(positions, dtype=mx.int32),
                       self.cache.extend(len(tokens)))
            self.cache.commit(tokens, positions)
            done += len(tokens)
        return self.prompt[done:]

    def _step(self, open_slots: List[int], tail: List[int]):
        """(a) plan, (b) verify, then commit -- or (c) infill, then commit."""
        planned = yield plan.plan_pass(self, open_slots, tail)
        if tail:  # the first pass also prefilled the prompt's tail
            start = self.response_start - len(tail)
            self.cache.commit(tail, list(range(start, self.response_start)))
        confidence = planned["confidence"]
        selected = plan.select(confidence, self.params.slot_threshold)
        checking, positions = verify.verify_pass(self, planned["drafts"], confidence, selected, open_slots)
        checked = yield checking
        tokens = checked["tokens"]
        accepted = verify.accepted(checked["probs"], self.params.token_threshold)
        step = commit.after_verify(self, tokens, accepted, positions, selected, open_slots)
        if step is None:
            final, eos_found = yield from infill(self, tokens, accepted, positions)
            step = commit.after_infill(self, final, eos_found, positions, selected, open_slots)
        return step

    # -- the answer ----------------------------------------------------------

    def response(self) -> List[int]:
        """Committed response ids in position order, up to and including the first EOS."""
        return commit.response(self)

    def settle(self) -> None:
        """Drop committed rows beyond the answer's EOS (see ``commit.settle``)."""
        commit.settle(self)
