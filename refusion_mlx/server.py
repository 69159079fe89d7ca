"""``python -m refusion_mlx.server``: the OpenAI-compatible HTTP server
(:class:`refusion_mlx.serve.http_server.RefusionServer`) from the command line."""

from __future__ import annotations

import logging
import signal
import sys
from typing import TYPE_CHECKING, List, Optional

from ._startup import freeze_imports
from .cli import (OneLineParser, add_decoding_args, add_model_args, add_template_arg, handle_unless_ignored,
                  handlers_kept, raise_interrupt_once)
from .cli.launch import add_distributed_args, join
from .cli.mlx_lm_flags import SERVER_UNSUPPORTED, refuse
from .distributed.group import say_error
from .errors import RefusionError
from .models.backend import wired_limit
from .serve.server_config import ServerConfig, add_server_args

if TYPE_CHECKING:  # imported on first use (__getattr__)
    from .serve.http_server import RefusionServer

__all__ = ["RefusionServer", "ServerConfig", "build_parser", "main"]

log = logging.getLogger("refusion_mlx.server")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="python -m refusion_mlx.server",
                           description="OpenAI- and Anthropic-compatible HTTP server for a ReFusion model "
                                       "(chat and text completions, Responses, Messages, tool calls).")
    add_model_args(parser)  # --model, --adapter-path, --dtype
    add_distributed_args(parser)  # --pipeline (under mlx.launch)
    add_decoding_args(parser)  # server-wide defaults; requests override them
    add_template_arg(parser)  # --chat-template-config (mlx_lm.server's --chat-template-args), --chat-template
    add_server_args(parser)  # --host, --port, --max-batch, ...: ServerConfig's fields
    refuse(parser, SERVER_UNSUPPORTED)  # mlx_lm.server's flags with no like here: one line each says why
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def __getattr__(name):
    """``RefusionServer`` and ``Engine``, imported on first use: the HTTP stack and the engine (FastAPI,
    pydantic, uvicorn) took ~0.8 s of CPU to import before a flag was read, so a bad flag or ``--help``
    took 1.3 s, not 0.5. ``main`` reads them as this module's attributes (a test may replace them)."""
    if name == "RefusionServer":
        from .serve.http_server import RefusionServer

        return RefusionServer
    if name == "Engine":
        from .serve.core.engine import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _hang_up(signum, frame):
    """SIGHUP (the terminal that started the server closed) ends it as SIGTERM does: open streams end
    with an error event, waiting requests get 503, the prompt cache's files are whole."""
    signal.raise_signal(signal.SIGTERM)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("uvicorn.error").setLevel(max(logging.WARNING, logging.getLogger().level))

    # Metal: the weights stay resident while serving (restored after the engine stops); the handlers set here
    # (and by raise_interrupt_once) are the caller's again when main returns (a library user's, a test's)
    with handlers_kept(*STOP_SIGNALS), wired_limit():
        # uvicorn handles the signals while it serves, then raises them again: here, as KeyboardInterrupt
        signal.signal(signal.SIGTERM, raise_interrupt_once)  # a second Ctrl-C ends at once
        signal.signal(signal.SIGINT, raise_interrupt_once)
        if hasattr(signal, "SIGHUP"):
            handle_unless_ignored(signal.SIGHUP, _hang_up)  # nohup's SIG_IGN stays
        server = dist = None
        try:
            config = ServerConfig.from_args(args)  # made once; the HTTP side and the engine read it
            dist = join(args)  # under mlx.launch: rank 0 serves HTTP, the others follow its steps
            if dist is not None and config.prompt_cache_dir:
                raise RefusionError("--prompt-cache-dir is not supported under mlx.launch yet: each rank "
                                    "holds its own share of every cached entry")
            if dist is not None and not dist.leader:
                # Ctrl-C reaches every rank: the others stop when rank 0's last plan says so
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                logging.getLogger().setLevel(logging.WARNING)
                sys.modules[__name__].Engine(config, dist=dist).follow()
                return 0
            try:
                server = sys.modules[__name__].RefusionServer(config=config, dist=dist)
            except OSError as e:
                raise RefusionError(f"cannot listen on {config.host}:{config.port}: {e.strerror or e}") from None
            freeze_imports("mlx_lm.tokenizer_utils")  # the HTTP stack, and the tokenizer's transformers
            log.info("loading %s ...", config.model_id)
            server.load()
            log.info("serving %s at %s (Ctrl-C to stop; API docs at %s/docs)", config.model_id, server.url,
                     server.url[:-3])
            server.serve_forever()
        except RefusionError as e:
            say_error(e)
            return 1
        except KeyboardInterrupt:
            pass
        finally:
            if server is not None:
                server.close()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
