"""A model folder's tokenizer checked against its config.json and its vocabulary.

The loader (``loading.load``), the converter and the fuse command ask the
same two questions of a folder's tokenizer: is it fit for the embedding
(:func:`tokenizer_problems`), and which id is the mask token
(:func:`resolve_mask_id`); a chat template given in place of the folder's
is checked as it is set (:func:`use_template`). ReFusion's ``config.json`` carries
``mask_token_id``, the id of the tokenizer's ``<|mask|>`` (REFUSION.md §1,
kept outside this repository): a config that names another token, or an end
token, would have the model decode masks as text and stop at them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

from ..errors import LoadError
from . import config_checks
from .template_steps import MAX_TEMPLATE_CHARS, step_limit

MASK_TOKEN = "<|mask|>"


def tokenizer_problems(folder: Path, config: Dict[str, Any], tokenizer, vocab_size: int) -> List[str]:
    """What makes a folder's tokenizer unfit for a vocabulary of ``vocab_size``,
    one line each: too few tokens (its vocabulary files missing: real
    checkpoints pad the vocabulary by a few hundred ids at most), or an end
    token (config.json, generation_config.json, the tokenizer's) the model
    could never write, or a chat template past its size (``template_steps``)."""
    size = len(getattr(tokenizer, "_tokenizer", tokenizer))
    out = [] if 2 * size >= vocab_size else [
        f"the tokenizer holds {size} tokens for a vocabulary of {vocab_size}: are its vocabulary files "
        "(tokenizer.json, or vocab.json and merges.txt) missing?"]
    given = config_checks.folder_configs(folder, config)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and len(template) > MAX_TEMPLATE_CHARS:
        out.append(f"the chat template is {len(template)} characters long (the most is {MAX_TEMPLATE_CHARS})")
    return out + config_checks.token_id_problems(given, [tokenizer.eos_token_id], vocab_size)


def resolve_mask_id(folder: Path, config: Dict[str, Any], tokenizer, vocab_size: int) -> int:
    """config.json's ``mask_token_id``, else the tokenizer's ``<|mask|>`` token; refused
    (one line) outside the vocabulary, when it is an end token (the tokenizer's EOS,
    config.json's or generation_config.json's ``eos_token_id``), or when the tokenizer has
    a ``<|mask|>`` of another id. A tokenizer without ``<|mask|>`` takes the config's id."""
    named = tokenizer.get_vocab().get(MASK_TOKEN)
    given = config.get("mask_token_id")
    from_config = isinstance(given, int) and not isinstance(given, bool)
    mask_id = given if from_config else named
    if mask_id is None:
        raise LoadError(f"no mask token: config.json has no mask_token_id and the tokenizer has no {MASK_TOKEN}")
    if not 0 <= mask_id < vocab_size:
        raise LoadError(f"mask token id {mask_id} is outside the vocabulary of {vocab_size}")
    what = f"config.json: mask_token_id {mask_id}" if from_config else f"the tokenizer's {MASK_TOKEN} ({mask_id})"
    ends = {tokenizer.eos_token_id, *config_checks.end_ids(config_checks.folder_configs(folder, config))}
    if mask_id in ends:
        mask = f"the tokenizer's {MASK_TOKEN} is {named}" if named is not None else f"the tokenizer has no {MASK_TOKEN}"
        raise LoadError(f"{what} is an end (EOS) token id, not a mask token ({mask})")
    if named is not None and mask_id != named:
        raise LoadError(f"{what} is not the tokenizer's {MASK_TOKEN}, which is {named}")
    return mask_id


def use_template(tokenizer, template: str) -> None:
    """``tokenizer`` renders chats with ``template`` in place of its folder's (mlx-lm's ``--chat-template``):
    refused in one line unless it is text of at most ``MAX_TEMPLATE_CHARS`` characters that renders a
    one-message chat within ``template_steps``' limits (a syntax error fails here, not at the first request)."""
    if not isinstance(template, str) or not template.strip():
        raise LoadError("the chat template given is empty")
    if len(template) > MAX_TEMPLATE_CHARS:
        raise LoadError(f"the chat template given is {len(template):,} characters long (the most is "
                        f"{MAX_TEMPLATE_CHARS:,})")
    tokenizer.chat_template = template
    try:
        with step_limit(tokenizer):
            tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                          add_generation_prompt=True)
    except Exception as e:  # jinja2's errors, a limit's, what the template raises itself
        detail = " ".join(str(e).split())[:200] or type(e).__name__
        raise LoadError(f"the chat template given fails on a one-message chat: {detail}") from None
