"""``python -m refusion_mlx.generate``: decode one prompt from the command line.

A thin layer over :mod:`refusion_mlx.decode.generate`. ``refusion_mlx.generate``
is also callable as the function ``generate`` (as ``mlx_lm.generate`` is).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from ._callable import make_callable
from .cli import OneLineParser, add_decoding_args, add_model_args, params_from_args, run
from .decode.answer import AnswerText
from .decode.generate import GenerationResponse, chat_prompt, format_stats, generate, stream_generate
from .decode.params import PARAM_NAMES, make_params
from .models.loading import load

# the names this module offered before the package was split by concern
__all__ = ["AnswerText", "GenerationResponse", "PARAM_NAMES", "build_parser", "chat_prompt", "format_stats",
           "generate", "main", "make_params", "stream_generate"]

DEFAULT_PROMPT = "Write the multiplication table of 7 up to 5."


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m refusion_mlx.generate",
                           description="Generate text with a ReFusion model (slot-level plan-and-infill decoding).")
    add_model_args(parser)
    parser.add_argument("--prompt", "-p", default=DEFAULT_PROMPT, help="the prompt; '-' reads standard input")
    parser.add_argument("--system", help="system message")
    parser.add_argument("--no-chat-template", action="store_true", help="tokenize the prompt as is")
    add_decoding_args(parser)
    parser.add_argument("--verbose", action="store_true", help="print statistics to standard error")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (text, output_ids, statistics) instead of streaming")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        params = params_from_args(args)
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        model, tokenizer = load(args.model, dtype=args.dtype, adapter_path=args.adapter_path)
        ids = chat_prompt(tokenizer, prompt, system=args.system, chat_template=not args.no_chat_template)
        text, tokens, last = "", [], None
        for last in stream_generate(model, tokenizer, ids, params=params):
            text += last.text
            tokens += last.tokens
            if not args.json:
                print(last.text, end="", flush=True)
        if args.json:
            print(json.dumps({"text": text, "output_ids": tokens, "prompt_ids": ids,
                              "finish_reason": last.finish_reason, "stats": last.stats.as_dict()}))
        else:
            print()
        if args.verbose:
            print(format_stats(last.stats), file=sys.stderr)
        return 0

    return run(body)


make_callable(__name__, generate)

if __name__ == "__main__":
    sys.exit(main())
