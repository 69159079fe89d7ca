"""What the command-line tools share: one-line usage errors, the decoding
flags and their translation into ``RefusionParams``.

Every ``python -m refusion_mlx.*`` command is a thin layer over the Python
API. This module sits just above ``decode`` (whose parameters it parses):
the converter, the server, the chat and the benchmark build their parsers
with it; the library code below never imports it.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import sys
from typing import Callable, List, Optional

from ..decode.fit import fit_budget, own_blocks
from ..decode.kv_quant import DEFAULT_GROUP_SIZE, GROUP_SIZES, KV_BITS
from ..decode.kv_store import KVStorage
from ..decode.params import FIELDS, PARAM_NAMES, RefusionParams, make_params
from ..decode.presets import PRESETS
from ..distributed import group as distributed_group
from ..distributed.group import is_link_failure
from .._startup import console_script, started
from ..errors import DecodeError, RefusionError, Terminated, brief


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line and exit 2, and which takes
    no abbreviated flag (a prefix of a flag is an error). Its parse is a
    command's start: Ctrl-C is KeyboardInterrupt from then on (before, a
    quiet exit 130: ``refusion_mlx._startup``), and a closed standard
    output is one line and exit 1 (a closed standard error is the null device)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # mlx-lm's --train is not --train-embeddings
        script = "refusion-" + str(kwargs.get("prog")).removeprefix("python -m refusion_mlx.")
        if script == console_script():  # started as refusion-generate: the name the user typed
            kwargs["prog"] = script
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        started()
        if sys.stderr is None:
            sys.stderr = open(os.devnull, "w")
        if sys.stdout is None:
            self.exit(1, f"{self.prog}: error: standard output is closed (where the answer and messages go)\n")
        return super().parse_known_args(args, namespace)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_model_args(parser: argparse.ArgumentParser, adapters: bool = True, dtype_default: Optional[str] = None,
                   dtype_help: str = "compute dtype (default: float32 on CPU, the checkpoint's on GPU)",
                   model_help: str = "model folder or hub repo id (default: the bundled demo model)",
                   short: bool = True) -> None:
    """--model, --adapter-path and --dtype, as every command that loads a model takes them.

    ``adapters=False`` leaves --adapter-path to a command that means something
    else by it (fuse); ``dtype_default``/``dtype_help`` for a command whose
    --dtype has another default or meaning (bench, fuse). ``short=False``: no ``-m``
    for --model (generate and chat, where ``-m`` is mlx-lm's --max-tokens)."""
    parser.add_argument("--model", *(["-m"] if short else []), type=model_name, help=model_help)
    if adapters:
        add_adapter_arg(parser)
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=dtype_default,
                        help=dtype_help)


def add_adapter_arg(parser: argparse.ArgumentParser) -> None:
    """--adapter-path: fine-tuned adapters (mlx-lm's format, python -m refusion_mlx.train) on the model."""
    parser.add_argument("--adapter-path", type=adapter_folder,
                        help="folder of fine-tuned adapters to apply (adapter_config.json + adapters.safetensors)")


def add_kv_args(parser: argparse.ArgumentParser) -> None:
    """--kv-bits and --kv-group-size: how every KV cache of the process keeps
    its committed keys and values (``decode/kv_quant.py``). A setting of the
    process, not of a request: one form per cache, so the prompt cache, its
    files and memory admission count one kind of row. Each flag's name is
    its ``ServerConfig`` field and its Python API keyword."""
    parser.add_argument("--kv-bits", type=int, choices=KV_BITS,
                        help="keep the KV cache's committed keys and values quantized to this many bits "
                             "(mx.quantize; the rows a pass computes stay in the model's dtype until committed). "
                             "Default: the model's dtype")
    parser.add_argument("--kv-group-size", type=int, choices=GROUP_SIZES,
                        help=f"with --kv-bits: values per scale and bias, along the head dimension, which it "
                             f"must divide (default {DEFAULT_GROUP_SIZE})")


def storage_from_args(args: argparse.Namespace, model=None) -> KVStorage:
    """The ``KVStorage`` of --kv-bits / --kv-group-size (checked against the
    model's head dimension when given); a bad pair is a one-line DecodeError."""
    try:
        return KVStorage.of(getattr(args, "kv_bits", None), getattr(args, "kv_group_size", None), model)
    except DecodeError as e:
        raise DecodeError(in_flags(str(e))) from None


# the Python API's names of the settings, as the command line spells them
FLAG_OF = {**{f.name: f.flags[0] for f in FIELDS if f.flags}, "kv_bits": "--kv-bits",
           "kv_group_size": "--kv-group-size"}


def in_flags(message: str) -> str:
    """A message of the Python API (``gen_length must be ...``) in the flags the user typed (``--max-tokens``)."""
    message = message.replace("gen_length (max_tokens)", "gen_length")
    return re.sub(r"(?<![\w-])(" + "|".join(FLAG_OF) + r")(?![\w-])", lambda m: FLAG_OF[m.group(1)], message)


class Spelled(argparse.Action):
    """Stores a flag's value (``True`` for one with ``nargs=0``) and, as ``<dest>_as``, the
    spelling the user typed among its aliases, so an error names the flag on their command line."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True if self.nargs == 0 else values)
        setattr(namespace, self.dest + "_as", option_string)


def spelled(args: argparse.Namespace, dest: str) -> str:
    """The flag the user typed for ``dest`` (a :class:`Spelled` option they gave)."""
    return getattr(args, dest + "_as")


def add_template_arg(parser: argparse.ArgumentParser) -> None:
    """--chat-template-config (mlx-lm's generate; --chat-template-args, its
    server's): the chat template's own variables, as a JSON object; and
    --chat-template (mlx-lm's server's): a template in place of the model's."""
    parser.add_argument("--chat-template-config", "--chat-template-args", dest="chat_template_config",
                        type=template_json, metavar="JSON", action=Spelled,
                        help='the chat template\'s own variables, a JSON object: \'{"enable_thinking": false}\'')
    parser.add_argument("--chat-template", metavar="TEMPLATE", action=Spelled,
                        help="a chat template (Jinja text, as mlx-lm's server takes it) in place of the model's; "
                             "checked on a one-message chat when the model loads")


def template_json(text: str) -> dict:
    """argparse type: a JSON object of chat template variables (``decode.stream.template_options``)."""
    from ..decode.stream import template_options

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    try:
        return template_options(value, "the value")
    except DecodeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def json_object(text: str) -> dict:
    """argparse type: a JSON object (--logit-bias); what it holds is checked with the other settings."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text}")
    return value


def add_decoding_args(parser: argparse.ArgumentParser, max_tokens_short: bool = False) -> None:
    """The ReFusion decoding flags, shared by generate, chat, server and bench:
    one per setting of ``decode.params.FIELDS`` that has flags, then --preset.
    ``max_tokens_short``: ``-m`` is --max-tokens too, as in mlx-lm's generate and chat."""
    groups: dict = {}
    for field in FIELDS:
        if not field.flags:
            continue
        target = parser
        if field.exclusive:
            if field.exclusive not in groups:
                groups[field.exclusive] = parser.add_mutually_exclusive_group()
            target = groups[field.exclusive]
        short = ["-m"] if max_tokens_short and field.name == "gen_length" else []
        kind = json_object if field.parse == "json" else field.type
        target.add_argument(*field.flags, *short, dest=field.name, type=kind, help=field.flag_help(),
                            **({"metavar": "JSON"} if field.parse == "json" else {}))
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="the paper's per-benchmark settings (explicit flags override)")


def params_from_args(args: argparse.Namespace) -> RefusionParams:
    """RefusionParams from CLI flags: a preset first, explicit flags over it.

    A preset's block count is tied to its 512-token budget; with another
    budget the preset keeps its block *length* instead.
    """
    values = {name: getattr(args, name) for name in PARAM_NAMES if getattr(args, name, None) is not None}
    try:  # a bad value or combination: DecodeError, before the model loads
        return make_params(preset=getattr(args, "preset", None), **values)
    except DecodeError as e:
        raise DecodeError(in_flags(str(e))) from None


def fitted(params: RefusionParams, prompt_tokens: int, model, given: Optional[int], name: str = "--max-tokens",
           where: str = "") -> RefusionParams:
    """``params`` with a budget that fits ``model``'s context after a prompt of
    ``prompt_tokens`` (``decode.fit``: the server's rule). ``given``: the budget
    the user gave, by ``name`` (None: the default, shrunk to what fits without
    a word); one cut to fit is a note on standard error (``where``: the
    prompt's label). A prompt that leaves no room is a one-line DecodeError."""
    context = model.args.max_position_embeddings
    fit = fit_budget(prompt_tokens, context, params, own_blocks(params), max_tokens=given, name=name)
    if fit.asked is not None:
        print(f"{where}note: {name} {fit.asked} cut to {fit.params.gen_length}: the prompt's {prompt_tokens} "
              f"tokens leave that much of the model's context of {context}", file=sys.stderr)
    return fit.params


FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a write's errors; a file's name them (output.write_text)


def _quiet_stdout() -> None:
    """Standard output onto the null device: Python's flush at exit finds no reader and would say so."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def _flush_or_drop_stdout() -> bool:
    """What standard output still holds written now (True), or, where it cannot be (a full disk), dropped
    (:func:`_quiet_stdout`; False): Python's flush at exit would fail again and say so in a note of its own."""
    try:
        sys.stdout.flush()
        return True
    except (OSError, ValueError):
        _quiet_stdout()
        return False


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def count(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number (0 or more), got {text!r}")
    return value


def byte_size(text: str) -> int:
    """argparse type: bytes, with an optional K/M/G/T suffix (powers of 1024): 512M, 2G, 0."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = 1 << 10 * ("KMGT".index(t[-1]) + 1) if t[-1:] in ("K", "M", "G", "T") else 1
    try:
        value = float(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        value = -1
    if not 0 <= value < 1 << 60:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (e.g. 512M, 2G, 0 for none)")
    return int(value)


def positive_ints(text: str) -> List[int]:
    """argparse type: comma-separated integers >= 1 (``1,2,4,8``); an empty
    item (``1,,4``, a trailing comma) is refused, not skipped."""
    try:
        values = [positive_int(x.strip()) for x in text.split(",")]
    except argparse.ArgumentTypeError:
        values = []
    if not values:
        empty = " (an empty item)" if any(not x.strip() for x in text.split(",")) else ""
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,2,4,8, got {text!r}{empty}")
    return values


def named(what: str) -> Callable[[str], str]:
    """An argparse type: a name of ``what``, not an empty string (which a folder's path reads as the current
    folder)."""
    def name(value: str) -> str:
        if not value.strip():
            raise argparse.ArgumentTypeError(f"must name {what}, not an empty string")
        return value

    return name


model_name = named("a model folder or hub repo id")  # --model
adapter_folder = named("an adapter folder")  # --adapter-path
output_file = named("a file")  # a file a command writes


def read_text(path: str) -> str:
    """A text file's contents (a byte-order mark dropped, as Windows editors
    write one), or a one-line RefusionError."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            return f.read()
    except OSError as e:
        raise RefusionError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise RefusionError(f"{path} is not UTF-8 text") from None


def read_input(value: str, flag: str) -> str:
    """``flag``'s text: standard input's when ``value`` is ``-`` (a byte-order
    mark dropped), else the file's (:func:`read_text`)."""
    if value != "-":
        return read_text(value)
    if sys.stdin is None:
        raise RefusionError(f"{flag} -: standard input is closed")
    try:
        return sys.stdin.read().removeprefix("\ufeff")
    except UnicodeDecodeError:
        raise RefusionError(f"{flag} -: standard input is not UTF-8 text") from None


def without_line_end(text: str) -> str:
    r"""``text`` without one line ending at its end (``\r\n``, as Windows writes it, ``\n``, or the ``\r``
    that ``input()`` leaves of a ``\r\n``): piped input's last newline is not part of a prompt."""
    return text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith(("\n", "\r")) else text


def run(body: Callable[[], int]) -> int:
    """Run a command's body: a RefusionError, a file-system error or MLX's
    own failure (out of memory) is one line on stderr and exit 1, Ctrl-C is "interrupted" and exit 130 (a
    :class:`~refusion_mlx.errors.Terminated`, SIGTERM, "terminated" and 143)
    -- never a traceback. What the body printed is flushed before it returns, so a full disk is said here
    and not at the interpreter's exit."""
    try:
        code = body()
        sys.stdout.flush()
        return code
    except RefusionError as e:
        distributed_group.say_error(e)
        return 1
    except RecursionError:  # (a RuntimeError) json and yaml parse nesting by recursion
        print("error: an input (a JSON or YAML file, or a schema) is nested too deeply to read", file=sys.stderr)
        return 1
    except RuntimeError as e:  # a lost rank, or MLX's own failure ("[metal::malloc] ..."): one line; a bug's
        if not is_link_failure(e) and not str(e).startswith("["):  # traceback stays
            raise
        distributed_group.say_error(distributed_group.lost_ranks(e) if is_link_failure(e) else brief(e))
        return 1
    except BrokenPipeError:  # the reader left (``| head``): quiet, as cat and grep are
        _quiet_stdout()
        return 141
    except OSError as e:  # a file's, or standard output's (a full disk: what it could not take is dropped)
        name = getattr(e, "filename", None)
        if name is None and (not _flush_or_drop_stdout() or e.errno in FULL):  # unbuffered, the write raised
            _quiet_stdout()  # at once and Python dropped its data: the flush after it finds nothing left
            name = "standard output"
        print(f"error: {e.strerror or e}" + (f": {name}" if name else ""), file=sys.stderr)
        return 1
    except UnicodeDecodeError as e:  # (a ValueError) an input read in a strict encoding
        print(f"error: an input is not {e.encoding} text ({e.reason})", file=sys.stderr)
        return 1
    except UnicodeEncodeError as e:
        print(f"error: standard output's encoding ({e.encoding}) cannot write the text; set PYTHONIOENCODING=utf-8",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print("terminated" if isinstance(e, Terminated) else "interrupted", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
