"""What a prompt may be, checked in one place: text (Unicode a tokenizer
takes, tokenized as is) or token ids (integers: a list, a tuple, a 1-D
array). Anything else is one DecodeError naming it, never a prompt made of
something else (bytes read as ids, floats cut to integers). The decoder
checks the ids against the model's vocabulary."""

from __future__ import annotations

import numbers
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import numpy as np

from ..errors import DecodeError


def checked_text(text: str, what: str = "the prompt") -> str:
    """``text``, or one DecodeError when it is not Unicode text a tokenizer
    takes: a lone UTF-16 surrogate (an undecodable byte of a command line or
    file, or half a pair escaped in JSON)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DecodeError(f"{what} is not valid UTF-8 text: it holds {text[e.start]!r} (an undecodable byte, or "
                          "half a UTF-16 pair)") from None
    return text


def token_ids(value: Any, what: str = "the prompt") -> List[int]:
    """``value`` as a list of token ids: a sequence of integers (Python's or
    NumPy's), or a 1-D integer array (MLX's or NumPy's)."""
    if type(value) is list and all(type(t) is int for t in value):  # the server's ids: no check per token
        return list(value)
    if isinstance(value, (str, bytes, bytearray, memoryview, dict, set)) or not hasattr(value, "__iter__"):
        raise DecodeError(f"{what} must be text or a list of token ids, got {type(value).__name__}")
    if hasattr(value, "ndim") and hasattr(value, "dtype"):  # an MLX or NumPy array
        try:
            array = np.asarray(value)
        except (TypeError, ValueError, RuntimeError) as e:
            raise DecodeError(f"{what}: an array of token ids NumPy cannot read ({e})") from None
        if array.ndim != 1:
            raise DecodeError(f"{what} must be one list of token ids, got an array of shape {tuple(array.shape)}")
        if array.size and array.dtype.kind not in "iu":
            raise DecodeError(f"{what} must hold integer token ids, got an array of {array.dtype}")
        return [int(t) for t in array]
    out = []
    for t in value:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral):
            raise DecodeError(f"{what} must hold integer token ids, got {t!r}")
        out.append(int(t))
    return out


# a chat message's roles, OpenAI's: what the server's chat completions and a prompts file take
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def template_role(role: str) -> str:
    """A message's role as a chat template reads it: OpenAI's developer is the system."""
    return "system" if role == "developer" else role


def with_system(messages: List[Dict[str, Any]], system: Optional[str], name: str = "system") -> List[Dict[str, Any]]:
    """``messages`` after a system message of ``system`` (given by ``name``; None: as they are). Messages
    that hold their own system message are a DecodeError: two system turns are not what either meant."""
    if system is None:
        return messages
    if any(isinstance(m, dict) and m.get("role") == "system" for m in messages):
        raise DecodeError(f"give {name} or a system message in the messages, not both")
    return [{"role": "system", "content": system}] + messages


def wrapped(tokenizer):
    """A Hugging Face tokenizer in mlx-lm's ``TokenizerWrapper`` (what ``load`` returns), as mlx-lm's
    ``stream_generate`` takes either; anything else as given."""
    if type(tokenizer).__module__.startswith("transformers"):
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        return TokenizerWrapper(tokenizer)
    return tokenizer


def prompt_ids(tokenizer, prompt: Union[str, Sequence[int]], what: str = "the prompt") -> List[int]:
    """The ids of one prompt: text tokenized as is (the tokenizer's BOS added
    unless the text begins with it, as mlx-lm takes a templated text), or
    token ids as given."""
    if isinstance(prompt, str):
        return text_ids(tokenizer, prompt, what)
    return token_ids(prompt, what)


def text_ids(tokenizer, text: str, what: str = "the prompt") -> List[int]:
    """A text prompt's ids (no chat template): what the tokenizer adds
    around a text (a BOS), unless the text begins with that BOS already --
    a template's text rendered elsewhere (mlx-lm's rule). The one home of
    that rule: the Python API, the commands and the server's text prompts."""
    checked_text(text, what)
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos):
        return bare_ids(tokenizer, text)
    return list(tokenizer.encode(text))


def bare_ids(tokenizer, text: str) -> List[int]:
    """``text``'s ids with nothing added around them (no BOS), as Hugging
    Face's ``apply_chat_template`` tokenizes a template's text."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:  # a tokenizer without the switch
        return list(tokenizer.encode(text))


def prompt_list(prompts: Any) -> list:
    """A batch's prompts as a list; one prompt given alone (text, or a list
    of ids rather than a list of prompts) is a DecodeError saying so."""
    if (isinstance(prompts, (str, bytes, bytearray, Mapping)) or not hasattr(prompts, "__iter__")
            or getattr(prompts, "ndim", 2) < 2):  # a 1-D array: one prompt's ids
        raise DecodeError(f"prompts must be a list of prompts (texts or token-id lists), got "
                          f"{type(prompts).__name__}; for one prompt, pass [prompt]")
    out = list(prompts)
    if out and all(isinstance(p, numbers.Integral) for p in out):
        raise DecodeError("prompts must be a list of prompts, got one list of token ids; for one prompt, "
                          "pass [ids]")
    return out
