"""``python -m refusion_mlx.chat``: a terminal chat that keeps the committed
cache between turns. The session and the terminal live in
:mod:`refusion_mlx.serve.chat`."""

import sys

from .serve.chat import ChatSession, main

__all__ = ["ChatSession", "main"]

if __name__ == "__main__":
    sys.exit(main())
