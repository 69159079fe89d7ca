"""``python -m refusion_mlx.chat``: a terminal chat that keeps the committed
cache between turns.

The conversation is :class:`refusion_mlx.decode.conversation.ChatSession`;
the loop, the live slot view (``--visualize``) and the trace (``--trace
FILE``, see ``examples/render_trace.py``) are in :mod:`refusion_mlx.cli`.
"""

from __future__ import annotations

import signal
import sys
from typing import List, Optional

from .cli import (OneLineParser, add_decoding_args, add_kv_args, add_model_args, add_template_arg, fill_defaults,
                  output_file, params_from_args, refuse_unread, run, storage_from_args)
from .cli.launch import add_distributed_args, join, leader_interrupts, ready, shared_input
from .cli.mlx_lm_flags import add_end_tokens, add_mlx_lm_args
from .cli.repl import HELP, Terminal, repl
from .cli.trace import Trace
from .decode.conversation import ChatSession
from .distributed import watchdog
from .distributed.group import say_error
from .errors import RefusionError
from .models.backend import wired_limit
from .models.loading import load

__all__ = ["ChatSession", "build_parser", "main"]
GOES_WITH = {"visualize": ("frame_time",)}  # refused without it: it would be ignored (cli.unread)
DEFAULTS = {"frame_time": 0.08}


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="python -m refusion_mlx.chat",
                           description="Chat with a ReFusion model in the terminal (multi-turn, KV cache kept "
                                       "across turns).")
    add_model_args(parser, short=False)  # -m: --max-tokens, as mlx-lm's
    add_distributed_args(parser)
    parser.add_argument("--system", "--system-prompt", dest="system", help="system message")
    add_template_arg(parser)
    add_decoding_args(parser, max_tokens_short=True)
    add_kv_args(parser)
    parser.add_argument("--no-reuse", action="store_true",
                        help="prefill the whole conversation every turn (to measure what reuse saves)")
    parser.add_argument("--visualize", action="store_true",
                        help="draw the answer's slots filling out of order (ANSI terminal)")
    parser.add_argument("--frame-time", type=float, metavar="SECONDS",
                        help=f"with --visualize, the least time a step stays on screen (default "
                             f"{DEFAULTS['frame_time']:g}; 0: as fast as it decodes)")
    parser.add_argument("--trace", metavar="FILE", type=output_file, help="write each step's commits as JSON to FILE")
    add_mlx_lm_args(parser)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    refuse_unread(parser, args, GOES_WITH)
    fill_defaults(args, DEFAULTS)
    term = Terminal()
    try:
        if not 0 <= args.frame_time <= 10:
            raise RefusionError(f"--frame-time must be within 0..10 seconds, got {args.frame_time}")
        if sys.stdin is None:
            raise RefusionError("the chat reads its turns from standard input, which is closed")
        # a line's undecodable bytes kept as such (what Python's UTF-8 locales do): that turn fails in one
        # line and the chat goes on, as under a strict locale (PYTHONIOENCODING=utf-8:strict) too
        if hasattr(sys.stdin, "reconfigure"):
            sys.stdin.reconfigure(errors="surrogateescape")
        params = params_from_args(args)
        storage = storage_from_args(args)  # a bad --kv-bits / --kv-group-size pair fails before the model loads
        dist = join(args)  # under mlx.launch: rank 0 reads the user's lines and writes; every rank decodes
        if dist is not None and not dist.leader:  # Ctrl-C reaches every rank: rank 0's decides (cli.launch)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        trace = None
        if args.trace and (dist is None or dist.leader):
            try:
                trace = Trace(args.trace, None)
            except OSError as e:
                raise RefusionError(f"cannot write the trace to {args.trace}: {e.strerror or e}") from None
        model, tokenizer = load(args.model, dtype=args.dtype, adapter_path=args.adapter_path, dist=dist,
                                chat_template=args.chat_template)
        storage = storage_from_args(args, model)  # the group size against the model's head dimension
        add_end_tokens(tokenizer, model, args.extra_eos_token)
        ready(dist)
        if dist is not None:
            term = Terminal(read=shared_input(dist, term.read), out=sys.stdout,
                            err=sys.stderr if dist.leader else sys.stdout, interactive=term.interactive)
        if trace is not None:
            trace.tokenizer = tokenizer
        session = ChatSession(model, tokenizer, params, system=args.system, reuse=not args.no_reuse,
                              storage=storage, template_kwargs=args.chat_template_config)
    except RefusionError as e:
        say_error(e)  # one line per problem
        return 1
    except KeyboardInterrupt:  # while the model loads: as every command says it (cli.run)
        print("interrupted", file=sys.stderr)
        return 130
    if term.interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    name = args.model or "tiny-refusion (demo)"
    term.note(f"refusion_mlx.chat · {name} · max tokens {params.gen_length} · slot {params.slot_size}"
              + (" · no cache reuse" if args.no_reuse else "")
              + (f" · KV cache {storage.bits}-bit" if storage.bits else ""))
    term.note(HELP)
    # under mlx.launch the collectives have a timeout (rank 0 sends a heartbeat while the user types)
    def chat() -> int:
        # rank 0's Ctrl-C acts at a broadcast, so every rank stops together
        with wired_limit(model), watchdog.armed(), leader_interrupts(dist):  # Metal: weights stay resident
            return repl(session, term, visualize=args.visualize, trace=trace, frame_time=args.frame_time)

    # as every command's: a reader gone (``| head``) quiet, a full disk, an encoding or a lost rank one line
    return run(chat)

if __name__ == "__main__":
    sys.exit(main())
