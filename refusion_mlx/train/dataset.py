"""Training data: JSONL files in mlx-lm's formats, tokenized into (prompt, response) pairs.

A data folder holds ``train.jsonl``, ``valid.jsonl`` and optionally
``test.jsonl``, one JSON object per line, in one of mlx-lm's formats:

* ``{"messages": [{"role": ..., "content": ...}, ...]}`` (optionally ``"tools"``):
  the response is the last message, which must be the assistant's; every
  earlier message (earlier turns included) is prompt. Assistant messages may
  carry OpenAI's ``tool_calls`` (their ``content`` then may be null) and
  ``role: "tool"`` messages the results; a last message with ``tool_calls``
  is learnt as the chat template renders it (the calls' markup);
* ``{"prompt": ..., "completion": ...}``: one user turn and its answer;
* ``{"text": ...}``: no prompt, the whole text is the response.

A YAML config's ``chat_feature``, ``prompt_feature``, ``completion_feature``
and ``text_feature`` rename those keys, as in mlx-lm (:class:`Features`).

The prompt goes through the tokenizer's chat template with
``add_generation_prompt=True``, exactly as decoding builds it; the response
is the message's tokens plus EOS. Blank lines are skipped; anything else that
is not such an object is a one-line error naming the file and line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..decode.prompt import checked_text
from ..decode.stream import chat_prompt, render_chat, text_content
from .._json import lines
from ..errors import DecodeError, RefusionError
from .batches import Record
from .config import check_replay_ratio

SPLITS = ("train", "valid", "test")


def prompt_ids(tokenizer, messages: List[Dict[str, str]], tools=None) -> List[int]:
    """Prompt ids as decoding builds them: chat template with the generation prompt, then encode
    (none for no messages: an assistant message alone is learned as text is)."""
    if not messages:
        return []
    return chat_prompt(tokenizer, messages, chat_template=bool(getattr(tokenizer, "chat_template", None)),
                       tools=tools or None)


def response_ids(tokenizer, text: str) -> List[int]:
    """The response's tokens (no special tokens added) and EOS."""
    return list(tokenizer.encode(checked_text(text, "a response"), add_special_tokens=False)) + [
        int(tokenizer.eos_token_id)]


def response_text(tokenizer, messages: List[Dict], tools=None) -> str:
    """The text to learn for the last (assistant) message: its ``content``, or,
    when it carries ``tool_calls``, what the chat template renders for it
    after the generation prompt, up to its end-of-turn token (so the calls'
    markup is the template's own)."""
    last = messages[-1]
    if not last.get("tool_calls"):
        return last.get("content") or ""
    if not getattr(tokenizer, "chat_template", None):
        raise RefusionError("a message with \"tool_calls\" needs a tokenizer with a chat template")
    kwargs = {"tools": tools} if tools else {}
    prompt = render_chat(tokenizer, messages[:-1], add_generation_prompt=True, **kwargs)
    whole = render_chat(tokenizer, messages, **kwargs)
    end = whole.rfind(tokenizer.eos_token) if tokenizer.eos_token else -1
    if not whole.startswith(prompt) or end < len(prompt):
        raise RefusionError("the chat template does not render the tool-calling message after the "
                            "conversation's generation prompt, ending with the end-of-turn token")
    return whole[len(prompt):end]


def text_messages(messages, where: str):
    """A row's messages with OpenAI's content as a list of text parts joined
    into one string, as chat_prompt takes it (anything but a list: as given),
    the one reading of chat rows every reader shares; a non-text part is a
    RefusionError naming ``where``."""
    if not isinstance(messages, list):
        return messages
    try:
        return [text_content(m) if isinstance(m, dict) and isinstance(m.get("content"), list) else m
                for m in messages]
    except DecodeError as e:
        raise RefusionError(f"{where}: {e}") from None


def _check_messages(messages, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise RefusionError(f"{where}: \"messages\" must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RefusionError(f"{where}: message {i + 1} needs a string \"role\" and a string \"content\"")
        calls = m.get("tool_calls")
        if calls is not None and (m["role"] != "assistant" or not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance((c.get("function") or c).get("name"), str) for c in calls)):
            raise RefusionError(f"{where}: message {i + 1}: \"tool_calls\" must be an assistant message's list "
                                "of calls, each with a function name")
        if not isinstance(m.get("content"), str) and not (calls and m.get("content") is None):
            raise RefusionError(f"{where}: message {i + 1} needs a string \"role\" and a string \"content\"")
    if messages[-1]["role"] != "assistant":
        raise RefusionError(f"{where}: the last message must be the assistant's (the response to learn), "
                            f"not {messages[-1]['role']!r}")


@dataclass(frozen=True)
class Features:
    """The keys a row's parts are under (mlx-lm's ``*_feature`` options)."""

    prompt: str = "prompt"
    completion: str = "completion"
    text: str = "text"
    chat: str = "messages"


def encode_line(obj, tokenizer, where: str, keys: Features = Features()) -> Record:
    """One JSONL object as a Record (see the module's formats)."""
    if not isinstance(obj, dict):
        raise RefusionError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if keys.chat in obj:
        messages = text_messages(obj[keys.chat], where)
        _check_messages(messages, where)
        tools = obj.get("tools")
        try:
            text = response_text(tokenizer, messages, tools)
        except RefusionError as e:
            raise RefusionError(f"{where}: {e}") from None
        return Record(prompt_ids(tokenizer, messages[:-1], tools), response_ids(tokenizer, text), where)
    if keys.prompt in obj or keys.completion in obj:
        prompt, completion = obj.get(keys.prompt), obj.get(keys.completion)
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise RefusionError(f"{where}: \"{keys.prompt}\" and \"{keys.completion}\" must both be strings")
        return Record(prompt_ids(tokenizer, [{"role": "user", "content": prompt}], obj.get("tools")),
                      response_ids(tokenizer, completion), where)
    if keys.text in obj:
        if not isinstance(obj[keys.text], str):
            raise RefusionError(f"{where}: \"{keys.text}\" must be a string")
        return Record([], response_ids(tokenizer, obj[keys.text]), where)
    given = ", ".join(sorted(obj)[:5]) or "none"
    raise RefusionError(f"{where}: unknown format (keys: {given}); expected \"{keys.chat}\", "
                        f"\"{keys.prompt}\"/\"{keys.completion}\" or \"{keys.text}\"")


def read_jsonl(path: Path, tokenizer, keys: Features = Features()) -> List[Record]:
    """Every non-blank line of ``path`` as a Record."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise RefusionError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise RefusionError(f"{path}:{line}: not valid UTF-8") from None
    records = []
    for n, line in enumerate(lines(text), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except ValueError as e:  # JSONDecodeError, or a number past Python's 4300 digits
            detail = (f"{e.msg.removesuffix(' at')} at column {e.colno}" if isinstance(e, json.JSONDecodeError)
                      else str(e).split(":")[0])
            raise RefusionError(f"{where}: not valid JSON ({detail})") from None
        except RecursionError:  # json parses nesting by recursion
            raise RefusionError(f"{where}: not valid JSON (nested too deeply to read)") from None
        try:
            records.append(encode_line(obj, tokenizer, where, keys))
        except RefusionError as e:  # the template's and the text checks' errors name the row too
            raise RefusionError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None
    return records


def load_split(data: Path, name: str, tokenizer, keys: Features = Features()) -> List[Record]:
    """``name``.jsonl of the data folder: its records (an error if absent or empty)."""
    path = data / f"{name}.jsonl"
    if not path.is_file():
        raise RefusionError(f"{data} has no {name}.jsonl")
    records = read_jsonl(path, tokenizer, keys)
    if not records:
        raise RefusionError(f"{path} holds no examples")
    return records


def replay_records(source, tokenizer, keys: Features = Features()) -> List[Record]:
    """The rows to replay: ``train.jsonl`` of a data folder, or a JSONL file."""
    path = Path(source).expanduser()
    if path.is_dir():
        path = path / "train.jsonl"
    if not path.is_file():
        raise RefusionError(f"--replay-data {source}: no such file or folder with train.jsonl")
    records = read_jsonl(path, tokenizer, keys)
    if not records:
        raise RefusionError(f"--replay-data {path} holds no examples")
    return records


def with_replay(train: List[Record], replay: List[Record], ratio: float, seed: int) -> List[Record]:
    """``train`` plus ``ratio`` replayed rows per training row (0 to 100), drawn once from ``seed``.

    Rehearsing the tasks a model already knows while it learns a new one is
    what keeps a full fine-tune from erasing them. Rows repeat only when
    ``replay`` is smaller than the draw.
    """
    import numpy as np

    check_replay_ratio(ratio)
    k = int(round(ratio * len(train)))
    rng = np.random.default_rng(seed)
    picks = rng.permutation(len(replay))[:k].tolist()
    picks += rng.integers(0, len(replay), size=k - len(picks)).tolist()
    return list(train) + [replay[i] for i in picks]


def load_datasets(data, tokenizer, test: bool = False, train: bool = True, valid: Optional[bool] = None,
                  keys: Features = Features()
                  ) -> Tuple[Optional[List[Record]], Optional[List[Record]], Optional[List[Record]]]:
    """(train, valid, test) records of a data folder: the splits the run uses, None for the others.

    train.jsonl is read when ``train``, valid.jsonl when ``valid`` (None: as
    ``train``), test.jsonl when ``test``; each one read must exist and hold
    examples. A split the run does not use is never read, so its rows can
    neither stop the run nor cost its tokenizing.
    """
    valid = train if valid is None else valid
    data = Path(data).expanduser()
    if not data.is_dir():
        raise RefusionError(f"--data {data}: no such folder" if not data.exists() else
                            f"--data {data} is a file; give the folder holding train.jsonl and valid.jsonl")
    return tuple(load_split(data, name, tokenizer, keys) if used else None
                 for name, used in zip(SPLITS, (train, valid, test)))
