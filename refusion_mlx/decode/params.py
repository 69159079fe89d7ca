"""Decoding parameters, named as in the authors' reference ``generate_refusion`` (the project's
specification, REFUSION.md §2, kept outside this repository, lists them; docs/serving.md, Decoding flags)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..errors import DecodeError
from .penalties import MAX_BIAS, MAX_PENALTY, MAX_REPETITION, bias_pairs, check as check_penalties

# With neither serial_num_blocks nor block_length, the response is cut into
# blocks of this many tokens (rounded up to whole slots): 16 tokens hold 4
# slots of the default size, so every budget plans and infills several slots
# per block, and the reference's own default (512 tokens in 32 blocks of 4-token
# slots) is this very layout. Chosen by `python -m refusion_mlx.bench --layouts`
# (docs/benchmarks.md, "Block layout").
DEFAULT_BLOCK_TOKENS = 16
SEEDS = 2 ** 64  # a seed is one of MLX's random keys: an unsigned 64-bit integer
MIN_SEED = -2 ** 63  # ... given as one, or as a signed one (OpenAI's seed; clients send -1)
# XTC's threshold as mlx-lm bounds it: above 0.5 no two tokens can pass it, and XTC would drop nothing
MAX_XTC_THRESHOLD = 0.5
MAX_TEMPERATURE = 2  # OpenAI's bound, every interface's: the flags, make_params, a prompts file, a request
MAX_GEN_LENGTH = 2 ** 24  # most tokens an answer may ask for: past every model's context, and small enough to lay out


@dataclass(frozen=True)
class RefusionParams:
    """Decoding parameters, named as in the reference ``generate_refusion``.

    ``gen_length`` is the answer's most tokens (``max_tokens``): the answer
    is cut there exactly. The decoder's budget is ``gen_length`` rounded up
    to whole slots (the reference's, so a budget of whole slots decodes as
    it does); the rounding stays inside the decoder.

    ``serial_num_blocks`` and ``block_length`` are two ways to cut the response
    into blocks; give at most one. With neither, blocks of
    ``default_block_length(slot_size)`` tokens (``DEFAULT_BLOCK_TOKENS``
    rounded up to whole slots), the last one shorter when the budget is not a
    whole number of blocks.

    :meth:`layout` checks the settings and resolves the budget into its
    :class:`BlockLayout` once, where the settings are made (``make_params``,
    the CLI's flags, a prompts file's line, a server request: a bad value or
    combination is one ``DecodeError`` there); the object then carries it,
    and later calls read it. Frozen, so the layout kept cannot go stale: a
    changed setting is a new object (``dataclasses.replace``).
    """

    gen_length: int = 512
    slot_size: int = 4
    serial_num_blocks: Optional[int] = None
    block_length: Optional[int] = None
    slot_threshold: float = 0.6
    token_threshold: float = 0.3
    temperature: float = 0.0
    seed: Optional[int] = None
    # filters on the planning drafts at temperature > 0 (mlx-lm's): 1.0 / 0 / 0.0 = off
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    # XTC (mlx-lm's): with this chance a sampled planning row drops its likelier tokens above the threshold
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    # on the logits of every head row (decode/penalties.py): OpenAI's, 0 / 0 / None = off; HF's, 1 (or 0) = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[Tuple[Tuple[int, float], ...]] = None  # (token id, bias) pairs; a mapping is read as such
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "logit_bias", bias_pairs(self.logit_bias))
        for name, value in vars(self).items():  # NumPy's scalars as Python's numbers, as mlx-lm takes them
            if isinstance(value, (bool, np.bool_, int, float)) or value is None:
                continue
            if isinstance(value, numbers.Integral):
                object.__setattr__(self, name, int(value))
            elif isinstance(value, numbers.Real):
                object.__setattr__(self, name, float(value))

    def layout(self) -> "BlockLayout":
        """The budget in blocks of whole slots: resolved (or ``DecodeError``) on
        the first call, kept for the next."""
        layout = self.__dict__.get("_layout")
        if layout is None:
            layout = self._resolve()
            object.__setattr__(self, "_layout", layout)
        return layout

    def _resolve(self) -> "BlockLayout":
        S = self.slot_size
        _positive_int("slot_size", S)
        # either name: the caller wrote one; mlx-lm's -1 (no limit) and 0 (no answer) have no like here
        _positive_int("gen_length (max_tokens)", self.gen_length,
                      " (leave it out for the default; a budget past the context left is cut to fit)")
        if self.gen_length > MAX_GEN_LENGTH:  # before any layout is built for it
            raise DecodeError(f"gen_length (max_tokens) {self.gen_length} is over {MAX_GEN_LENGTH:,}: more than "
                              "any model's context")
        for name in ("slot_threshold", "token_threshold"):
            value = getattr(self, name)
            if not _number(value) or not 0.0 <= value <= 1.0:
                raise DecodeError(f"{name} must be within [0, 1], got {value!r}")
        if not _number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise DecodeError(f"temperature must be within [0, {MAX_TEMPERATURE}], got {self.temperature!r}")
        if not _number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise DecodeError(f"top_p must be within (0, 1], got {self.top_p!r}")
        if not _number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise DecodeError(f"min_p must be within [0, 1], got {self.min_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise DecodeError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        for name, top in (("xtc_probability", 1.0), ("xtc_threshold", MAX_XTC_THRESHOLD)):
            value = getattr(self, name)
            if not _number(value) or not 0.0 <= value <= top:
                raise DecodeError(f"{name} must be within [0, {top:g}], got {value!r}")
        check_penalties(self.logit_bias, self.presence_penalty, self.frequency_penalty, self.repetition_penalty)
        if self.seed is not None:
            seed_bits(self.seed)
        gen = budget(self.gen_length, S)
        if self.serial_num_blocks is not None and self.block_length is not None:
            raise DecodeError("give serial_num_blocks or block_length, not both")
        if self.block_length is not None or self.serial_num_blocks is None:
            length = self.block_length
            if length is None:
                length = default_block_length(S)
            _positive_int("block_length", length)
            if length % S:
                raise DecodeError(f"block_length {length} is not a multiple of slot_size {S}")
            lengths = [length] * (gen // length)
            if gen % length:
                lengths.append(gen % length)
            return BlockLayout(gen, lengths, S)
        n = self.serial_num_blocks
        _positive_int("serial_num_blocks", n)
        if gen % n or (gen // n) % S:
            raise DecodeError(
                f"serial_num_blocks {n} does not cut the budget of {gen} tokens (gen_length rounded up to "
                f"whole slots) into blocks of whole slots of {S} tokens")
        return BlockLayout(gen, [gen // n] * n, S)


def seed_bits(seed) -> int:
    """A seed as the unsigned 64-bit integer a random key is made of: a signed one modulo 2**64 (-1 is
    2**64 - 1); not an integer in [-2**63, 2**64): a DecodeError."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not MIN_SEED <= seed < SEEDS:
        raise DecodeError(f"seed must be an integer in [-2**63, 2**64), got {seed!r}")
    return seed % SEEDS


def budget(max_tokens: int, slot_size: int) -> int:
    """The decoder's budget for an answer of at most ``max_tokens``: whole slots."""
    return -(-max_tokens // slot_size) * slot_size


def default_block_length(slot_size: int, tokens: int = DEFAULT_BLOCK_TOKENS) -> int:
    """The default block: ``tokens`` rounded up to whole slots."""
    return -(-tokens // slot_size) * slot_size


def _number(value) -> bool:
    """Whether ``value`` is a float setting's number: an int or a float, not a bool (as int settings refuse one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive_int(name: str, value, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise DecodeError(f"{name} must be a positive integer, got {value!r}{hint}")


@dataclass
class BlockLayout:
    """The decoder's budget (``gen_length``: the answer's most tokens rounded
    up to whole slots) cut into blocks of whole slots."""

    gen_length: int
    block_lengths: List[int]
    slot_size: int = 4

    def describe(self) -> dict:
        """The layout as reports show it: block length (the first block's;
        the last may be shorter), blocks, slots per block."""
        first = self.block_lengths[0]
        return {"block_length": first, "blocks": len(self.block_lengths),
                "slots_per_block": -(-first // self.slot_size)}

# --------------------------------------------------------------------------
# The one table of decoding settings: every interface's names derive from it.


@dataclass(frozen=True)
class Field:
    """One decoding setting as every interface names it.

    ``name`` is the :class:`RefusionParams` attribute, and the key in a
    prompts file and a bench suite; ``aliases`` are other names
    :func:`make_params` and the prompts file take for it. ``flags`` are its
    command-line flags (none: not on the command line), ``exclusive`` a group
    of flags of which at most one may be given. ``request`` is its field in
    the server's request body (None: not a request field), ``openai`` whether
    that field is OpenAI's own (else a ReFusion extension), ``ge``/``gt``/``le``
    the bounds the request schema checks. ``help`` says what it means (the
    flag's help, the request field's description), ``default`` how the flag's
    help shows its default."""

    name: str
    type: type
    help: str
    flags: Tuple[str, ...] = ()
    aliases: Tuple[str, ...] = ()
    default: str = ""
    exclusive: str = ""
    request: Optional[str] = None
    openai: bool = False
    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    parse: str = ""  # the flag's text: "json", a JSON object (a request's field is one already); else ``type``

    def flag_help(self) -> str:
        """The command-line flag's help text."""
        return f"{self.help} ({self.default})" if self.default else self.help

    def request_description(self) -> str:
        """The request field's description in the server's schema."""
        text = self.help if self.openai else f"ReFusion: {self.help}"
        return f"{text} (default: the server's {self.flags[0]})" if self.flags else text

    def bounds(self) -> Dict[str, float]:
        """The request field's bounds, as pydantic's ``Field`` takes them."""
        return {k: v for k, v in (("ge", self.ge), ("gt", self.gt), ("le", self.le)) if v is not None}


_DEFAULTS = RefusionParams()

FIELDS: Tuple[Field, ...] = (
    Field("gen_length", int, "most tokens in the answer (decoded in whole slots, cut here)",
          flags=("--max-tokens", "--gen-length"), aliases=("max_tokens",), default=f"default {_DEFAULTS.gen_length}",
          request="max_tokens", openai=True, ge=1),
    Field("slot_size", int, "tokens per slot", flags=("--slot-size",), default=f"default {_DEFAULTS.slot_size}",
          request="slot_size", ge=1),
    Field("serial_num_blocks", int, "number of blocks decoded one after another (reference semantics)",
          flags=("--serial-num-blocks",), exclusive="blocks", request="serial_num_blocks", ge=1),
    Field("block_length", int, "block size in tokens (a multiple of the slot size)", flags=("--block-length",),
          default=f"default: blocks of {DEFAULT_BLOCK_TOKENS} tokens, rounded up to whole slots",
          exclusive="blocks", request="block_length", ge=1),
    Field("slot_threshold", float, "slot confidence to draft in parallel, tau_s", flags=("--slot-threshold",),
          default=f"default {_DEFAULTS.slot_threshold}", request="slot_threshold", ge=0, le=1),
    Field("token_threshold", float, "verified probability to keep a token, tau_t", flags=("--token-threshold",),
          default=f"default {_DEFAULTS.token_threshold}", request="token_threshold", ge=0, le=1),
    Field("temperature", float, "temperature of the planning drafts; 0: argmax", flags=("--temp",),
          aliases=("temp",), default=f"default {_DEFAULTS.temperature:g}", request="temperature", openai=True,
          ge=0, le=MAX_TEMPERATURE),
    Field("seed", int, "random seed for temperature > 0", flags=("--seed",), request="seed", openai=True,
          ge=MIN_SEED, le=SEEDS - 1),
    Field("top_p", float, "nucleus filter of the planning drafts (1: off)", flags=("--top-p",), request="top_p",
          openai=True, gt=0, le=1),
    Field("top_k", int, "top-k filter of the planning drafts (0: off)", flags=("--top-k",), request="top_k", ge=0),
    Field("min_p", float, "min-p filter of the planning drafts (0: off)", flags=("--min-p",), request="min_p",
          ge=0, le=1),
    Field("xtc_probability", float, "chance that a sampled planning row drops every token above the XTC "
          "threshold but the least likely of them (mlx-lm's XTC; 0: off)", flags=("--xtc-probability",),
          request="xtc_probability", default=f"default {_DEFAULTS.xtc_probability:g}", ge=0, le=1),
    Field("xtc_threshold", float, "probability a token must pass to be dropped by XTC", flags=("--xtc-threshold",),
          request="xtc_threshold", default=f"default {_DEFAULTS.xtc_threshold:g}", ge=0, le=MAX_XTC_THRESHOLD),
    Field("presence_penalty", float, "subtracted from the logit of every token the answer already has (0: off)",
          flags=("--presence-penalty",), request="presence_penalty", openai=True, ge=-MAX_PENALTY, le=MAX_PENALTY),
    Field("frequency_penalty", float, "subtracted from a token's logit once for each time the answer has it "
          "(0: off)", flags=("--frequency-penalty",), request="frequency_penalty", openai=True,
          ge=-MAX_PENALTY, le=MAX_PENALTY),
    Field("logit_bias", dict, f"added to the logits of the tokens it names: a JSON object of token ids to biases in "
          f"[-{MAX_BIAS:g}, {MAX_BIAS:g}]", flags=("--logit-bias",), request="logit_bias", openai=True,
          parse="json"),
    Field("repetition_penalty", float, "divides the positive logits of the tokens the prompt or answer has, "
          "multiplies the others (1 or 0: off)", flags=("--repetition-penalty",), request="repetition_penalty",
          ge=0, le=MAX_REPETITION),
)

PARAM_NAMES = tuple(f.name for f in FIELDS)
# other names of a setting -> its name (make_params, the prompts file)
ALIASES: Dict[str, str] = {alias: f.name for f in FIELDS for alias in f.aliases}


# mlx-lm's generate keywords and command-line flags (``max_kv_size``: ``--max-kv-size``) that have no like here,
# and what to give instead: make_params says it of a keyword, generate and chat of a flag (cli.mlx_lm_flags)
MLX_LM_HINTS = {
    "sampler": "sampler: give temp, top_p, top_k and min_p (what mlx-lm's make_sampler takes)",
    "logits_processors": "logits_processors: not supported (ReFusion scores whole slots: give logit_bias, "
                         "repetition_penalty, presence_penalty or frequency_penalty)",
    "prompt_cache": "prompt_cache: give cache=CommittedCache.for_model(model) (refusion_mlx.decode.cache)",
    "max_kv_size": "max_kv_size: not supported (the committed cache keeps every row; kv_bits 8 or 4 keeps them in "
                   "less memory)",
    "quantized_kv_start": "quantized_kv_start: not supported: kv_bits quantizes the cache from its first row",
    "prompt_cache_file": "prompt_cache_file: not supported (the chat keeps its cache between turns; the server "
                         "keeps prompt caches, on disk with --prompt-cache-dir)",
    "draft_model": "draft_model: not supported (ReFusion drafts whole slots itself and verifies them: no draft "
                   "model)",
    "num_draft_tokens": "num_draft_tokens: not supported (ReFusion drafts whole slots of slot_size tokens)",
    "min_tokens_to_keep": "min_tokens_to_keep: not supported (the filters always keep the most likely token)",
    "prefill_step_size": "prefill_step_size: not supported (a prompt is prefilled in chunks of 512 tokens)",
    "quantize_activations": "quantize_activations: not supported (quantize the weights: python -m "
                            "refusion_mlx.convert -q)",
    "trust_remote_code": "trust_remote_code: not supported (this package builds the model; no checkpoint's own "
                         "code is run)",
    "eos_token": "eos_token: give extra_eos_token (an end token besides the tokenizer's)",
    "use_default_chat_template": "use_default_chat_template: not supported (the checkpoint's own chat template "
                                 "is used, or the one chat_template gives)",
    # mlx_lm.server's, mlx_lm.convert's and mlx_lm.fuse's own
    "dequantize": "dequantize: not supported (convert the PyTorch checkpoint again without --quantize for "
                  "float weights, or dequantize the MLX folder with mlx-lm's convert -d)",
    "upload_repo": "upload_repo: not supported (upload the folder it writes with huggingface-hub's own "
                   "command: hf upload REPO FOLDER)",
    "export_gguf": "export_gguf: not supported (no GGUF runtime runs ReFusion's slot decoder: the folder is "
                   "MLX's safetensors)",
    "gguf_path": "gguf_path: not supported (no GGUF is written: no GGUF runtime runs ReFusion's slot decoder)",
    "prompt_concurrency": "prompt_concurrency: not supported (prompts are prefilled in the decoding batch's "
                          "forwards, up to max_batch requests at once, in chunks of 512 tokens)",
    "prompt_cache_size": "prompt_cache_size: not supported (the prompt cache is bounded in bytes: give "
                         "prompt_cache_bytes)",
    "image": "image: not supported (ReFusion reads text only)",
    "prefill_response": "prefill_response: not supported here (the server's continue_final_message continues an "
                        "assistant message)",
}


def budget_given(kwargs: Dict[str, Any]) -> bool:
    """Whether decoding keywords name a budget (``max_tokens`` or ``gen_length``); else the default's is
    shrunk to what the context leaves (``BatchGenerator.insert``'s ``fit``)."""
    return any(kwargs.get(k) is not None for k in ("gen_length", *(a for a, n in ALIASES.items() if n == "gen_length")))


def settings_named(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Decoding settings with each alias of ``ALIASES`` (``max_tokens``, ``temp``) under its setting's name;
    a setting given by both names, with two values, is a DecodeError (make_params, a prompts file's line)."""
    kwargs = dict(kwargs)
    for alias, name in ALIASES.items():
        if alias in kwargs:
            value = kwargs.pop(alias)
            if name in kwargs and kwargs[name] != value:
                raise DecodeError(f"give {alias} or {name}, not both")
            kwargs[name] = value
    return kwargs


def a_params(params) -> RefusionParams:
    """``params`` when it is a RefusionParams, else the one DecodeError saying how to make one."""
    if not isinstance(params, RefusionParams):
        raise DecodeError(f"params must be a RefusionParams (make_params(max_tokens=..., ...)), got "
                          f"{type(params).__name__}")
    return params


def layered(values: Dict[str, Any], layer: Dict[str, Any]) -> Dict[str, Any]:
    """Settings ``layer`` over ``values`` (a None in ``layer`` is not given): a
    block count replaces a block length beneath it and vice versa, so a
    layer's block choice is the one kept (a preset over a bench suite, the
    caller's keywords over a preset)."""
    layer = {k: v for k, v in layer.items() if v is not None}
    other = {"serial_num_blocks": "block_length", "block_length": "serial_num_blocks"}
    return {**{k: v for k, v in values.items() if other.get(k) not in layer}, **layer}


def make_params(preset: Optional[str] = None, **kwargs) -> RefusionParams:
    """RefusionParams from keyword arguments, checked; the aliases of
    ``ALIASES`` (``max_tokens``, ``temp``) stand for their settings.
    ``preset``: one of ``PRESETS`` first, the keywords over it; with a
    budget of its own (``max_tokens``) the preset keeps its block length
    (:func:`.presets.preset`), as the CLI's ``--preset`` does."""
    kwargs = settings_named(kwargs)
    unknown = sorted(set(kwargs) - set(PARAM_NAMES))
    if unknown:
        hints = [MLX_LM_HINTS[k] for k in unknown if k in MLX_LM_HINTS]
        raise TypeError(f"unknown decoding parameter(s): {', '.join(unknown)}" + "".join(f"; {h}" for h in hints))
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if preset is not None:
        from .presets import preset as preset_values

        kwargs = layered(preset_values(preset, kwargs.get("gen_length")), kwargs)  # the caller's blocks win
    params = RefusionParams(**kwargs)
    params.layout()  # checked and resolved where made: a bad setting is a DecodeError here
    return params
