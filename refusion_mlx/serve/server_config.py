"""The server's settings: one :class:`ServerConfig`, made once and passed
whole to the HTTP side (:class:`~.http_server.RefusionServer`, its app) and
the engine.

From the command line, :func:`add_server_args` adds the server's own flags,
each named as its field (``--max-batch`` is ``max_batch``), and
:meth:`ServerConfig.from_args` makes the config of the parsed flags; the
decoding flags (``decode.params.FIELDS`` through ``cli.add_decoding_args``)
become its ``decoding``. From Python: ``ServerConfig(model=..., ...)``, or
those keywords to ``RefusionServer``. A bad value is one ``RefusionError``
when the config is made, before anything loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from ..cli import add_kv_args, byte_size, count, params_from_args, positive_int
from ..decode.kv_store import KVStorage
from ..decode.params import RefusionParams
from ..decode.stream import template_options
from ..errors import DecodeError, RefusionError

DEFAULT_MAX_BATCH = 8
DEFAULT_MAX_QUEUE = 256
# 2 GiB: about 14,500 cached tokens of ReFusion-8B in bfloat16 (144 KiB a token: 36 layers x 8 KV heads x
# 128 x 2 x 2 bytes; half as many in float32), e.g. eight 1,800-token conversations (one per batch row)
# and a system prompt, for an eighth more memory than the 16 GB of weights.
DEFAULT_PROMPT_CACHE_BYTES = 2 << 30
DEFAULT_WATCHDOG_SECONDS = 120.0  # a step running longer makes /health answer 503
DEFAULT_MAX_BODY = 1 << 20  # 1 MiB: a long chat history, not an upload
DEFAULT_MAX_STORED_RESPONSES = 1024  # the Responses API's, for previous_response_id (text, a few KiB each)
DEFAULT_MAX_STORED_RESPONSE_BYTES = 64 << 20  # and their JSON size, all together
DEFAULT_HEADER_TIMEOUT = 10.0  # seconds a connection may take to send a request's headers (then it is closed)
DEFAULT_BODY_TIMEOUT = 30.0  # seconds a request's body may take to arrive after its headers (then 408)
MAX_SECONDS = 1_000_000  # most seconds of --watchdog-seconds, --body-timeout, --header-timeout (11.6 days)
API_KEY_ENV = "REFUSION_MLX_API_KEY"  # the API key(s), comma-separated, when --api-key is not given
MAX_API_KEY_CHARS = 1024
API_KEY_RULE = f"an API key is 1 to {MAX_API_KEY_CHARS} printable ASCII characters without spaces"
# whose cached prompts a request may continue: the same (key, user); the same, and never without a user; anyone's
CACHE_SCOPES = ("user", "private", "shared")
# which calls a model may open under tool_choice "auto" are decoded under their tool's schema: every one, or
# only those of tools marked strict (where the call markers are tokens of their own: docs/constrained.md)
CALL_GRAMMARS = ("all", "strict")


@dataclass(frozen=True)
class ServerConfig:
    """Everything the server is set up with.

    ``decoding``: the settings a request starts from (its fields override
    them); its ``gen_length`` is the default ``max_tokens`` of chat and text
    completions. ``max_tokens_given``: whether that default was given (the
    flags: ``--max-tokens``; None: given when it is not ``RefusionParams``'
    own); only then does it cap the Responses API's answers too, whose
    omitted ``max_output_tokens`` is otherwise the context the prompt
    leaves, as OpenAI's is. ``model_id``
    (None: the model's path, or "tiny-refusion" for the bundled model) and
    ``prompt_cache_dir_bytes`` (None: ``prompt_cache_bytes``) are filled in
    when the config is made. ``max_kv_bytes`` None: derived from the
    device's memory when the model is loaded (``memory.default_max_kv_bytes``).
    ``kv_bits`` (4 or 8; None: the model's dtype) and ``kv_group_size``
    (None: 64): how every cache keeps its committed keys and values
    (``decode/kv_quant.py``), made once into ``storage`` (a
    ``decode.kv_store.KVStorage``, carried whole from here). A setting of
    the process, not of a request: the prompt cache, its files and memory
    admission then count one kind of row, and a request's ``kv_bits`` is
    refused.
    """

    model: Optional[str] = None
    adapter_path: Optional[str] = None
    dtype: Optional[str] = None
    model_id: Optional[str] = None
    host: str = "127.0.0.1"
    port: int = 8080
    decoding: RefusionParams = dataclasses.field(default_factory=RefusionParams)
    max_tokens_given: Optional[bool] = None
    max_batch: int = DEFAULT_MAX_BATCH
    max_queue: int = DEFAULT_MAX_QUEUE
    max_body_bytes: int = DEFAULT_MAX_BODY
    allowed_origins: Tuple[str, ...] = ()
    prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES
    prompt_cache_dir: Optional[str] = None
    prompt_cache_dir_bytes: Optional[int] = None
    max_kv_bytes: Optional[int] = None
    watchdog_seconds: float = DEFAULT_WATCHDOG_SECONDS
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES
    max_stored_response_bytes: int = DEFAULT_MAX_STORED_RESPONSE_BYTES
    kv_bits: Optional[int] = None
    kv_group_size: Optional[int] = None
    # who may use the server, and whose prompt cache a request shares (serve/edge/security.py, docs: Security)
    api_keys: Tuple[str, ...] = dataclasses.field(default=(), repr=False)
    allowed_hosts: Tuple[str, ...] = ()
    metrics_public: bool = False
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    max_connections: Optional[int] = None  # None: the descriptor limit less a reserve (edge/connections.py)
    prompt_cache_scope: str = "user"
    call_grammar: str = "all"
    chat_template_config: Optional[Dict[str, Any]] = None  # the chat template's variables, a request's over them
    chat_template: Optional[str] = None  # a template in place of the model's (checked as the model loads)
    storage: KVStorage = dataclasses.field(init=False, repr=False, compare=False)  # of kv_bits, kv_group_size

    def __post_init__(self):
        if isinstance(self.model, os.PathLike):
            object.__setattr__(self, "model", os.fspath(self.model))
        if self.model is not None and not isinstance(self.model, str):
            raise RefusionError(f"model must be a model folder's path or a hub repo id (None: the bundled demo), "
                                f"got {type(self.model).__name__}: the server loads the model itself")
        for name in ("max_batch", "max_queue", "max_body_bytes"):
            _check(name, getattr(self, name), 1)
        _check("port", self.port, 0, 65535)
        _check("prompt_cache_bytes", self.prompt_cache_bytes, 0)
        _check("max_stored_responses", self.max_stored_responses, 0)
        _check("max_stored_response_bytes", self.max_stored_response_bytes, 0)
        for name in ("prompt_cache_dir_bytes", "max_kv_bytes"):
            if getattr(self, name) is not None:
                _check(name, getattr(self, name), 0 if name == "prompt_cache_dir_bytes" else 1)
        for name in ("watchdog_seconds", "body_timeout", "header_timeout"):
            if not _is_seconds(getattr(self, name)):
                raise RefusionError(f"{name} must be a positive number of seconds under {MAX_SECONDS:,}, "
                                    f"got {getattr(self, name)!r}")
        self.decoding.layout()  # a bad default is a startup error, not a 400 on every request
        fill = object.__setattr__  # frozen: the derived values are set once, here
        if self.max_tokens_given is None:
            fill(self, "max_tokens_given", self.decoding.gen_length != RefusionParams.gen_length)
        fill(self, "storage", KVStorage.of(self.kv_bits, self.kv_group_size))  # the head dimension: at load
        fill(self, "allowed_origins", tuple(self.allowed_origins))
        fill(self, "allowed_hosts", tuple(self.allowed_hosts))
        fill(self, "api_keys", (self.api_keys,) if isinstance(self.api_keys, str) else tuple(self.api_keys))
        for key in self.api_keys:
            if not _is_api_key(key):
                raise RefusionError(API_KEY_RULE)
        if not isinstance(self.metrics_public, bool):
            raise RefusionError(f"metrics_public must be true or false, got {self.metrics_public!r}")
        if self.prompt_cache_scope not in CACHE_SCOPES:
            raise RefusionError(f"prompt_cache_scope must be one of {', '.join(CACHE_SCOPES)}, "
                                f"got {self.prompt_cache_scope!r}")
        if self.call_grammar not in CALL_GRAMMARS:
            raise RefusionError(f"call_grammar must be one of {', '.join(CALL_GRAMMARS)}, got {self.call_grammar!r}")
        if self.chat_template_config is not None:
            try:
                template_options(self.chat_template_config, "chat_template_config")
            except DecodeError as e:
                raise RefusionError(str(e)) from None
        if self.max_connections is not None:
            _check("max_connections", self.max_connections, 1)
        if self.model_id is None:
            fill(self, "model_id", str(self.model).rstrip("/") if self.model else "tiny-refusion")
        if self.prompt_cache_dir_bytes is None:
            fill(self, "prompt_cache_dir_bytes", self.prompt_cache_bytes)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerConfig":
        """The config of parsed flags: the model's (``cli.add_model_args``),
        the decoding flags, and :func:`add_server_args`' (each its field's name)."""
        names = [f.name for f in dataclasses.fields(cls)
                 if f.init and f.name not in ("decoding", "max_tokens_given", "api_keys")]
        keys = tuple(args.api_keys or ()) or tuple(
            k.strip() for k in os.environ.get(API_KEY_ENV, "").split(",") if k.strip())
        if not keys and API_KEY_ENV in os.environ:  # a secret that expanded to nothing: no open server by mistake
            raise RefusionError(f"${API_KEY_ENV} is set but holds no key (got {os.environ[API_KEY_ENV]!r}); "
                                "give a key, or unset it to serve without one")
        return cls(decoding=params_from_args(args), max_tokens_given=getattr(args, "gen_length", None) is not None,
                   api_keys=keys, **{n: getattr(args, n) for n in names})


def _check(name: str, value, lo: int, hi: Optional[int] = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        within = f"within {lo}..{hi}" if hi is not None else f">= {lo}"
        raise RefusionError(f"{name} must be an integer {within}, got {value!r}")


def _port(text: str) -> int:
    """argparse type of --port: 0 (a free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be within 0..65535, got {text!r}")
    return value


def _positive_size(text: str) -> int:
    value = byte_size(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes, got {text!r}")
    return value


def _is_seconds(value) -> bool:
    """Whether ``value`` is a duration setting's: a number of seconds above 0 and under :data:`MAX_SECONDS`."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < MAX_SECONDS


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not _is_seconds(value):  # as ServerConfig checks it
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds under {MAX_SECONDS:,}, "
                                         f"got {text!r}")
    return value


def _is_api_key(key) -> bool:
    """Whether ``key`` is an API key: :data:`API_KEY_RULE` (a header's value, compared as it is)."""
    return isinstance(key, str) and 0 < len(key) <= MAX_API_KEY_CHARS and all(33 <= ord(c) < 127 for c in key)


def _keys(text: str) -> List[str]:
    """argparse type of --api-key: one key or several, comma-separated (as the environment variable takes them)."""
    keys = [k.strip() for k in text.split(",") if k.strip()]
    if not keys or not all(map(_is_api_key, keys)):
        raise argparse.ArgumentTypeError(API_KEY_RULE)
    return keys


def _origins(text: str) -> Tuple[str, ...]:
    return tuple(o.strip() for o in text.split(",") if o.strip())


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The server's own flags, one per field of :class:`ServerConfig` (besides
    the model's and the decoding flags), each with the field's name."""
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=_port, default=8080, help="port (default 8080; 0 picks a free one)")
    parser.add_argument("--model-id", help="the model name reported by /v1/models (default: --model)")
    parser.add_argument("--max-batch", "--decode-concurrency", type=positive_int, default=DEFAULT_MAX_BATCH,
                        help=f"requests decoded together, one batched forward per step (default {DEFAULT_MAX_BATCH}; "
                             "--decode-concurrency: mlx_lm.server's name)")
    parser.add_argument("--max-active", dest="max_batch", type=positive_int, help=argparse.SUPPRESS)  # the old name
    parser.add_argument("--max-queue", type=positive_int, default=DEFAULT_MAX_QUEUE,
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
    add_kv_args(parser)  # --kv-bits, --kv-group-size: shared with generate, chat and bench
    parser.add_argument("--watchdog-seconds", type=_seconds, default=DEFAULT_WATCHDOG_SECONDS, metavar="SECONDS",
                        help="/health answers 503 while a step has run longer than this "
                             f"(default {DEFAULT_WATCHDOG_SECONDS:g})")
    parser.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY,
                        help=f"largest request body; larger gets 413 (default {DEFAULT_MAX_BODY})")
    parser.add_argument("--max-stored-responses", type=count, default=DEFAULT_MAX_STORED_RESPONSES,
                        help="responses of the Responses API kept in memory for previous_response_id and GET "
                             f"/v1/responses/ID, least recently used out; 0 keeps none "
                             f"(default {DEFAULT_MAX_STORED_RESPONSES})")
    parser.add_argument("--max-stored-response-bytes", type=byte_size, default=DEFAULT_MAX_STORED_RESPONSE_BYTES,
                        metavar="SIZE", help="and the JSON size they may hold all together, least recently used "
                                             f"out (default {DEFAULT_MAX_STORED_RESPONSE_BYTES >> 20}M)")
    parser.add_argument("--allowed-origins", type=_origins, default=(),
                        help="comma-separated origins whose pages may call the server (CORS), or '*' "
                             "(default: none, only the server's own page)")
    parser.add_argument("--allowed-hosts", type=_origins, default=(),
                        help="comma-separated host names the Host header may give besides the bound address "
                             "and localhost, or '*' for any (default: none; refuses DNS rebinding)")
    parser.add_argument("--api-key", dest="api_keys", action="extend", type=_keys, metavar="KEY",
                        help="require this key (Authorization: Bearer KEY or x-api-key: KEY) on every route but "
                             "/health and the web page's files; several: repeat the flag or separate them with "
                             f"commas, each its own prompt-cache partition (default: ${API_KEY_ENV}, comma-separated; "
                             "none)")
    parser.add_argument("--metrics-public", action="store_true",
                        help="serve /metrics without the API key (a scraper without it)")
    parser.add_argument("--body-timeout", type=_seconds, default=DEFAULT_BODY_TIMEOUT, metavar="SECONDS",
                        help="a request body must arrive within this long of its headers, else 408 "
                             f"(default {DEFAULT_BODY_TIMEOUT:g})")
    parser.add_argument("--header-timeout", type=_seconds, default=DEFAULT_HEADER_TIMEOUT, metavar="SECONDS",
                        help="a connection whose request headers have not all come within this long is closed "
                             f"(default {DEFAULT_HEADER_TIMEOUT:g})")
    parser.add_argument("--max-connections", type=positive_int, metavar="N",
                        help="open connections taken at once; past it the oldest one still waiting for a "
                             "request's headers (an idle keep-alive one too) is closed (default: the process's file-descriptor limit less 128, at most "
                             "4096)")
    parser.add_argument("--prompt-cache-scope", choices=CACHE_SCOPES, default="user",
                        help="whose cached prompts a request continues: user (default) those of its own API key "
                             "and `user` field; private: the same, and nothing for a request without a user; "
                             "shared: anyone's (cached_tokens then tells a client what others sent)")
    parser.add_argument("--call-grammar", choices=CALL_GRAMMARS, default="all",
                        help="under tool_choice auto, decode a call the model opens under its tool's parameters "
                             "schema, so it always parses: for every tool (all, default) or only tools marked "
                             "strict (strict); only where the model's call markers are tokens of their own "
                             "(beside a response_format, every tool's calls are in its grammar either way)")
