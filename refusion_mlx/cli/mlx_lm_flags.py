"""mlx-lm's command-line flags as generate and chat take them: ``--verbose``
with or without mlx-lm's boolean (``--verbose False``), ``--extra-eos-token``,
and each flag that has no like here refused in one line (exit 2) that says
why and what to give instead (``decode.params.MLX_LM_HINTS``), not
argparse's bare "unrecognized arguments"."""

from __future__ import annotations

import argparse
import re
from typing import Dict, Optional, Sequence

from ..decode.params import MLX_LM_HINTS
from ..errors import RefusionError
from .flags import in_flags

# mlx-lm's generate and chat flags with no like here: each flag (and its short form) and whether it takes a value
UNSUPPORTED = {("--max-kv-size",): True, ("--prompt-cache-file",): True, ("--quantized-kv-start",): True,
               ("--draft-model",): True, ("--num-draft-tokens",): True, ("--min-tokens-to-keep",): True,
               ("--prefill-step-size",): True,
               ("--quantize-activations", "-qa"): False, ("--trust-remote-code",): False,
               ("--eos-token",): True, ("--use-default-chat-template",): False, ("--image",): True,
               ("--prefill-response",): True}
# mlx_lm.convert's and mlx_lm.fuse's with no like in convert and fuse (fuse has its own --dequantize)
CONVERT_UNSUPPORTED = {("--dequantize", "-d"): False, ("--upload-repo",): True, ("--trust-remote-code",): False}
FUSE_UNSUPPORTED = {("--export-gguf",): False, ("--gguf-path",): True, ("--upload-repo",): True,
                    ("--trust-remote-code",): False}
# mlx_lm.server's flags with no like in the server (its --decode-concurrency is --max-batch's other name)
SERVER_UNSUPPORTED = {("--draft-model",): True, ("--num-draft-tokens",): True, ("--trust-remote-code",): False,
                      ("--use-default-chat-template",): False, ("--prompt-concurrency",): True,
                      ("--prefill-step-size",): True, ("--prompt-cache-size",): True}
SETTING = re.compile(r"(?<![\w-])[a-z]+(?:_[a-z]+)+(?![\w-])")  # a Python name in a hint: top_p, kv_bits
TRUE, FALSE = ("true", "t", "yes", "y", "1", "on"), ("false", "f", "no", "n", "0", "off")


def boolean(text: str) -> bool:
    """argparse type: mlx-lm's boolean words (``True``, ``T``, ``False``, ``F``; yes/no, 1/0, on/off too)."""
    word = text.strip().lower()
    if word not in TRUE + FALSE:
        raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")
    return word in TRUE


def add_verbose_arg(parser: argparse.ArgumentParser, help: str) -> None:
    """--verbose, alone or with mlx-lm's boolean (``--verbose True``, ``--verbose False``)."""
    parser.add_argument("--verbose", type=boolean, nargs="?", const=True, default=False, metavar="BOOL",
                        help=f"{help} (alone, or True/False as mlx-lm takes it)")


class Unsupported(argparse.Action):
    """A flag of mlx-lm's with no like here: a one-line usage error saying why (``reason``, else its
    ``MLX_LM_HINTS`` entry), in this command's flags."""

    def __init__(self, *args, reason: Optional[str] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None):
        name = self.option_strings[0].removeprefix("--").replace("-", "_")
        reason = self.reason or MLX_LM_HINTS[name].split(": ", 1)[1]
        options = parser._option_string_actions

        def as_flag(m) -> str:  # another setting the hint names by its Python name, as this command's flag
            flag = "--" + m.group(0).replace("_", "-")
            return flag if flag in options and not isinstance(options[flag], Unsupported) else m.group(0)

        parser.error(f"{option_string}: {SETTING.sub(as_flag, in_flags(reason))}")


def add_mlx_lm_args(parser: argparse.ArgumentParser) -> None:
    """--extra-eos-token (:func:`add_end_tokens`), and mlx-lm's flags that have no like here (refused)."""
    parser.add_argument("--extra-eos-token", nargs="+", action="extend", default=[], metavar="TOKEN",
                        help="more tokens (or ids) that end an answer, besides the tokenizer's own, as mlx-lm "
                             "takes them")
    refuse(parser, UNSUPPORTED)


def refuse(parser: argparse.ArgumentParser, flags: dict, reasons: Optional[Dict[str, str]] = None) -> None:
    """Each of ``flags`` (mlx-lm's, with no like here: its spellings, and whether it takes a value) refused in
    one line that says why: ``reasons`` (by its Python name), else ``MLX_LM_HINTS``."""
    for spellings, valued in flags.items():
        name = spellings[0].removeprefix("--").replace("-", "_")
        parser.add_argument(*spellings, nargs="?" if valued else 0, action=Unsupported, default=argparse.SUPPRESS,
                            reason=(reasons or {}).get(name), help=argparse.SUPPRESS)  # (no attribute when unused)


def add_end_tokens(tokenizer, model, tokens: Sequence[str], flag: str = "--extra-eos-token") -> None:
    """Each of ``tokens`` (a token of the tokenizer, or an id) also ends an answer: added to the
    tokenizer's end ids (mlx-lm's ``add_eos_token``, which the decoder's stop ids read). A token the
    tokenizer does not hold whole, or an id outside the model's vocabulary, is a one-line RefusionError."""
    vocab = model.args.vocab_size
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    for token in tokens:
        try:
            token_id = int(token)
        except ValueError:
            token_id = hf.convert_tokens_to_ids(token)
            if token_id is None or hf.convert_ids_to_tokens(token_id) != token:
                raise RefusionError(f"{flag} {token!r}: not a token of this tokenizer (give one token, "
                                    "or its id)") from None
        if not 0 <= token_id < vocab:
            raise RefusionError(f"{flag} {token}: not an id of the model's vocabulary (0 to {vocab - 1})")
        tokenizer.add_eos_token(str(token_id))
