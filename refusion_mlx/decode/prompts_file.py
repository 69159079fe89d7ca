"""A file of many prompts for batch decoding.

Plain text: one prompt per non-empty line. JSONL (the first non-empty line
starts with ``{``): one object per line with ``prompt`` (a string, or chat
``messages``) and optional per-prompt decoding settings under the names of
``params.FIELDS`` (:class:`RefusionParams`' names, and their aliases such as
``max_tokens`` and ``temp``), layered over the command line's settings.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Union

from .._json import lines as text_lines
from ..errors import DecodeError, RefusionError
from .params import ALIASES, PARAM_NAMES, RefusionParams, settings_named
from .prompt import CHAT_ROLES, template_role, with_system

__all__ = ["ALIASES", "PromptItem", "parse_prompts"]


@dataclass
class PromptItem:
    """A prompt and its settings; ``max_tokens``: the budget its line gives (None: the command line's)."""

    prompt: Union[str, List[Dict[str, str]]]
    params: RefusionParams
    max_tokens: Optional[int] = None


def parse_prompts(text: str, source: str, defaults: RefusionParams, system: Optional[str] = None,
                  system_flag: str = "--system") -> List[PromptItem]:
    """The prompts of a file, each with its settings; a bad line is a
    one-line RefusionError naming it. ``system``: the system message every
    prompt gets (``system_flag``); a line with its own is refused, as
    :func:`.prompt.with_system` refuses both."""
    lines = [(n, line) for n, line in enumerate(text_lines(text), 1) if line.strip()]
    if not lines:
        raise RefusionError(f"{source}: no prompts")
    if not lines[0][1].lstrip().startswith("{"):
        return [PromptItem(line, defaults) for _, line in lines]
    # a plain prompt that starts with "{" made the file JSONL: its line says the rule
    rule = '; a file whose first prompt starts with \'{\' is read as JSONL: write it as {"prompt": "..."} lines'
    return [_json_item(n, line, source, defaults, system, system_flag, rule if i == 0 else "")
            for i, (n, line) in enumerate(lines)]


def _json_item(n: int, line: str, source: str, defaults: RefusionParams, system: Optional[str] = None,
               system_flag: str = "--system", not_json: str = "") -> PromptItem:
    where = f"{source}:{n}"
    try:
        obj = json.loads(line)
    except ValueError as e:  # JSONDecodeError, or a number past Python's 4300 digits
        detail = e.msg if isinstance(e, json.JSONDecodeError) else str(e).split(":")[0]
        raise RefusionError(f"{where}: not valid JSON ({detail}){not_json}") from None
    if not isinstance(obj, dict):
        raise RefusionError(f"{where}: expected a JSON object")
    prompt = obj.pop("prompt", None)
    messages = obj.pop("messages", None)
    if (prompt is None) == (messages is None):
        raise RefusionError(f"{where}: give 'prompt' (a string) or 'messages'")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise RefusionError(f"{where}: 'prompt' must be a non-empty string")
    if messages is not None:
        messages = _messages(messages, where)
        try:
            with_system(messages, system, system_flag)
        except DecodeError as e:
            raise RefusionError(f"{where}: {e}") from None
    obj = {k: v for k, v in obj.items() if v is not None}  # null: the command line's, as in a request
    try:
        settings = settings_named(obj)  # make_params' rule: a setting given by both its names is refused
    except DecodeError as e:
        raise RefusionError(f"{where}: {e}") from None
    written = {ALIASES[k]: k for k in obj if k in ALIASES}  # a setting's name as the line spells it
    unknown = sorted(set(settings) - set(PARAM_NAMES))
    if unknown:
        raise RefusionError(f"{where}: unknown field(s) {', '.join(unknown)}")
    if settings.get("serial_num_blocks") is not None:
        settings.setdefault("block_length", None)
    elif settings.get("block_length") is not None:
        settings.setdefault("serial_num_blocks", None)
    try:
        params = dataclasses.replace(defaults, **settings)
        params.layout()  # checked and resolved here, where the line's settings are made
    except DecodeError as e:
        raise RefusionError(f"{where}: {_as_written(str(e), written)}") from None
    return PromptItem(prompt if prompt is not None else messages, params, settings.get("gen_length"))


def _as_written(message: str, written: Dict[str, str]) -> str:
    """A settings error with each setting named as the line wrote it (``max_tokens``, not ``gen_length``)."""
    for name, alias in written.items():
        message = re.sub(rf"(?<![\w-]){name}(?: \({alias}\))?(?![\w-])", alias, message)
    return message


def _messages(messages, where: str) -> List[Dict[str, str]]:
    """A line's chat: {role, content} objects with text content and the server's roles (developer read as
    system, as the server reads it), or a one-line RefusionError."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise RefusionError(f"{where}: 'messages' must be a list of {{'role', 'content'}} objects")
    for i, m in enumerate(messages):
        if m["role"] not in CHAT_ROLES:
            raise RefusionError(f"{where}: messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got "
                                f"{m['role']!r}")
    return [{**m, "role": template_role(m["role"])} for m in messages]
