"""The one request shape inside the server, and the one place it is made.

:class:`EngineRequest` is what the engine runs, whichever API asked for it.
Each API's adapter at the edge (OpenAI's chat and text completions:
:func:`..protocols.openai_bodies.openai_request`; the Responses API: :mod:`..protocols.responses_api`;
Anthropic's Messages API: :mod:`..protocols.anthropic_api`) only translates its body
into a :class:`Draft` -- the prompt's ids (:meth:`RequestTerms.prompt_ids`
tokenizes its source: messages and tools for the chat template, text or
ids), the most tokens and the name its API gives them, the decoding fields
given, stop strings, the tools whose calls to look for, its constraint,
logprobs or scoring -- and :func:`finish` does the rest, once, for every
API: the context checks, the default ``max_tokens``, the server's decoding
settings under the request's own and the block layout (:func:`resolve`),
the server's call grammar, the sample's seed and the prompt cache's owner.
A bad request is one :class:`~.refusal.Refusal` naming the field as that
API calls it.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ...decode.grammar import Constraint
from ...decode.fit import ContextError, fit_budget
from ...decode.params import PARAM_NAMES, SEEDS, BlockLayout, RefusionParams
from ...decode.token_scores import unscored
from ...errors import DecodeError
from .memory import widest_pass
from .refusal import Reason, Refusal, field_of
from .structured import with_call_grammar

log = logging.getLogger("refusion_mlx.server")


@dataclass(frozen=True)
class EngineRequest:
    """A generation as the engine runs it: the prompt's ids, the decoding
    settings (``params``; its ``gen_length`` is ``max_tokens``), the stop
    strings, whether each step's commits are wanted (the web page's slot
    view: ``stream_options.include_commits``), the ``tools`` (in the chat
    template's form) whose calls the answer is read for (none: its text is
    only text), whether it may make several (``parallel_tool_calls``; no:
    it ends after the first), the ``api`` that asked (``/metrics``),
    whose prompt-cache entries it may continue and leave (``cache_owner``:
    a hash of its API key and ``user``, set at the edge by
    ``Answering.answer``; "" is everyone's, None: it neither reads nor
    leaves any), and the ``constraint`` its answer is decoded under
    (structured output, a forced call: :mod:`.structured`; None:
    unconstrained), ``compiled`` on the request's thread (a
    :class:`~refusion_mlx.decode.grammar.Compiled`; None: the engine compiles it)."""

    prompt_ids: List[int]
    params: RefusionParams
    stop: Tuple[str, ...] = ()
    include_commits: bool = False
    tools: Tuple[dict, ...] = ()
    parallel_tool_calls: bool = True
    api: str = "chat.completions"
    cache_owner: Optional[str] = ""
    constraint: Optional[Constraint] = None
    compiled: Any = None
    scoring: Any = None  # a loglikelihood.Scoring: the prompt is scored (echo + logprobs), not answered
    logprobs: Optional[int] = None  # the answer's tokens' logprobs, with this many top tokens (job.token_entries)
    asked_max_tokens: Optional[int] = None  # the max_tokens asked, when more than the context left (then cut)

    @property
    def max_tokens(self) -> int:
        """The answer's most tokens besides EOS: it is cut there exactly."""
        return self.params.gen_length

    @property
    def layout(self) -> BlockLayout:
        """The decoder's budget (``max_tokens`` in whole slots) in blocks, resolved once by :func:`resolve`."""
        return self.params.layout()


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation as the chat template takes it: ``messages`` (OpenAI's
    chat form: system, user, assistant with ``tool_calls`` whose arguments
    are objects, tool with ``tool_call_id``) and the function ``tools`` it
    renders; ``prefill``: the last message is the start of the answer, which
    the model continues (Anthropic's final assistant message), not a turn of
    its own; ``opened`` False: neither, the prompt ends with the last message
    closed (vLLM's ``add_generation_prompt: false``). Every chat-shaped API's
    adapter makes one. ``template_kwargs``: the chat template's own
    variables the request sets (over the server's ``--chat-template-config``)."""

    messages: List[dict]
    tools: Tuple[dict, ...] = ()
    prefill: bool = False
    template_kwargs: Optional[Dict[str, Any]] = None
    opened: bool = True


@dataclass(frozen=True)
class Draft:
    """What an API's adapter makes of a body, in the engine's terms: the
    prompt's ``ids``, ``max_tokens`` (None: the server's default, or with
    ``open_budget`` the context the prompt leaves unless the operator gave
    that default: :attr:`RequestTerms.max_tokens_given`), the
    decoding ``fields`` given (by their ``RefusionParams`` names), the
    ``api`` that asked, and what :func:`resolve` carries as given. The
    ``*_param`` names are those fields' names in the request's API, for its
    errors."""

    ids: List[int]
    max_tokens: Optional[int]
    fields: Dict[str, Any]
    api: str
    stop: Sequence[str] = ()
    include_commits: bool = False
    prompt_param: str = "prompt"
    max_tokens_param: str = "max_tokens"
    tools: Sequence[dict] = ()
    parallel_tool_calls: bool = True
    constraint: Optional[Constraint] = None
    logprobs: Optional[int] = None
    logprobs_param: str = "logprobs"  # the field that asked for them, as the API names it
    scoring: Any = None
    stop_param: str = "stop"  # the field of the stop strings, as the API names it
    open_budget: bool = False  # the Responses API's: OpenAI's omitted max_output_tokens is no limit


@dataclass(frozen=True)
class RequestTerms:
    """What every request is made under, whichever API asked: the model's
    ``context`` and ``vocab_size``, whether its template ``takes_tools``, the
    server's decoding ``defaults`` and ``call_grammar``, ``tokenize`` (a
    prompt's source to its ids) and ``compile`` (a request's constraint
    compiled against the tokenizer for the engine: a Compiled, or None when
    there is nothing to constrain; a DecodeError for one it cannot; None:
    the engine compiles it); ``max_tokens_given``: whether the server's
    default budget was given by its operator (it then caps an open budget too:
    :attr:`Draft.open_budget`)."""

    tokenize: Callable[[Any], List[int]]
    vocab_size: int
    context: int
    defaults: RefusionParams
    takes_tools: bool = False
    call_grammar: str = "all"
    compile: Optional[Callable[[Constraint], Any]] = None
    max_tokens_given: bool = True
    kv_cost: Any = None  # the engine's memory.KVCost, and its --max-kv-bytes: they cap an open budget
    max_kv_bytes: Optional[int] = None

    def prompt_ids(self, source: Any, param: str) -> List[int]:
        """The prompt's ids from its ``source`` (``param``: its field), checked: :func:`prompt_ids`."""
        return prompt_ids(source, self.tokenize, self.vocab_size, param)


def finish(draft: Draft, terms: RequestTerms, cache_owner: Optional[str] = "", sample: int = 0) -> EngineRequest:
    """The engine's request of an adapter's ``draft``: resolved against the
    ``terms``, under the server's call grammar, owned by ``cache_owner``;
    ``sample``: which of ``n`` answers (with a seed, answer k uses seed + k, modulo 2**64)."""
    defaults = terms.defaults
    if draft.open_budget and draft.max_tokens is None and not terms.max_tokens_given:  # shrunk to what it leaves
        defaults = open_defaults(terms, len(draft.ids), draft.fields.get("slot_size") or defaults.slot_size)
    made = {"fields": draft.fields, "defaults": defaults, "context": terms.context}
    if draft.scoring is not None:  # scored, not decoded: the prompt (and a drafted token) must fit the context
        ids, extra = draft.ids, draft.scoring.extra
        if len(ids) + extra > terms.context:
            raise Refusal(Reason.CONTEXT_LENGTH_EXCEEDED, f"the prompt ({len(ids)} tokens) + max_tokens ({extra}) "
                          f"exceeds the model's context of {terms.context}", draft.prompt_param)
        # its stop strings: the drafted token's (loglikelihood.drafted_text)
        request = dataclasses.replace(resolve(ids[:1], max_tokens=1, stop=draft.stop, **made), prompt_ids=list(ids),
                                      api=draft.api, scoring=draft.scoring)
    else:
        made.update(max_tokens=draft.max_tokens, stop=draft.stop, include_commits=draft.include_commits,
                    prompt_param=draft.prompt_param, max_tokens_param=draft.max_tokens_param, tools=draft.tools,
                    parallel_tool_calls=draft.parallel_tool_calls, api=draft.api, constraint=draft.constraint)
        request, room = within_memory(resolve(draft.ids, **made), draft.ids, made, terms)
        if request.asked_max_tokens is not None:  # one line, of the cut that holds (the context's or memory's)
            log.info("%s %d cut to %d: the prompt's %d tokens leave that much of %s", draft.max_tokens_param,
                     request.asked_max_tokens, request.params.gen_length, len(draft.ids), room)
        if draft.logprobs is not None and draft.constraint is not None:  # constrained: no slots' scores
            raise Refusal(Reason.UNSUPPORTED, unscored(draft.logprobs_param, draft.constraint.name),
                          draft.logprobs_param)
        if draft.stop and draft.constraint is not None and draft.constraint.whole_answer:
            raise Refusal(Reason.UNSUPPORTED, f"{draft.stop_param}: not supported with an answer constrained by "
                          f"{draft.constraint.name}: it ends where its grammar does, and a stop string would cut it "
                          "short", draft.stop_param)
        request = dataclasses.replace(request, logprobs=draft.logprobs)
    seed = request.params.seed
    if sample and seed is not None:
        request = dataclasses.replace(request, params=dataclasses.replace(request.params,
                                                                          seed=(seed + sample) % SEEDS))
    return dataclasses.replace(compiled(request, terms), cache_owner=cache_owner)


def within_memory(request: EngineRequest, ids: List[int], made: Dict[str, Any],
                  terms: RequestTerms) -> Tuple[EngineRequest, str]:
    """``request`` (resolved from ``ids`` and :func:`resolve`'s arguments ``made``) with a budget that
    ``--max-kv-bytes`` cannot hold cut to the whole slots it holds after the prompt, as a budget past the
    context is cut to that (a request reserves its whole budget when it starts): Claude Code asks for
    32,000 to 128,000 tokens, which the context cuts and a smaller machine's memory may still not hold, and
    every one of its requests was refused. A prompt that leaves no whole slot in it is refused, naming it.
    With the request, what its budget was fitted to, in words for the log's line on a cut."""
    context = (request, f"the model's context of {made['context']}")
    cost, most = terms.kv_cost, terms.max_kv_bytes
    if cost is None or most is None or not cost.row_bytes or cost.need(request) <= most:
        return context
    rows, slot = cost.rows_within(most, widest_pass(request)), request.params.slot_size
    if rows - len(ids) < slot:
        raise Refusal(Reason.KV_MEMORY_EXCEEDED, f"the prompt is {len(ids)} tokens; the server's --max-kv-bytes of "
                      f"{most} holds {rows} rows of KV cache ({cost.row_bytes} bytes each), no whole slot of {slot} "
                      "after it", made["prompt_param"])
    try:
        held = resolve(ids, **{**made, "context": min(rows, terms.context)})
    except Refusal:
        return context
    return (held, f"the {min(rows, terms.context)} rows --max-kv-bytes holds") if cost.need(held) <= most else context


def open_defaults(terms: RequestTerms, prompt_tokens: int, slot: int) -> RefusionParams:
    """The server's defaults for an open budget (:attr:`Draft.open_budget`):
    the whole context, which :func:`resolve` shrinks to what the prompt
    leaves, in the default block length -- a server's ``serial_num_blocks``
    N would cut the whole context into N blocks thousands of tokens wide
    (a request's own block choice still replaces it) -- and at most the
    whole slots of ``slot`` that ``--max-kv-bytes`` holds after the prompt's
    ``prompt_tokens`` (a request reserves its whole budget when it starts);
    where it holds no slot after the prompt, the server's default budget
    (refused as any request that cannot fit)."""
    defaults = dataclasses.replace(terms.defaults, gen_length=terms.context, serial_num_blocks=None)
    if terms.kv_cost is None or terms.max_kv_bytes is None:
        return defaults
    rows = terms.kv_cost.rows_within(terms.max_kv_bytes, max(defaults.layout().block_lengths))
    if rows is None:
        return defaults
    held = (rows - prompt_tokens) // slot * slot
    return dataclasses.replace(defaults, gen_length=min(terms.context, held) if held > 0 else terms.defaults.gen_length)


def compiled(request: EngineRequest, terms: RequestTerms) -> EngineRequest:
    """``request`` under the server's call grammar
    (:func:`.structured.with_call_grammar`), its constraint compiled here, on
    the request's thread: a large schema or many tools take up to a tenth of
    a second to compile, which on the engine's thread would hold every
    running request. A call grammar the tokenizer refuses is left off
    (nobody asked for it): the request is then compiled as it came; a
    constraint the request asked for and the tokenizer refuses is a Refusal
    naming its field."""
    served = with_call_grammar(request, terms.call_grammar)
    for made in (served, request) if served is not request else (request,):
        if made.constraint is None or terms.compile is None:
            return made
        try:
            return dataclasses.replace(made, compiled=terms.compile(made.constraint))
        except DecodeError as e:
            if made is request:
                raise Refusal(Reason.INVALID_VALUE, str(e), made.constraint.name) from None


def prompt_ids(source: Any, tokenize: Callable[[Any], List[int]], vocab_size: int, param: str) -> List[int]:
    """The prompt's ids from ``source`` (what ``tokenize`` takes: a
    :class:`ChatPrompt`, text, or ids, which are checked against the
    vocabulary); ``param``: the field that holds the prompt in the request's API."""
    outside = [t for t in source if isinstance(t, int) and not 0 <= t < vocab_size] if isinstance(source, list) else []
    if outside:
        raise Refusal(Reason.INVALID_VALUE, f"prompt token id {outside[0]} is outside the vocabulary of "
                                            f"{vocab_size}", param)
    try:
        ids = list(tokenize(source))
    except Exception as e:  # a chat template that refuses the conversation
        detail = " ".join(str(e).split())[:200] or type(e).__name__
        raise Refusal(Reason.INVALID_PROMPT, f"cannot build the prompt: {detail}", param) from None
    if not ids:
        raise Refusal(Reason.INVALID_VALUE, "the prompt is empty after tokenization", param)
    return ids


def resolve(ids: List[int], *, max_tokens: Optional[int], fields: Dict[str, Any], defaults: RefusionParams,
            context: int, stop: Sequence[str] = (), include_commits: bool = False,
            prompt_param: str = "prompt", max_tokens_param: str = "max_tokens", tools: Sequence[dict] = (),
            parallel_tool_calls: bool = True, api: str = "chat.completions",
            constraint: Optional[Constraint] = None) -> EngineRequest:
    """The request the engine runs, checked against the model's ``context``
    (:func:`~refusion_mlx.decode.fit.fit_budget`, the rule the CLIs follow too).

    ``max_tokens``: the answer's most tokens (None: the server's default,
    ``defaults.gen_length``, shrunk to the whole slots the context leaves, as
    OpenAI shrinks its default); more than the context leaves is cut to
    what fits, as llama.cpp's server does (the request's
    ``asked_max_tokens`` says so; the answer then ends at ``length``). ``fields``: the decoding settings the request
    gives, by their ``RefusionParams`` names, over the server's ``defaults``
    (a request's block choice replaces the server's). ``prompt_param`` and
    ``max_tokens_param``: those fields' names in the request's API;
    ``tools``, ``parallel_tool_calls``, ``api``, ``constraint``: carried as given. The server's log line on
    a cut is :func:`finish`'s, once the memory's cut (:func:`within_memory`) is known too.
    """
    try:
        fitted = fit_budget(len(ids), context, defaults, fields, max_tokens, name=max_tokens_param)
    except ContextError as e:
        raise Refusal(Reason.CONTEXT_LENGTH_EXCEEDED, str(e),
                      prompt_param if e.field == "prompt" else max_tokens_param, overflow=e) from None
    except DecodeError as e:  # in the request's words: the budget is its max_tokens field, not gen_length
        said = re.sub(r"\bgen_length\b", max_tokens_param, str(e).replace("gen_length (max_tokens)", "gen_length"))
        raise Refusal(Reason.INVALID_DECODING_PARAMETERS, said, field_of(said, PARAM_NAMES)) from None
    params, cut = fitted.params, fitted.asked
    return EngineRequest(list(ids), params, tuple(stop), include_commits, tuple(tools), parallel_tool_calls, api,
                         constraint=constraint, asked_max_tokens=cut)
