"""Decoding settings the ReFusion authors used per benchmark (https://arxiv.org/abs/2512.13586;
recorded in the project's specification, REFUSION.md §2, kept outside this repository)."""

from typing import Any, Dict, Optional

from ..errors import DecodeError

# gen_length 512 in all of them.
PRESETS: Dict[str, Dict[str, float]] = {
    "reference": dict(slot_size=4, serial_num_blocks=32, slot_threshold=0.6, token_threshold=0.3),
    "gsm8k": dict(slot_size=32, serial_num_blocks=4, slot_threshold=0.9, token_threshold=0.4),
    "math": dict(slot_size=32, serial_num_blocks=8, slot_threshold=0.8, token_threshold=0.6),
    "gpqa": dict(slot_size=8, serial_num_blocks=32, slot_threshold=0.8, token_threshold=0.2),
    "mbpp": dict(slot_size=32, serial_num_blocks=4, slot_threshold=0.9, token_threshold=0.3),
    "humaneval": dict(slot_size=32, serial_num_blocks=4, slot_threshold=0.9, token_threshold=0.4),
    "arc-c": dict(slot_size=8, serial_num_blocks=64, slot_threshold=0.8, token_threshold=0.1),
    "mmlu-pro": dict(slot_size=16, serial_num_blocks=4, slot_threshold=0.9, token_threshold=0.4),
}

PRESET_GEN_LENGTH = 512


def preset(name: str, gen_length: Optional[int] = None) -> Dict[str, float]:
    """The settings of a named preset for an answer of ``gen_length`` tokens
    (None: the preset's own 512), gen_length included. A preset's block
    count is tied to its 512 tokens, so its settings name its block
    *length* (512 / its count): its own layout at 512, and the same blocks at
    any other budget, however that budget is set (a flag, a server
    request's ``max_tokens``, a prompts file's line, the context's cut) --
    the one home of that rule."""
    if name not in PRESETS:
        raise DecodeError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    values: Dict[str, Any] = {"gen_length": PRESET_GEN_LENGTH if gen_length is None else gen_length, **PRESETS[name]}
    values["block_length"] = PRESET_GEN_LENGTH // values.pop("serial_num_blocks")
    return values
