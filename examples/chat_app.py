"""A minimal chat app that embeds refusion-mlx's Python API, with streaming.

    python examples/chat_app.py                                   # type messages; Ctrl-D ends
    python examples/chat_app.py "Who is Sven?" "Count from 17 to 38."

``ChatSession`` keeps the conversation's committed KV cache between turns, so
each turn prefills only the new messages; ``stream`` yields text in answer
order as soon as it is final, although ReFusion decodes slots out of order.
"""

from __future__ import annotations

import argparse
import sys
from typing import Iterable

import refusion_mlx  # noqa: F401  (first: it picks an optimized BLAS before MLX loads)
from refusion_mlx.decode.conversation import ChatSession
from refusion_mlx.errors import RefusionError
from refusion_mlx.generate import make_params
from refusion_mlx.models.loading import load


def messages_from_stdin() -> Iterable[str]:
    while True:
        try:
            line = input("you> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if line.strip():
            yield line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("messages", nargs="*", help="user messages, one turn each (default: read stdin)")
    parser.add_argument("--model", help="model folder (default: the bundled demo model)")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    try:
        model, tokenizer = load(args.model)
        session = ChatSession(model, tokenizer, make_params(max_tokens=args.max_tokens, block_length=32))
    except RefusionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for text in args.messages or messages_from_stdin():
        print("assistant> ", end="", flush=True)
        try:
            for response in session.stream(text):
                print(response.text, end="", flush=True)
        except RefusionError as e:  # e.g. the conversation outgrew the context
            print(f"\nerror: {e}", file=sys.stderr)
            continue
        turn = session.turns[-1]
        print(f"\n  [{turn.answer_tokens} tokens in {turn.stats.steps} steps; prefilled "
              f"{turn.prefill_tokens} of {turn.prompt_tokens} prompt tokens, the rest came from the cache]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
