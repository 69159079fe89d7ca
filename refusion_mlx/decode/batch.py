"""Many requests decoded together: one forward per step carries the next pass
of every active request (continuous batching).

Each request keeps its own decoder loop and its own committed cache (grown
in place, never copied per slot or per step); requests in different phases
(plan, verify, infill) and with different settings share every forward
through :func:`refusion_mlx.decode.forward.run_passes`, which keeps each
request's attention to its own rows. The decisions are the ones the request
would make alone: a request's answer does not depend on its neighbours.

New requests wait in a queue and join at a step boundary (up to
``max_batch`` active); finished and removed ones leave at the next step and
their memory goes with them.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from ..distributed.group import is_link_failure
from ..errors import DecodeError, RefusionError, brief
from .answer import AnswerText, end_ids
from .cache import CommittedCache
from .decoder import RefusionDecoder
from .fit import fitted
from .forward import run_passes
from .grammar import Compiled, Constraint, as_constraint, compile_constraint
from .kv_store import KVStorage
from .params import RefusionParams, a_params, budget_given, make_params
from .prompt import prompt_ids, prompt_list, wrapped
from .response import GenerationResponse
from .stats import DecodeStats
from .token_scores import check_top, unscored


@dataclass
class _Member:
    """One request as the batch holds it (a member of the batch): its decoder loop and its answer text."""

    uid: int
    decoder: RefusionDecoder
    answer: AnswerText
    steps: int = 0

    def response(self, step=None, final: bool = False) -> GenerationResponse:
        first = self.answer.next
        tokens, text = self.answer.update() if step is not None else ([], "")
        if self.answer.done and self.answer.last != self.answer.eos_id and not self.decoder.done:
            # a stop id besides EOS ended the answer: the decoder, which knows EOS alone, ends here
            self.decoder.end_early(self.answer.next)
            final = True
        r = GenerationResponse(text, tokens, step.commits if step else [], step.phase if step else "",
                               self.steps, len(self.decoder.prompt), self.answer.length, uid=self.uid,
                               live=self.decoder.stats)
        if self.decoder.state.logprobs is not None:  # each final token's score, by its position
            r.logprobs = [self.decoder.state.scores.get(first + i) for i in range(len(tokens))]  # None: unscored
        self.steps += step is not None
        if final:
            r.text += self.answer.finish()
            r.finish_reason = "stop" if self.answer.done else "length"
            r.stats = self.decoder.stats
            r.generation_tokens = self.answer.length
            r.cache = self.decoder.cache
        return r

    def failure(self, e: Exception) -> GenerationResponse:
        # as a request let go of: its cache holds the conversation up to what the answer released, no holes,
        # and is free for a next response; one that cannot even be cut (out of memory) is emptied, not left torn
        try:
            self.decoder.end_early(self.answer.next)
        except Exception:
            self.decoder.close()
            self.decoder.cache.free()
        return GenerationResponse("", [], [], "", self.steps, len(self.decoder.prompt),
                                  self.answer.length, finish_reason="error", stats=self.decoder.stats,
                                  uid=self.uid, error=_message(e), error_param=getattr(e, "param", None),
                                  exception=e)


class BatchGenerator:
    """Continuous batching of ReFusion requests.

    ``insert`` validates a request and queues it; ``step`` runs one forward
    over every active request and returns their responses; ``remove``
    cancels one. One thread drives it (MLX is not shared across threads).
    ``kv_bits`` (4 or 8) and ``kv_group_size`` (default 64): the requests'
    caches keep their keys and values quantized (``decode/kv_quant.py``), as
    mlx-lm takes them; or ``storage``, a :class:`~.kv_store.KVStorage`
    already made (not both; None of them: the model's dtype); checked
    against the model here (a DecodeError).
    """

    def __init__(self, model, tokenizer, max_batch: int = 8, *, kv_bits: Optional[int] = None,
                 kv_group_size: Optional[int] = None, storage: Optional[KVStorage] = None):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise DecodeError(f"max_batch must be a positive integer, got {max_batch!r}")
        mask_id = getattr(model.args, "mask_token_id", None)
        if mask_id is None:
            raise DecodeError("the model has no mask_token_id; load it with refusion_mlx.load")
        self.model, self.tokenizer, self.max_batch = model, wrapped(tokenizer), max_batch
        # how the requests' caches keep keys and values (kv_bits: quantized, decode/kv_quant.py)
        self.storage = KVStorage.given(storage, kv_bits, kv_group_size, model)
        self.mask_id, self.eos_id = int(mask_id), int(tokenizer.eos_token_id)
        self.waiting: Deque[_Member] = deque()
        self.active: List[_Member] = []
        self._next_uid = 0

    @property
    def has_work(self) -> bool:
        return bool(self.active or self.waiting)

    def insert(self, prompt: Union[str, Sequence[int]], params: Optional[RefusionParams] = None,
               cache: Optional[CommittedCache] = None, constraint: Union[Constraint, Compiled, None] = None,
               logprobs: Optional[int] = None, fit: bool = False) -> int:
        """Queue a request; returns its uid. A prompt that leaves the answer no
        room in the context raises ``DecodeError`` here, before anything is queued.

        ``prompt``: text (tokenized as is) or ids; with ``cache`` (a
        conversation so far, which the request then owns), only the new ids.
        The answer holds at most ``params.gen_length`` ids besides EOS
        (finish "length" when cut there), though the last slot decoded may
        hold more. A ``cache`` keeps keys and values in its own form; a
        new one is made in this generator's (``storage``). ``constraint``: the
        answer must match it (a JSON Schema, any JSON object, a grammar:
        :class:`~.grammar.Constraint`, or one compiled already:
        :class:`~.grammar.Compiled`); one it cannot compile raises
        ``DecodeError`` here. ``logprobs``: each
        response also carries its tokens' log-probabilities
        (``GenerationResponse.logprobs``) with this many top tokens (``decode.token_scores``);
        not with a ``constraint`` (a DecodeError: the constrained mode keeps no scores).
        ``fit`` (always so when ``params`` is None): ``params``' budget is a
        default, not the caller's, and is shrunk to the whole slots the
        context leaves after the prompt (``decode.fit``, as the commands and
        the server shrink theirs); the caller's own, where it runs past them,
        is cut to them, as the commands and the server cut theirs (as mlx-lm
        never refuses a budget): the answer then ends "length" there.
        """
        if params is not None:
            a_params(params)
        if cache is not None:
            _a_committed_cache(cache)
        ids = prompt_ids(self.tokenizer, prompt)
        vocab = self.model.args.vocab_size
        if logprobs is not None:
            logprobs = check_top(logprobs, vocab, "logprobs")
        grammar = None
        if isinstance(constraint, Compiled):  # compiled already (the server does it on the request's thread)
            grammar = constraint
        elif constraint is not None:
            grammar = compile_constraint(as_constraint(constraint), self.tokenizer, self.model.args.vocab_size,
                                         self.eos_id, mask_id=self.mask_id)
        if grammar is not None and logprobs is not None:  # the constrained mode keeps no scores
            raise DecodeError(unscored("logprobs", grammar.constraint.name))
        if cache is None:
            cache = CommittedCache.for_model(self.model, storage=self.storage)
        params = fitted(params or RefusionParams(), cache.next_position + len(ids),
                        self.model.args.max_position_embeddings, default=params is None or fit)
        decoder = RefusionDecoder(self.model, ids, params, mask_id=self.mask_id, eos_id=self.eos_id, cache=cache,
                                  grammar=grammar, logprobs=logprobs,
                                  xtc_keep=self.xtc_keep() if params.xtc_probability else ())
        uid, self._next_uid = self._next_uid, self._next_uid + 1
        answer = AnswerText(self.tokenizer, decoder.cache, decoder.response_start, self.eos_id,
                            decoder.params.gen_length, stops=self.stop_ids())
        self.waiting.append(_Member(uid, decoder, answer))
        return uid

    def xtc_keep(self) -> tuple:
        """The tokens XTC never drops, as mlx-lm's generate and server give them: the end ids and the
        newline's."""
        return (*self.tokenizer.encode("\n", add_special_tokens=False), *end_ids(self.tokenizer))

    def stop_ids(self) -> frozenset:
        """Ids besides EOS that end an answer: the tokenizer's other end ids
        (mlx-lm's ``eos_token_ids``: a checkpoint's ``generation_config.json``
        list, ``add_eos_token``). The decoder's algorithm knows EOS alone
        (the paper's loop); an answer reaching one of these ends there, "stop"."""
        vocab = self.model.args.vocab_size
        return frozenset(t for t in end_ids(self.tokenizer) if 0 <= t < vocab) - {self.eos_id}

    def end(self, uid: int) -> Optional[DecodeStats]:
        """End an active request before its decoder does (a stop string the
        caller found): removed, its cache settled to the answer's final part
        (``remove(settle=True)``); its statistics so far."""
        member = next((r for r in self.active if r.uid == uid), None)
        if member is None:
            return None
        self.remove(uid, settle=True)
        return member.decoder.stats

    def remove(self, uid: int, settle: bool = False) -> bool:
        """Cancel a request (queued or active); True if it was there.
        ``settle``: its cache keeps the conversation up to the answer's final
        part (what its responses released), for a caller that goes on with it."""
        for queue in (self.waiting, self.active):
            for r in list(queue):
                if r.uid == uid:
                    queue.remove(r)
                    if settle:
                        r.decoder.end_early(r.answer.next)
                    else:
                        r.decoder.close()
                    return True
        return False

    def step(self) -> List[GenerationResponse]:
        """One forward over every active request; their responses of this step.

        The forward blocks (one host synchronisation) unless every request's
        pass in it keeps its values on the device (``run_passes``): one
        request planning while another drafts an infill makes it blocking."""
        while self.waiting and len(self.active) < self.max_batch:
            self.active.append(self.waiting.popleft())
        if not self.active:
            return []
        out: List[GenerationResponse] = []
        passes, running = [], []
        for r in self.active:
            try:
                passes.append(r.decoder.next_pass())
                running.append(r)
            except Exception as e:  # a failure of this request's own loop: it fails alone
                _fatal(e)
                out.append(r.failure(e))
        t0 = time.perf_counter()
        try:
            results = run_passes(self.model, passes) if passes else []
        except Exception as e:  # the shared forward failed (e.g. out of memory): all of it fails
            _fatal(e)
            out += [r.failure(e) for r in running]
            self.active = []
            return out
        seconds = time.perf_counter() - t0
        for r, result in zip(running, results):
            try:
                out += self._advance(r, result, seconds)
            except Exception as e:
                _fatal(e)
                out.append(r.failure(e))
        done = {o.uid for o in out if o.finish_reason is not None}
        self.active = [r for r in self.active if r.uid not in done]
        return out

    def _advance(self, r: _Member, result, seconds: float) -> List[GenerationResponse]:
        steps = r.decoder.take(result, seconds)
        ended = r.decoder.done
        if ended:
            r.decoder.state.record_peak(mx.get_peak_memory() / 1e9)
        out, todo = [], steps or ([None] if ended else [])
        for i, s in enumerate(todo):
            out.append(r.response(s, final=ended and i == len(todo) - 1))
            if out[-1].finish_reason is not None:  # a stop id may end it at any step
                break
        return out


def check_form(cache: CommittedCache, storage) -> None:
    """A DecodeError unless ``cache`` keeps keys and values as ``storage`` does; an empty one (made with
    ``CommittedCache.for_model`` and never used) takes that form, as mlx-lm quantizes a fresh prompt cache."""
    _a_committed_cache(cache)
    mine, theirs = storage.describe(cache.spec), cache.storage.describe(cache.spec)
    if mine != theirs and not cache.take_form(storage):
        raise DecodeError(f"the cache keeps keys and values as {theirs}, not as {mine} (kv_bits)")


def _a_committed_cache(cache) -> None:
    if not isinstance(cache, CommittedCache):
        raise DecodeError(f"cache must be a CommittedCache (CommittedCache.for_model(model)), got "
                          f"{type(cache).__name__} (mlx-lm's prompt caches are not taken)")


def _fatal(e: Exception) -> None:
    """A lost rank or link (``mlx.launch`` runs): no request can go on, so
    the error ends the step instead of failing requests one by one."""
    if is_link_failure(e):
        raise e


def _message(e: Exception) -> str:
    if isinstance(e, RefusionError):
        return str(e)
    return brief(e)


# --------------------------------------------------------------------------
# Whole answers for a list of prompts


@dataclass
class BatchResult:
    """One prompt's whole answer: text, response ids in position order
    through the first EOS, why it finished, its statistics (and the error
    of a request that failed alone)."""

    text: str = ""
    output_ids: List[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stats: Optional[DecodeStats] = None
    prompt_ids: List[int] = field(default_factory=list)
    error: Optional[str] = None

    def add(self, response: GenerationResponse) -> bool:
        """Take one of the prompt's responses (as :func:`stream_batch` yields them); True once it is the last."""
        self.text += response.text
        self.output_ids += response.tokens
        if response.finish_reason is not None:
            self.finish_reason, self.stats, self.error = response.finish_reason, response.stats, response.error
        return response.finish_reason is not None


def batch_generate(model, tokenizer, prompts: Sequence[Union[str, Sequence[int]]],
                   params: Union[RefusionParams, Sequence[RefusionParams], None] = None,
                   max_batch: int = 8, constraints: Optional[Sequence[Optional[Constraint]]] = None, *,
                   kv_bits: Optional[int] = None, kv_group_size: Optional[int] = None,
                   storage: Optional[KVStorage] = None, **kwargs) -> List[BatchResult]:
    """Decode many prompts together; one result per prompt, in order.

    ``prompts``: strings (tokenized as is) or token-id lists. ``params``: one
    RefusionParams for all, a list with one per prompt, or decoding keywords
    as in ``generate`` (``max_tokens``, ``slot_size``, ...). A prompt that
    cannot be decoded (over the context, bad settings) gets a result with
    ``finish_reason`` "error" and the message in ``error``; the rest finish.
    ``constraints``: one :class:`~.grammar.Constraint` (or None) per prompt.
    ``kv_bits`` / ``kv_group_size``: quantized KV caches, as mlx-lm takes
    them (or ``storage``, a :class:`~.kv_store.KVStorage` already made).
    """
    ids = _prepared(tokenizer, prompts)
    results = [BatchResult(prompt_ids=i if isinstance(i, list) else []) for i in ids]
    storage = KVStorage.given(storage, kv_bits, kv_group_size)
    for index, response in _stream(model, tokenizer, ids, params, max_batch, constraints, storage, kwargs):
        results[index].add(response)
    return results


def stream_batch(model, tokenizer, prompts: Sequence[Union[str, Sequence[int]]],
                 params: Union[RefusionParams, Sequence[RefusionParams], None] = None,
                 max_batch: int = 8, constraints: Optional[Sequence[Optional[Constraint]]] = None, *,
                 kv_bits: Optional[int] = None, kv_group_size: Optional[int] = None,
                 storage: Optional[KVStorage] = None, **kwargs) -> Iterator[Tuple[int, GenerationResponse]]:
    """Like ``batch_generate``, streaming: yields ``(index, response)`` as
    each prompt's text becomes final (index: the prompt's place in ``prompts``)."""
    yield from _stream(model, tokenizer, _prepared(tokenizer, prompts), params, max_batch, constraints,
                       KVStorage.given(storage, kv_bits, kv_group_size, model), kwargs)


def _stream(model, tokenizer, prompts: List[Union[List[int], DecodeError]], params, max_batch: int,
            constraints, storage: Optional[KVStorage], kwargs) -> Iterator[Tuple[int, GenerationResponse]]:
    per_prompt = _params_per_prompt(params, kwargs, len(prompts))
    fit = params is None and not budget_given(kwargs)  # a default budget: each prompt's shrunk to fit
    constraints = list(constraints) if constraints is not None else [None] * len(prompts)
    if len(constraints) != len(prompts):
        raise DecodeError(f"{len(constraints)} constraints for {len(prompts)} prompts")
    gen = BatchGenerator(model, tokenizer, max_batch=max_batch, storage=storage)
    index: Dict[int, int] = {}
    try:
        for i, (ids, p, c) in enumerate(zip(prompts, per_prompt, constraints)):
            try:
                if isinstance(ids, DecodeError):
                    raise ids
                index[gen.insert(ids, p, constraint=c, fit=fit)] = i
            except RefusionError as e:  # this prompt fails alone
                yield i, GenerationResponse("", [], [], "", 0, len(ids) if isinstance(ids, list) else 0, 0,
                                            finish_reason="error", error=str(e))
        while gen.has_work:
            for response in gen.step():
                response.cache = None  # not kept: the batch's caches would outlive their requests
                yield index[response.uid], response
    finally:  # let go of early (a break, an error): every request's cache is freed now, not at a later gc
        for uid in index:
            gen.remove(uid)


def _prepared(tokenizer, prompts) -> List[Union[List[int], DecodeError]]:
    """Each prompt's ids, or the DecodeError that prompt fails with alone."""
    out: List[Union[List[int], DecodeError]] = []
    for i, p in enumerate(prompt_list(prompts)):
        try:
            out.append(prompt_ids(tokenizer, p, f"prompts[{i}]"))
        except DecodeError as e:
            out.append(e)
    return out


def _params_per_prompt(params, kwargs, n: int) -> List[RefusionParams]:
    if params is not None and kwargs:
        raise TypeError("give params or decoding keywords, not both")
    if params is None:
        return [make_params(**kwargs)] * n
    if isinstance(params, RefusionParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise DecodeError(f"{len(params)} parameter sets for {n} prompts")
    return params
