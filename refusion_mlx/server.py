"""``python -m refusion_mlx.server``: the OpenAI-compatible HTTP server
(:mod:`refusion_mlx.serve.server`)."""

import sys

from .serve.server import RefusionServer, main

__all__ = ["RefusionServer", "main"]

if __name__ == "__main__":
    sys.exit(main())
