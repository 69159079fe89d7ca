"""An answer's budget fitted to the model's context: the one home of the rule
the server (every API's requests), ``generate``, its prompts file, the chat
and the Python API follow.

A default budget (none asked) is shrunk to the whole slots the context leaves
after the prompt, as OpenAI shrinks its default; one asked past that room is
cut to it, as llama.cpp's server does (:attr:`Fit.asked` says so, for the
caller to tell). Only a prompt that leaves no room at all is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional

from ..errors import DecodeError
from .params import RefusionParams
from .params import budget as budget_of

__all__ = ["ContextError", "Fit", "fit_budget", "fitted"]


class ContextError(DecodeError):
    """The prompt leaves the answer no room in the model's context. ``field``:
    what to blame, ``"prompt"`` (it leaves no whole slot) or ``"max_tokens"``
    (the budget asked, in the whole blocks it must keep to, does not fit).
    The sizes that overflow, for a caller that words them its own way (an
    API's edge): ``prompt_tokens`` + ``answer`` > ``context``, where
    ``answer`` is the budget in whole slots (``"max_tokens"``) or the least
    answer the prompt must leave room for, one slot (block) (``"prompt"``)."""

    def __init__(self, message: str, field: str, prompt_tokens: int = 0, answer: int = 0, context: int = 0):
        super().__init__(message)
        self.field = field
        self.prompt_tokens, self.answer, self.context = prompt_tokens, answer, context


@dataclass(frozen=True)
class Fit:
    """The settings an answer is decoded with (their ``gen_length`` fits the
    context, their layout resolved) and ``asked``: the ``max_tokens`` asked,
    when it was cut to fit (None: not asked, or not cut)."""

    params: RefusionParams
    asked: Optional[int] = None


def own_blocks(params: RefusionParams) -> Dict[str, Any]:
    """The block choice ``params`` name (``serial_num_blocks`` or
    ``block_length``), as :func:`fit_budget`'s ``fields``: settings a command
    was given are the reference's contract, as a request's own are."""
    return {k: getattr(params, k) for k in ("serial_num_blocks", "block_length") if getattr(params, k) is not None}


def fitted(params: RefusionParams, prompt_tokens: int, context: int, default: bool) -> RefusionParams:
    """``params`` fitted to what the context leaves after ``prompt_tokens`` (the Python API's):
    a ``default`` budget (the caller asked none) shrunk to it; one asked cut to it where it runs
    past, as the commands and the server cut theirs, else left as it is."""
    if not default and prompt_tokens + params.layout().gen_length <= context:
        return params
    return fit_budget(prompt_tokens, context, params, own_blocks(params),
                      max_tokens=None if default else params.gen_length).params


def fit_budget(prompt_tokens: int, context: int, defaults: RefusionParams, fields: Optional[Dict[str, Any]] = None,
               max_tokens: Optional[int] = None, name: str = "max_tokens") -> Fit:
    """The settings for an answer after ``prompt_tokens`` in a ``context`` of
    that many positions.

    ``max_tokens``: the budget asked (None: ``defaults.gen_length``, shrunk to
    the whole slots the context leaves); more than the context leaves is cut
    to what fits. ``fields``: decoding settings given over ``defaults`` (by
    their ``RefusionParams`` names; their block choice replaces the
    defaults'). The defaults' ``serial_num_blocks`` N serves any budget: N
    blocks of whole slots, the last one shorter where it does not split
    evenly (N equal blocks, the reference's layout, where it does; a
    preset's blocks are a block length, kept at any budget:
    :func:`.presets.preset`); a
    ``serial_num_blocks`` of ``fields`` is the reference's contract (N equal
    blocks of whole slots), and a cut keeps to it. ``name``: the budget's
    name in messages. A prompt with no room is a :class:`ContextError`, a bad
    setting a DecodeError."""
    fields = fields or {}
    slot = fields.get("slot_size") or defaults.slot_size
    unit = slot * fields["serial_num_blocks"] if fields.get("serial_num_blocks") else slot
    if prompt_tokens >= context:
        raise ContextError(f"the prompt is {prompt_tokens} tokens; the model's context is {context}", "prompt",
                           prompt_tokens, unit, context)
    blocks = {"block_length": None, "serial_num_blocks": None}
    own_blocks = bool(blocks.keys() & fields.keys())
    serial = None if own_blocks or defaults.block_length is not None else defaults.serial_num_blocks
    asked, room = max_tokens, ((context - prompt_tokens) // unit) * unit  # the whole slots (blocks) it leaves
    if max_tokens is None or max_tokens > room:
        max_tokens = min(defaults.gen_length if max_tokens is None else max_tokens, room)
        if max_tokens < 1:
            room_for = (f"no whole slot of {slot}" if unit == slot else
                        f"no {unit // slot} blocks of whole slots of {slot} (serial_num_blocks)")
            raise ContextError(f"the prompt is {prompt_tokens} tokens; the model's context of {context} leaves "
                               f"{room_for} for an answer", "prompt", prompt_tokens, unit, context)
    while True:
        changes = {**(blocks if own_blocks else {}), **fields, "gen_length": max_tokens}
        if serial:
            slots = budget_of(max_tokens, slot) // slot
            changes.update(serial_num_blocks=None, block_length=slot * -(-slots // serial))
        params = dataclasses.replace(defaults, **changes)
        budget = params.layout().gen_length  # resolved here, once: the settings carry it
        if prompt_tokens + budget <= context or asked is None or max_tokens <= unit:
            break
        max_tokens -= unit  # a layout of whole blocks past the context: a slot (block) less, until it fits
    if prompt_tokens + budget > context:
        raise ContextError(f"the prompt ({prompt_tokens} tokens) + {name} ({max_tokens}, {budget} in whole slots) "
                           f"exceeds the model's context of {context}", "max_tokens", prompt_tokens, budget, context)
    return Fit(params, asked if asked is not None and asked != max_tokens else None)
