"""Generate with ReFusion: ``stream_generate`` and ``generate``.

Slots finish out of order, but text is only ever released in answer order:
each response carries the text that just became final (the contiguous prefix
of the answer grew) and the slots committed at that step, for visualisers.
"""

from __future__ import annotations

import json
import re
import secrets
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Union

from ..errors import DecodeError
from ..models.template_steps import MAX_ITEMS, step_limit
from .batch import BatchGenerator, GenerationResponse, check_form
from .cache import CommittedCache
from .grammar import constraint_of
from .kv_store import KVStorage
from .params import RefusionParams, budget_given, make_params
from .prompt import bare_ids, checked_text, text_ids, with_system
from .stats import DecodeStats

__all__ = ["GenerationResponse", "chat_prompt", "format_stats", "generate", "stream_generate", "template_options"]

# apply_chat_template's own arguments and what a chat prompt sets itself: no template variable of a caller's
TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "chat_template", "tokenize",
                                "add_generation_prompt", "continue_final_message", "padding", "truncation",
                                "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                                "tokenizer_kwargs", "kwargs"})


def chat_prompt(tokenizer, prompt: Union[str, List[Dict[str, Any]]], system: Optional[str] = None,
                chat_template: bool = True, tools: Optional[List[Dict[str, Any]]] = None,
                prefill: bool = False, template_kwargs: Optional[Dict[str, Any]] = None,
                add_generation_prompt: bool = True) -> List[int]:
    """Prompt ids as the reference builds them: chat template, then tokenize.
    ``tools``: function tools (``{"type": "function", "function": {...}}``)
    given to the template, which renders them (and tool messages) its own way.
    ``prefill``: the last message, an assistant's (else a DecodeError), is
    left open, for the answer to continue it, instead of a new assistant turn
    after it;
    ``add_generation_prompt`` False (vLLM's field): neither, the prompt ends
    with the last message closed.
    ``template_kwargs``: the template's own variables (mlx-lm's
    ``--chat-template-config``, e.g. ``{"enable_thinking": False}``), checked
    by :func:`template_options`."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, (list, tuple)):
        messages = [text_content(m) for m in prompt]
    else:
        raise DecodeError(f"the prompt must be text or a list of messages ({{\"role\": ..., \"content\": ...}}), "
                          f"got {type(prompt).__name__}")
    messages = with_system(messages, system)
    if prefill and (not messages or messages[-1].get("role") != "assistant"):
        last = f"the last is a {messages[-1].get('role')} message" if messages else "there is none"
        raise DecodeError(f"prefill: the last message must be an assistant's, which the answer continues ({last})")
    if chat_template and getattr(tokenizer, "chat_template", None):
        opening = {"continue_final_message": True} if prefill else {"add_generation_prompt": add_generation_prompt}
        own = template_options(template_kwargs) if template_kwargs else {}
        return _chat_ids(tokenizer, messages, {**own, **opening, **({"tools": tools} if tools else {})})
    else:
        if not all(isinstance(m.get("content"), str) for m in messages):
            raise DecodeError("without a chat template every message's content must be text")
        text = "\n".join(m["content"] for m in messages)
    return text_ids(tokenizer, text)


def _chat_ids(tokenizer, messages: List[Dict[str, Any]], kwargs: Dict[str, Any]) -> List[int]:
    """The template's text as ids, its own markup's special tokens parsed. Text that spells a special
    token inside what a conversation carries -- a user typing "<|im_end|><|im_start|>system", a tool's
    result or description quoting one, an earlier call's arguments, a schema's property names -- is
    tokenized as the text it is, as OpenAI's API reads it: it cannot close a turn or open one. Each such
    spelling is rendered as a
    sentinel (the template sees the rest of the text as it is) and tokenized as text; an assistant's own
    content is the model's words and the template's to read (``</think>``). A prompt that spells none has
    the ids it always had."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's wrapper holds the Hugging Face tokenizer
    specials = sorted({t.content for t in (getattr(hf, "added_tokens_decoder", None) or {}).values()
                       if getattr(t, "special", False) and t.content}, key=len, reverse=True)
    carried = [s for m in messages for s in _carried(m)] + list(_strings(kwargs))  # tools, template variables
    if not any(sp in s for s in carried for sp in specials):
        return bare_ids(tokenizer, render_chat(tokenizer, messages, **kwargs))  # a template writes its BOS
    nonce = secrets.token_hex(4)
    while any(nonce in s for s in carried):  # a sentinel no text of this conversation spells
        nonce = secrets.token_hex(4)
    spelled: List[str] = []
    pattern = re.compile("|".join(map(re.escape, specials)))

    def mark(text: str) -> str:
        def sentinel(m) -> str:
            spelled.append(m.group(0))
            return f"\ue000{nonce}{len(spelled) - 1}\ue001"
        return pattern.sub(sentinel, text)

    marked = [{k: v if k == "role" or (k == "content" and m.get("role") == "assistant") else _changed(v, mark)
               for k, v in m.items()} for m in messages]
    text = render_chat(tokenizer, marked, **_changed(kwargs, mark))
    ids: List[int] = []
    for j, piece in enumerate(re.split(f"\ue000{nonce}(\\d+)\ue001", text)):
        if j % 2:  # a special token's spelling, as text
            try:
                ids += hf.encode(spelled[int(piece)], add_special_tokens=False, split_special_tokens=True)
            except TypeError:  # a tokenizer without the switch
                ids += hf.encode(spelled[int(piece)], add_special_tokens=False)
        elif piece:
            ids += hf.encode(piece, add_special_tokens=False)
    return ids


def _carried(message: Dict[str, Any]):
    """The strings of a message that the conversation carries (all but its role and an assistant's content)."""
    for k, v in message.items():
        if not (k == "role" or (k == "content" and message.get("role") == "assistant")):
            yield from _strings(v)


def _strings(value: Any):
    """The strings in ``value`` (its dicts' keys and values, its lists' items)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _changed(value: Any, change: Callable[[str], str]) -> Any:
    """``value`` with each of its strings changed, dicts' keys too (a tool's property names, an earlier
    call's argument names: templates write them)."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, dict):
        return {_changed(k, change): _changed(v, change) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_changed(v, change) for v in value]
    return value


def text_content(message: Dict[str, Any]) -> Dict[str, Any]:
    """A message whose content is a list of text parts (OpenAI's ``{"type":
    "text", "text": ...}``) with that text as one string, as templates take it."""
    if not isinstance(message, dict):
        raise DecodeError(f"a message must be a dict with a role and content, got {type(message).__name__}")
    content = message.get("content")
    if content is None and not (message.get("role") == "assistant" and message.get("tool_calls")):
        raise DecodeError(f"{message.get('role', 'a message without a role')!s} message: its content (text) is "
                          "missing")
    if content is not None and not isinstance(content, (str, list)):
        raise DecodeError(f"a message's content must be text, or a list of text parts, got {type(content).__name__}")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise DecodeError("a message's content must be text, or a list of text parts "
                              '({"type": "text", "text": ...})')
        return {**message, "content": "".join(p["text"] for p in content)}
    return message


def template_options(value: Any, what: str = "template_kwargs") -> Dict[str, Any]:
    """``value`` as variables for a chat template (``enable_thinking``, a
    template's own switches): an object of JSON values whose names are not
    the template call's own arguments (messages, tools, the turn's opening),
    else one DecodeError naming ``what``."""
    if not isinstance(value, dict):
        raise DecodeError(f"{what} must be an object of the chat template's variables, e.g. "
                          f'{{"enable_thinking": false}}; got {type(value).__name__}')
    for name in value:
        if not isinstance(name, str) or not name.isidentifier():
            raise DecodeError(f"{what}: {name!r} is not a template variable's name")
        if name in TEMPLATE_ARGUMENTS:
            raise DecodeError(f"{what}: {name!r} is set by the prompt itself, not a template variable")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise DecodeError(f"{what}: JSON values only: {e}") from None
    return dict(value)


def render_chat(tokenizer, messages: List[Dict[str, Any]], **kwargs) -> str:
    """The chat template's text of ``messages`` (``kwargs``: the template's
    own, e.g. ``add_generation_prompt``, ``tools``), thinking enabled unless
    ``kwargs`` say otherwise; a
    message that is not text, or a template that fails (a syntax error, its
    own ``raise_exception``), is one DecodeError; one whose size limit a
    prompt of millions of characters met says the prompt is too long."""
    for m in messages:
        if isinstance(m.get("content"), str):
            checked_text(m["content"], f"a {m.get('role', 'user')} message")
    try:
        with step_limit(tokenizer):  # a model folder's template is code: bounded steps and sizes
            return tokenizer.apply_chat_template(messages, tokenize=False, **{"enable_thinking": True, **kwargs})
    except Exception as e:  # jinja2's errors (a limit's too), and what a template raises on purpose
        from jinja2.exceptions import SecurityError

        size = sum(len(text) for text in _strings([[m.get("content") for m in messages], kwargs.get("tools")]))
        if isinstance(e, SecurityError) and size > MAX_ITEMS // 4:  # a size limit: the prompt's own size made it
            raise DecodeError(f"the prompt is too long for the model's context: {size:,} characters (a chat "
                              f"template may make at most {MAX_ITEMS:,})") from None
        detail = " ".join(str(e).split())[:200] or type(e).__name__
        raise DecodeError(f"the chat template failed: {detail}") from None



def stream_generate(model, tokenizer, prompt: Union[str, Sequence[int]], max_tokens: Optional[int] = None, *,
                    cache: Optional[CommittedCache] = None, params: Optional[RefusionParams] = None,
                    json_schema: Union[str, Dict[str, Any], None] = None, grammar: Optional[str] = None,
                    json_object: bool = False, kv_bits: Optional[int] = None, kv_group_size: Optional[int] = None,
                    storage: Optional[KVStorage] = None, logprobs: Optional[int] = None,
                    **kwargs) -> Iterator[GenerationResponse]:
    """Decode ``prompt`` (text, tokenized as is, or ids) with ReFusion, streaming.

    Decoding parameters come as ``params`` or as keywords: ``max_tokens``
    (= ``gen_length``; also the fourth argument, as mlx-lm's), ``slot_size``, ``serial_num_blocks`` or
    ``block_length``, ``slot_threshold``, ``token_threshold``, ``temperature``
    (= ``temp``), ``seed``, ``top_p``, ``top_k``, ``min_p``; a ``max_tokens``
    past what the model's context leaves after the prompt is cut to the whole
    slots it leaves (``decode.fit``, as the commands and the server cut
    theirs; the answer then ends "length" there). ``cache``: a
    CommittedCache to continue (chat), one response at a time; left
    before the answer ends (a break, or an error raised mid-answer), it keeps
    the prompt and the answer's text so far (as mlx-lm's prompt cache does). ``kv_bits`` (4 or 8) and
    ``kv_group_size`` (default 64): keep the committed keys and values
    quantized, as mlx-lm takes them (or ``storage``, a
    :class:`~.kv_store.KVStorage` already made); a ``cache`` keeps its own
    form (given with them, it must be theirs, else DecodeError).
    A batch of one: the same loop as
    :func:`refusion_mlx.decode.batch.batch_generate` runs.

    ``logprobs``: each response carries its tokens' log-probabilities, with
    this many top tokens each (``GenerationResponse.logprobs``, as
    ``BatchGenerator.insert`` gives them); not with a constraint (below), a DecodeError.

    Constrained decoding (docs/constrained.md): ``json_schema`` (a dict or
    JSON text), ``grammar`` (llguidance's Lark format) or ``json_object``
    (any JSON object): the answer matches it when it ends with EOS
    (``finish_reason`` "stop"); a budget that ends first gives "length".
    """
    constraint = constraint_of(json_schema, grammar, json_object)
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    if params is not None and kwargs:
        raise TypeError("give params or decoding keywords, not both")
    gen = BatchGenerator(model, tokenizer, max_batch=1, storage=KVStorage.given(storage, kv_bits, kv_group_size))
    if cache is not None and (storage is not None or kv_bits is not None or kv_group_size is not None):
        check_form(cache, gen.storage)
    uid = gen.insert(prompt, params or make_params(**kwargs), cache=cache, constraint=constraint,
                     logprobs=logprobs, fit=params is None and not budget_given(kwargs))
    try:
        while gen.has_work:
            for response in gen.step():
                if response.error is not None:  # the request's fault as its own DecodeError; the runtime's
                    raise response.exception or DecodeError(response.error)  # (out of memory, a bug) as raised
                yield response
    finally:  # let go of early (a break, an error): the caller's cache holds what was answered, no holes
        gen.remove(uid, settle=cache is not None)


def generate(model, tokenizer, prompt: Union[str, Sequence[int]], verbose: bool = False,
             return_stats: bool = False, **params):
    """The whole answer's text (and its DecodeStats if ``return_stats``)."""
    text, last = "", None
    for last in stream_generate(model, tokenizer, prompt, **params):
        text += last.text
        if verbose:
            print(last.text, end="", flush=True)
    if verbose:
        print()
        print(format_stats(last.stats), file=sys.stderr)
    return (text, last.stats) if return_stats else text


def format_stats(stats: DecodeStats) -> str:
    s = stats.seconds
    lay = stats.layout
    layout = (f"layout: blocks of {lay['block_length']} tokens, {lay['blocks']} blocks, "
              f"{lay['slots_per_block']} slots per block\n" if lay else "")
    return layout + (
        f"prompt: {stats.prompt_tokens} tokens | generated: {stats.generated_tokens} tokens, "
        f"{stats.forwards} forwards, {stats.tokens_per_forward:.2f} tokens/forward, "
        f"{stats.tokens_per_second:.1f} tokens/s\n"
        f"time: prefill {s['prefill']:.3f}s, plan {s['plan']:.3f}s, verify {s['verify']:.3f}s, "
        f"infill draft {s['infill_draft']:.3f}s, infill verify {s['infill_verify']:.3f}s | "
        f"peak memory {stats.peak_memory_gb:.3f} GB"
    )
