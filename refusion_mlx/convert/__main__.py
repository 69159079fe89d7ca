"""``python -m refusion_mlx.convert``: a ReFusion checkpoint (Hugging Face
PyTorch format) to an MLX folder, :func:`refusion_mlx.convert.convert` from
the command line. SIGTERM and SIGHUP, like Ctrl-C, leave the destination as
it was, unless the new folder was already in place: the message says which
(a signal that is ignored, as ``nohup`` ignores SIGHUP, stays ignored)."""

from __future__ import annotations

import re
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator, List, Optional

from ..cli import OneLineParser, handle_unless_ignored
from ..cli.mlx_lm_flags import CONVERT_UNSUPPORTED, refuse
from ..distributed.group import say_error
from ..errors import RefusionError
from .converter import convert, format_summary
from .staging import outcome
from .quant_plan import DTYPES, MODE_DEFAULTS, Q_BITS, Q_GROUP_SIZES, Q_MODES, RECIPES, quant_settings


class Signalled(BaseException):
    """SIGTERM/SIGHUP turned into an exception, so the staging folder is removed."""


def _terminate(signum, frame):
    raise Signalled(signum)


@contextmanager
def termination_raises() -> Iterator[None]:
    """SIGTERM and SIGHUP raise ``Signalled`` for the duration (main thread only), unless they are
    ignored: under ``nohup`` a hangup leaves the conversion running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: handle_unless_ignored(sig, _terminate) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)


SETTINGS = re.compile(r"(?<![\w-])(q_bits|q_group_size|q_mode|quant_predicate)\b")


def flag_names(message: str) -> str:
    """A settings error of ``convert`` (Python parameters: ``q_bits``) as the command says it (``--q-bits``)."""
    return SETTINGS.sub(lambda m: "--" + m.group(1).replace("_", "-"), message)


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="python -m refusion_mlx.convert",
                           description="Convert a ReFusion checkpoint (a Qwen3 or Llama architecture, Hugging Face "
                                       "format) to MLX.")
    parser.add_argument("--hf-path", "--model", required=True,
                        help="source: a local folder or a Hugging Face repo id")
    parser.add_argument("--mlx-path", default="mlx_model", help="destination folder (default: mlx_model)")
    parser.add_argument("-q", "--quantize", action="store_true", help="quantize (default 4-bit affine, group 64)")
    # no choices: quant_settings checks both against --q-mode (the other modes fix their own), in one line
    fixed = ", ".join(f"{mode} {group}" for mode, (group, _) in MODE_DEFAULTS.items() if mode != "affine")
    parser.add_argument("--q-bits", type=int, metavar="BITS",
                        help=f"bits per weight (affine: {', '.join(map(str, Q_BITS))}; default 4)")
    parser.add_argument("--q-group-size", type=int, metavar="SIZE",
                        help=f"quantization group size (affine: {', '.join(map(str, Q_GROUP_SIZES))}; default 64; "
                             f"the other modes fix theirs: {fixed})")
    parser.add_argument("--q-mode", default="affine", choices=Q_MODES, help="quantization mode")
    parser.add_argument("--quant-predicate", choices=list(RECIPES), metavar="RECIPE",
                        help="mixed-precision recipe: " + "; ".join(f"{k}: {v}" for k, v in RECIPES.items()))
    parser.add_argument("--dtype", choices=list(DTYPES),
                        help="dtype of unquantized tensors and scales (default: the config's torch_dtype)")
    parser.add_argument("--force", action="store_true",
                        help="replace the model folder at --mlx-path (never a file or another folder)")
    refuse(parser, CONVERT_UNSUPPORTED)  # mlx_lm.convert's flags with no like here: one line each says why
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        quant_settings(args.quantize, args.q_bits, args.q_group_size, args.q_mode, args.quant_predicate)
    except RefusionError as e:
        parser.error(flag_names(str(e)))
    try:
        with termination_raises():
            summary = convert(args.hf_path, args.mlx_path, quantize=args.quantize,
                              q_group_size=args.q_group_size, q_bits=args.q_bits, q_mode=args.q_mode,
                              quant_predicate=args.quant_predicate, dtype=args.dtype, force=args.force)
    except RefusionError as e:
        say_error(str(e))  # one line per problem
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: {outcome(args.mlx_path)}", file=sys.stderr)
        return 130
    except Signalled as e:
        print(f"terminated: {outcome(args.mlx_path)}", file=sys.stderr)
        return 128 + e.args[0]
    except OSError as e:
        where = e.filename or args.mlx_path
        print(f"error: {e.strerror or e} ({where}); {outcome(args.mlx_path)}", file=sys.stderr)
        return 1
    except Exception as e:  # a bug: still one line, and the staging folder is gone
        print(f"error: unexpected {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    try:
        print(format_summary(summary), flush=True)
    except OSError as e:  # the folder is whole; only its summary could not be written
        print(f"error: {args.mlx_path} was written, but not its summary: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
