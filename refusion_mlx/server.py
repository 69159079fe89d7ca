"""``python -m refusion_mlx.server``: the OpenAI-compatible HTTP server
(:class:`refusion_mlx.serve.http_server.RefusionServer`) from the command line."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import List, Optional

from .cli import OneLineParser, add_decoding_args, add_model_args, byte_size, params_from_args
from .cli.launch import add_distributed_args, join
from .distributed.group import errors
from .errors import RefusionError
from .models.backend import wired_limit
from .serve.engine import (DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE, DEFAULT_PROMPT_CACHE_BYTES,
                           DEFAULT_WATCHDOG_SECONDS, Engine)
from .serve.http_server import DEFAULT_MAX_BODY, RefusionServer

__all__ = ["RefusionServer", "build_parser", "main"]

log = logging.getLogger("refusion_mlx.server")


def _int_flag(lo: int, hi: int, message: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(message.format(value))
        return value
    return parse


_port = _int_flag(0, 65535, "port must be within 0..65535, got {}")
_positive = _int_flag(1, 1 << 62, "must be >= 1, got {}")


def _positive_size(text: str) -> int:
    value = byte_size(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < 1e9:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="python -m refusion_mlx.server",
                           description="OpenAI-compatible HTTP server for a ReFusion model.")
    add_model_args(parser)  # --model, --adapter-path, --dtype
    add_distributed_args(parser)  # --pipeline (under mlx.launch)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=_port, default=8080, help="port (default 8080; 0 picks a free one)")
    parser.add_argument("--model-id", help="the model name reported by /v1/models (default: --model)")
    add_decoding_args(parser)  # server-wide defaults; requests override them
    parser.add_argument("--max-batch", type=_positive, default=DEFAULT_MAX_BATCH,
                        help=f"requests decoded together, one batched forward per step (default {DEFAULT_MAX_BATCH})")
    parser.add_argument("--max-active", dest="max_batch", type=_positive, help=argparse.SUPPRESS)  # the old name
    parser.add_argument("--max-queue", type=_positive, default=DEFAULT_MAX_QUEUE,
                        help=f"requests waiting beyond those; more get 503 (default {DEFAULT_MAX_QUEUE})")
    parser.add_argument("--prompt-cache-bytes", type=byte_size, default=DEFAULT_PROMPT_CACHE_BYTES,
                        help="memory for the KV caches of recent conversations and shared prompts, reused by "
                             "requests that continue them; least recently used first out; 0 turns it off "
                             "(default 2G: ~14k tokens of ReFusion-8B in bfloat16, e.g. one 1.8k-token "
                             "conversation per batch row)")
    parser.add_argument("--prompt-cache-dir", metavar="DIR",
                        help="keep the prompt cache's entries in DIR too (safetensors files, reloaded at start-up, "
                             "so conversations survive a restart; default: memory only)")
    parser.add_argument("--prompt-cache-dir-bytes", type=byte_size, metavar="SIZE",
                        help="byte budget of --prompt-cache-dir; least recently used files go first "
                             "(default: --prompt-cache-bytes)")
    parser.add_argument("--max-kv-bytes", type=_positive_size, metavar="SIZE",
                        help="KV memory the requests in the batch may reserve (prompt + max_tokens each); "
                             "others wait, one that can never fit gets 400 (default: 90%% of the device's "
                             "memory - Metal's recommended working set, else physical memory - less the "
                             "weights and --prompt-cache-bytes)")
    parser.add_argument("--watchdog-seconds", type=_seconds, default=DEFAULT_WATCHDOG_SECONDS, metavar="SECONDS",
                        help="/health answers 503 while a step has run longer than this "
                             f"(default {DEFAULT_WATCHDOG_SECONDS:g})")
    parser.add_argument("--max-body-bytes", type=_positive, default=DEFAULT_MAX_BODY,
                        help=f"largest request body; larger gets 413 (default {DEFAULT_MAX_BODY})")
    parser.add_argument("--allowed-origins", default="",
                        help="comma-separated origins allowed by CORS, or '*' (default: none)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def _raise_interrupt(signum, frame):
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C ends at once
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise KeyboardInterrupt


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("uvicorn.error").setLevel(max(logging.WARNING, logging.getLogger().level))

    # uvicorn handles the signals while it serves, then raises them again: here, as KeyboardInterrupt
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)
    with wired_limit():  # Metal: the weights stay resident while serving (restored after the engine stops)
        server = dist = None
        try:
            params = params_from_args(args)
            dist = join(args)  # under mlx.launch: rank 0 serves HTTP, the others follow its steps
            if dist is not None and args.prompt_cache_dir:
                raise RefusionError("--prompt-cache-dir is not supported under mlx.launch yet: each rank "
                                    "holds its own share of every cached entry")
            if dist is not None and not dist.leader:
                # Ctrl-C reaches every rank: the others stop when rank 0's last plan says so
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                logging.getLogger().setLevel(logging.WARNING)
                Engine(args.model, dtype=args.dtype, max_batch=args.max_batch, max_queue=args.max_queue,
                       prompt_cache_bytes=args.prompt_cache_bytes, adapter_path=args.adapter_path,
                       max_kv_bytes=args.max_kv_bytes, dist=dist).follow()
                return 0
            origins = [o.strip() for o in args.allowed_origins.split(",") if o.strip()]
            try:
                server = RefusionServer(args.model, host=args.host, port=args.port, dtype=args.dtype, params=params,
                                        default_max_tokens=params.gen_length, model_id=args.model_id,
                                        max_batch=args.max_batch, max_queue=args.max_queue,
                                        max_body_bytes=args.max_body_bytes, allowed_origins=origins,
                                        prompt_cache_bytes=args.prompt_cache_bytes, adapter_path=args.adapter_path,
                                        max_kv_bytes=args.max_kv_bytes, watchdog_seconds=args.watchdog_seconds,
                                        prompt_cache_dir=args.prompt_cache_dir,
                                        prompt_cache_dir_bytes=args.prompt_cache_dir_bytes, dist=dist)
            except OSError as e:
                raise RefusionError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
            if server.host not in ("127.0.0.1", "::1", "localhost"):
                log.warning("listening on %s: other machines can reach this server", server.host)
            log.info("loading %s ...", server.model_id)
            server.load()
            log.info("serving %s at %s (Ctrl-C to stop; API docs at %s/docs)", server.model_id, server.url,
                     server.url[:-3])
            server.serve_forever()
        except RefusionError as e:
            rank = "" if dist is None else f"rank {dist.rank}: "
            print(f"error: {rank}{e}", file=errors())
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
