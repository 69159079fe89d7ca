"""OpenAI-compatible HTTP server for ReFusion: ``python -m refusion_mlx.server``.

Local chat apps talk to a model through ``/v1/chat/completions`` on
localhost. ReFusion finishes slots out of order, so a stream here only ever
carries text that is *final* and in answer order (what ``stream_generate``
releases), cut at ``max_tokens`` and at stop strings.

Threads: the HTTP threads (one per connection) only parse, validate and
tokenize (with a tokenizer of their own, behind a lock) and write bytes. One
engine thread loads the model and runs every generation, so MLX is never used
from two threads at once. It interleaves up to ``--max-active`` generations
one decoding step at a time (each has its own committed cache; the model is
shared and stateless), so a long answer does not hold up a short one; the
other requests wait in a bounded FIFO queue. A client that goes away has its
generation closed at the next step.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import json
import logging
import math
import queue
import select
import signal
import socket
import sys
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple
from urllib.parse import urlsplit

from ..errors import RefusionError

log = logging.getLogger("refusion_mlx.server")

DEFAULT_MAX_TOKENS = 512
DEFAULT_MAX_BODY = 1 << 20  # 1 MiB: a long chat history, not an upload
DEFAULT_MAX_ACTIVE = 4
DEFAULT_MAX_QUEUE = 256
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOP = 16
EXTRA_INT_FIELDS = ("slot_size", "block_length", "serial_num_blocks")
EXTRA_FLOAT_FIELDS = ("slot_threshold", "token_threshold")


# --------------------------------------------------------------------------
# Errors in OpenAI's shape


class APIError(Exception):
    """An error answered as ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, type: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


def bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# --------------------------------------------------------------------------
# Request validation (HTTP threads; plain Python, no MLX)


@dataclasses.dataclass
class Request:
    """A validated completion request, ready for the engine."""

    kind: str  # "chat" or "text"
    prompt_ids: List[int]
    params: Any  # RefusionParams
    max_tokens: int
    stop: List[str]
    stream: bool
    include_usage: bool


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _get_int(body: dict, name: str, lo: int, hi: int) -> Optional[int]:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise bad(f"{name} must be an integer, got {json.dumps(value)[:40]}", name, "invalid_type")
    if not lo <= value <= hi:
        raise bad(f"{name} must be between {lo} and {hi}, got {value}", name, "invalid_value")
    return value


def _get_number(body: dict, name: str, lo: float, hi: float) -> Optional[float]:
    value = body.get(name)
    if value is None:
        return None
    if not _is_number(value):
        raise bad(f"{name} must be a number, got {json.dumps(value)[:40]}", name, "invalid_type")
    if not lo <= value <= hi:
        raise bad(f"{name} must be between {lo} and {hi}, got {value}", name, "invalid_value")
    return float(value)


def _get_bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"{name} must be true or false, got {json.dumps(value)[:40]}", name, "invalid_type")
    return value


def parse_stop(value) -> List[str]:
    """``stop``: null, a string or a list of up to MAX_STOP non-empty strings."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad("stop must be a string or a list of strings", "stop", "invalid_type")
    if len(items) > MAX_STOP:
        raise bad(f"stop takes at most {MAX_STOP} strings, got {len(items)}", "stop", "invalid_value")
    if any(not s for s in items):
        raise bad("stop strings must not be empty", "stop", "invalid_value")
    return list(items)


def message_text(content, index: int) -> str:
    """A message's text: a string, null, or a list of ``{"type": "text"}`` parts."""
    param = f"messages[{index}].content"
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{param}: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported",
                          param, "invalid_type")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"{param} must be a string or a list of text parts", param, "invalid_type")


def parse_messages(messages) -> List[Dict[str, str]]:
    """Chat messages with known roles and text content (developer -> system)."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages",
                  "invalid_type" if not isinstance(messages, list) else "invalid_value")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object with role and content", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {json.dumps(role)[:40]}",
                      f"messages[{i}].role", "invalid_value")
        out.append({"role": ROLES[role], "content": message_text(m.get("content"), i)})
    return out


def parse_prompt(prompt, vocab_size: int):
    """``prompt`` of /v1/completions: a string or a list of token ids (or one of either in a list)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt must not be empty", "prompt", "invalid_value")
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        bad_ids = [t for t in prompt if not 0 <= t < vocab_size]
        if bad_ids:
            raise bad(f"prompt token id {bad_ids[0]} is outside the vocabulary of {vocab_size}",
                      "prompt", "invalid_value")
        return [int(t) for t in prompt]
    raise bad("prompt must be a non-empty string or list of token ids (one prompt per request)",
              "prompt", "invalid_type")


def reject_unsupported(body: dict) -> None:
    """Fields whose meaning this server cannot honour are refused, not ignored."""
    n = body.get("n")
    if n is not None and n != 1:
        raise bad("only n = 1 is supported", "n", "unsupported_value")
    for name in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions", "best_of"):
        harmless = (None, False, 0, [], "") + ((1,) if name == "best_of" else ())
        if body.get(name) not in harmless:  # the default values clients send anyway pass
            raise bad(f"{name} is not supported by this server", name, "unsupported_parameter")


def decoding_params(body: dict, defaults, max_tokens: int, context: int):
    """RefusionParams for a request: server defaults, then the request's extra fields."""
    from ..decode.params import RefusionParams

    values = dataclasses.asdict(defaults)
    values["gen_length"] = max_tokens
    for name in EXTRA_INT_FIELDS:
        value = _get_int(body, name, 1, context)
        if value is not None:
            values[name] = value
            other = "serial_num_blocks" if name == "block_length" else "block_length"
            if name != "slot_size" and body.get(other) is None:
                values[other] = None
    for name in EXTRA_FLOAT_FIELDS:
        value = _get_number(body, name, 0.0, 1.0)
        if value is not None:
            values[name] = value
    temperature = _get_number(body, "temperature", 0.0, 2.0)
    if temperature is not None:
        values["temperature"] = temperature
    seed = _get_int(body, "seed", 0, 2 ** 64 - 1)
    if seed is not None:
        values["seed"] = seed
    params = RefusionParams(**values)
    try:
        params.layout()
    except RefusionError as e:
        raise bad(str(e), None, "invalid_decoding_parameters") from None
    return params


def parse_request(body: Any, kind: str, tokenize: Callable[[Any], List[int]], *, defaults,
                  default_max_tokens: int, context: int, vocab_size: int) -> Request:
    """Validate a /v1/chat/completions (kind "chat") or /v1/completions ("text") body.

    ``tokenize`` turns the checked messages (chat) or prompt (text) into ids.
    Every problem is an APIError 400; nothing reaches the engine unchecked.
    """
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model", "invalid_type")
    reject_unsupported(body)
    stream = _get_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options must be an object", "stream_options", "invalid_type")
    include_usage = _get_bool(options or {}, "include_usage", False)
    stop = parse_stop(body.get("stop"))
    _get_number(body, "top_p", 0.0, 1.0)  # checked; ReFusion's planning sampler has no top-p
    for name in ("presence_penalty", "frequency_penalty"):
        _get_number(body, name, -2.0, 2.0)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _get_int(body, name, 1, context)
    if kind == "chat":
        source = parse_messages(body.get("messages"))
    else:
        if "prompt" not in body:
            raise bad("prompt is required", "prompt", "missing_required_parameter")
        source = parse_prompt(body["prompt"], vocab_size)
    try:
        ids = tokenize(source)
    except APIError:
        raise
    except Exception as e:  # a chat template that refuses the conversation
        detail = " ".join(str(e).split())[:200] or type(e).__name__
        raise bad(f"cannot build the prompt: {detail}", "messages" if kind == "chat" else "prompt") from None
    param = "messages" if kind == "chat" else "prompt"
    if not ids:
        raise bad("the prompt is empty after tokenization", param, "invalid_value")
    room = context - len(ids)
    if room < 1:
        raise bad(f"the prompt is {len(ids)} tokens; the model's context is {context}", param,
                  "context_length_exceeded")
    slot = _get_int(body, "slot_size", 1, context) or defaults.slot_size
    if max_tokens is None:  # as OpenAI: the default shrinks to what the context leaves
        max_tokens = min(default_max_tokens, (room // slot) * slot)
        if max_tokens < 1:
            raise bad(f"the prompt is {len(ids)} tokens; the model's context of {context} leaves "
                      f"no whole slot of {slot} for an answer", param, "context_length_exceeded")
    params = decoding_params(body, defaults, max_tokens, context)
    budget = params.layout().gen_length
    if len(ids) + budget > context:
        raise bad(f"the prompt ({len(ids)} tokens) + max_tokens ({max_tokens}, {budget} in whole "
                  f"slots) exceeds the model's context of {context}", name, "context_length_exceeded")
    return Request(kind, list(ids), params, max_tokens, stop, stream, include_usage)


# --------------------------------------------------------------------------
# In-order text: max_tokens and stop strings


class TextShaper:
    """Applies ``max_tokens`` and stop strings to the in-order answer.

    The decoder's budget is whole slots, so the answer can run past
    ``max_tokens``: it is cut there (finish "length"). Text that could be the
    start of a stop string is held back until it is known not to be one.
    """

    def __init__(self, decode: Callable[[List[int]], str], max_tokens: int, stop: Sequence[str],
                 eos_id: int):
        self.decode = decode
        self.max_tokens = max_tokens
        self.stop = list(stop)
        self.eos_id = eos_id
        self.tokens: List[int] = []
        self.text = ""  # all final text received (after the max_tokens cut)
        self.sent = 0  # characters of self.text already released

    def feed(self, text: str, tokens: Sequence[int], final: bool) -> Tuple[str, Optional[str]]:
        """Take a response's new text and ids; return (text to send, finish reason or None)."""
        reason = None
        content = [t for t in tokens if t != self.eos_id]
        room = self.max_tokens - len(self.tokens)
        if len(content) > room:
            self.tokens += content[:room]
            full = self.decode(self.tokens)
            text = full[len(self.text):] if full.startswith(self.text) else ""
            reason = "length"
        else:
            self.tokens += content
        self.text += text
        hit = self._first_stop()
        if hit is not None:
            return self._release(hit), "stop"
        if reason or final:
            return self._release(len(self.text)), reason
        return self._release(len(self.text) - self._held()), None

    def _first_stop(self) -> Optional[int]:
        start = max(0, self.sent - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _held(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        tail = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), tail, -1):
                if self.text.endswith(s[:k]):
                    tail = k
                    break
        return tail

    def _release(self, end: int) -> str:
        end = max(end, self.sent)
        piece, self.sent = self.text[self.sent:end], end
        return piece


# --------------------------------------------------------------------------
# The engine: the one thread that uses MLX


class Job:
    """A request in flight: the engine posts events, the HTTP thread reads them.

    Events: ("text", str), ("done", dict), ("error", APIError).
    """

    def __init__(self, request: Request):
        self.request = request
        self.events: "queue.Queue[tuple]" = queue.Queue()
        self.cancelled = threading.Event()
        self.created = time.perf_counter()
        self.started: Optional[float] = None

    def cancel(self) -> None:
        self.cancelled.set()


class Engine:
    """Loads the model and runs every generation on one thread."""

    def __init__(self, model_path: Optional[str] = None, dtype: Optional[str] = None,
                 max_active: int = DEFAULT_MAX_ACTIVE, max_queue: int = DEFAULT_MAX_QUEUE):
        self.model_path = model_path
        self.dtype = dtype
        self.max_active = max_active
        self.jobs: "queue.Queue[Optional[Job]]" = queue.Queue(maxsize=max_queue)
        self.model = None
        self.args = None
        self.tokenizer = None  # the engine thread's
        self.http_tokenizer = None  # the HTTP threads', behind tokenizer_lock
        self.tokenizer_lock = threading.Lock()
        self.counts = collections.Counter()
        self.active = 0
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="refusion-engine", daemon=True)

    # -- life cycle --------------------------------------------------------

    def start(self) -> None:
        """Load the model on the engine thread; raise its RefusionError if it fails."""
        self._thread.start()
        while not self._ready.wait(0.1):
            pass
        if self._error is not None:
            raise self._error

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the step in progress, answer every open request 503, end the thread."""
        self._stopping.set()
        try:
            self.jobs.put_nowait(None)  # wake the thread
        except queue.Full:
            pass
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        if self._stopping.is_set():
            raise APIError(503, "the server is shutting down", code="shutting_down")
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise APIError(503, f"the server is busy ({self.jobs.maxsize} requests waiting); retry later",
                           code="server_busy") from None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def snapshot(self) -> Dict[str, int]:
        return {"active": self.active, "queued": self.jobs.qsize(), **{k: self.counts[k] for k in
                ("completed", "cancelled", "failed")}}

    # -- the thread --------------------------------------------------------

    def _load(self) -> None:
        from ..models.loading import load, load_tokenizer

        self.model, self.tokenizer = load(self.model_path, dtype=self.dtype)
        self.args = self.model.args  # plain config, read by the HTTP threads
        self.http_tokenizer = load_tokenizer(self.model.model_path)

    def _run(self) -> None:
        running: "collections.deque[_Generation]" = collections.deque()
        try:
            self._load()
        except BaseException as e:  # reported by start() on the main thread
            self._error = e if isinstance(e, RefusionError) else RefusionError(
                f"cannot load the model: {type(e).__name__}: {e}")
            self._release(running)
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve(running)
        finally:
            self._release(running)
            self._refuse_waiting()

    def _serve(self, running) -> None:
        """Round robin: one step of each running generation in turn."""
        while not self._stopping.is_set():
            self._admit(running, block=not running)
            if running:
                gen = running.popleft()
                if gen.step():
                    running.append(gen)
                self.active = len(running)
        for gen in running:
            gen.abort(APIError(503, "the server is shutting down", code="shutting_down"))

    def _refuse_waiting(self) -> None:
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.events.put(("error", APIError(503, "the server is shutting down", code="shutting_down")))

    def _release(self, running) -> None:
        """Free this thread's arrays and MLX streams before it ends.

        MLX gives each thread its own stream (and a worker thread for it on
        the CPU); left for interpreter exit, they can abort the process
        ("terminate called without an active exception").
        """
        import mlx.core as mx

        running.clear()
        self.model = self.tokenizer = None
        self.active = 0
        gc.collect()
        try:
            mx.synchronize()
            mx.clear_streams()
        except Exception:  # pragma: no cover - older MLX without clear_streams
            pass

    def _admit(self, running, block: bool) -> None:
        """Move queued jobs into the running set, up to max_active."""
        while len(running) < self.max_active:
            try:
                job = self.jobs.get(timeout=0.25) if block else self.jobs.get_nowait()
            except queue.Empty:
                return
            block = False
            if job is None:  # stop()'s wake-up call
                return
            if job.cancelled.is_set():  # its client left while it waited
                self.counts["cancelled"] += 1
                continue
            running.append(_Generation(self, job))
            self.active = len(running)


class _Generation:
    """One request's decoding, advanced a step at a time by the engine thread."""

    def __init__(self, engine: Engine, job: Job):
        from ..decode.generate import stream_generate

        self.engine = engine
        self.job = job
        tok = engine.tokenizer
        req = job.request
        self.iterator = stream_generate(engine.model, tok, req.prompt_ids, params=req.params)
        vocab = len(tok)
        eos = tok.eos_token_id

        def decode(ids: List[int]) -> str:
            return tok.decode([t for t in ids if t < vocab and t != eos], skip_special_tokens=True)

        self.shaper = TextShaper(decode, req.max_tokens, req.stop, eos)

    def step(self) -> bool:
        """Run one decoding step; post its text. False once the request is over."""
        job = self.job
        if job.cancelled.is_set():
            self._close("cancelled")
            return False
        if job.started is None:
            job.started = time.perf_counter()
        try:
            r = next(self.iterator)
        except StopIteration:  # pragma: no cover - the last response carries finish_reason
            return self._finish("stop", None)
        except RefusionError as e:
            return self.abort(APIError(400, str(e), code="invalid_request"))
        except Exception as e:  # a bug: the request fails, the server stays up
            log.exception("generation failed")
            return self.abort(APIError(500, f"generation failed: {type(e).__name__}: {e}"))
        text, reason = self.shaper.feed(r.text, r.tokens, final=r.finish_reason is not None)
        if text:
            job.events.put(("text", text))
        if reason is None and r.finish_reason is not None:
            reason = r.finish_reason
        if reason is not None:
            return self._finish(reason, r.stats)
        return True

    def _finish(self, reason: str, stats) -> bool:
        prompt = len(self.job.request.prompt_ids)
        completion = len(self.shaper.tokens)
        self.job.events.put(("done", {
            "finish_reason": reason,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion},
            "stats": stats.as_dict() if stats is not None else None,
        }))
        self._close("completed")
        return False

    def abort(self, error: APIError) -> bool:
        self.job.events.put(("error", error))
        self._close("failed")
        return False

    def _close(self, outcome: str) -> None:
        self.engine.counts[outcome] += 1
        self.iterator.close()  # frees the decoder and its cache now


# --------------------------------------------------------------------------
# HTTP


class ClientGone(Exception):
    """The client closed its connection."""


class Handler(BaseHTTPRequestHandler):
    """Routes, body limits, JSON in, JSON or server-sent events out."""

    server_version = "refusion-mlx"
    protocol_version = "HTTP/1.1"
    timeout = 60  # seconds a socket read or write may stall (slow or vanished clients)
    server: "APIServer"

    ROUTES = {
        "/v1/models": "GET", "/models": "GET",
        "/v1/chat/completions": "POST", "/chat/completions": "POST",
        "/v1/completions": "POST", "/completions": "POST",
        "/health": "GET", "/v1/health": "GET",
    }

    # -- dispatch ----------------------------------------------------------

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def do_PATCH(self):
        self._dispatch("PATCH")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_OPTIONS(self):
        """CORS preflight, answered only for origins the server was told to allow."""
        self.send_response(204)
        self._cors_headers()
        self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", "Authorization, Content-Type")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _dispatch(self, method: str) -> None:
        self._chunked = False
        self._status = None
        self._note = ""
        t0 = time.perf_counter()
        path = urlsplit(self.path).path.rstrip("/") or "/"
        try:
            self._route(method, path)
        except APIError as e:
            self._send_error(e)
        except (ClientGone, BrokenPipeError, ConnectionResetError, socket.timeout):
            self.close_connection = True
            self._note = "client went away"
        finally:
            log.info("%s %s %s %.3fs %s", method, path, self._status or "-", time.perf_counter() - t0,
                     self._note)

    def _route(self, method: str, path: str) -> None:
        if path.startswith("/v1/models/") and method == "GET":
            return self._model(path[len("/v1/models/"):])
        allowed = self.ROUTES.get(path)
        if allowed is None:
            raise APIError(404, f"no route for {method} {path}", code="not_found")
        if method != allowed:
            raise APIError(405, f"{path} takes {allowed}, not {method}", code="method_not_allowed")
        if path.endswith("models"):
            return self._models()
        if path.endswith("health"):
            return self._send_json(200, {"status": "ok", "model": self.server.model_id,
                                         **self.server.engine.snapshot()})
        self._completion("chat" if path.endswith("chat/completions") else "text")

    def send_error(self, code, message=None, explain=None):
        """The stdlib's own errors (bad request line, unknown method...) as JSON too."""
        self.close_connection = True
        self._status = None
        if self.request_version == "HTTP/0.9":  # garbage parsed as 0.9: answer with a status line
            self.request_version = "HTTP/1.0"
        if code == 501:  # a method no route takes
            code, message = 405, f"method {self.command} is not allowed"
        error = APIError(int(code), message or HTTPStatus(code).phrase, code=HTTPStatus(code).name.lower())
        self._send_error(error)

    # -- GET ---------------------------------------------------------------

    def _model_card(self) -> dict:
        return {"id": self.server.model_id, "object": "model", "created": self.server.created,
                "owned_by": "refusion-mlx"}

    def _models(self) -> None:
        self._send_json(200, {"object": "list", "data": [self._model_card()]})

    def _model(self, name: str) -> None:
        if name != self.server.model_id:
            raise APIError(404, f"model {name!r} is not served here (this server serves "
                                f"{self.server.model_id!r})", "model", "model_not_found")
        self._send_json(200, self._model_card())

    # -- POST --------------------------------------------------------------

    def _read_json(self) -> Any:
        """The request body as JSON, within the size limit."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            raise APIError(411, "send the body with a Content-Length header", code="length_required")
        length = self.headers.get("Content-Length")
        if length is None:
            self.close_connection = True
            raise APIError(411, "a Content-Length header is required", code="length_required")
        try:
            n = int(length)
            if n < 0:
                raise ValueError
        except ValueError:
            self.close_connection = True
            raise APIError(400, f"invalid Content-Length {length[:20]!r}", code="invalid_header") from None
        limit = self.server.max_body_bytes
        if n > limit:
            self.close_connection = True
            self._drain(n)  # a client still sending would see a reset instead of the 413
            raise APIError(413, f"the request body is {n} bytes; the limit is {limit}",
                           code="request_too_large")
        raw = self.rfile.read(n)
        if len(raw) < n:
            raise ClientGone()
        try:
            return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None

    def _drain(self, n: int, cap: int = 64 << 20, seconds: float = 5.0) -> None:
        """Read and discard up to ``n`` body bytes (bounded in size and time)."""
        deadline = time.monotonic() + seconds
        left = min(n, cap)
        try:
            while left > 0 and time.monotonic() < deadline:
                data = self.rfile.read1(min(left, 1 << 16))
                if not data:
                    return
                left -= len(data)
        except (OSError, ValueError):
            pass

    def _tokenize(self, kind: str) -> Callable[[Any], List[int]]:
        from ..decode.generate import chat_prompt

        engine = self.server.engine

        def tokenize(source) -> List[int]:
            if isinstance(source, list) and kind == "text":
                return source
            with engine.tokenizer_lock:
                if kind == "chat":
                    return chat_prompt(engine.http_tokenizer, source)
                return list(engine.http_tokenizer.encode(source))

        return tokenize

    def _completion(self, kind: str) -> None:
        body = self._read_json()
        engine = self.server.engine
        args = engine.args
        request = parse_request(body, kind, self._tokenize(kind), defaults=self.server.defaults,
                                default_max_tokens=self.server.default_max_tokens,
                                context=args.max_position_embeddings, vocab_size=args.vocab_size)
        job = Job(request)
        engine.submit(job)
        try:
            self._respond(job, kind)
        finally:
            job.cancel()  # no-op when it finished; frees the generation when the client left

    def _respond(self, job: Job, kind: str) -> None:
        events = self._events(job)
        first = next(events)
        if first[0] == "error":
            raise first[1]
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        if job.request.stream:
            self._stream(job, kind, rid, first, events)
        else:
            self._whole(job, kind, rid, first, events)

    def _events(self, job: Job) -> Iterator[tuple]:
        """The job's events until done or error; a client that left cancels the job."""
        while True:
            try:
                event = job.events.get(timeout=0.1)
            except queue.Empty:
                if not self.server.engine.alive:
                    raise APIError(503, "the model engine has stopped", code="engine_stopped") from None
                if self._client_gone():
                    job.cancel()
                    raise ClientGone() from None
                continue
            yield event
            if event[0] != "text":
                return

    def _client_gone(self) -> bool:
        """True when the peer has closed (readable socket, nothing to read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _whole(self, job, kind, rid, first, events) -> None:
        text, done = [], None
        for event in _chain(first, events):
            if event[0] == "text":
                text.append(event[1])
            elif event[0] == "error":
                raise event[1]
            else:
                done = event[1]
        content = "".join(text)
        choice = {"index": 0, "finish_reason": done["finish_reason"], "logprobs": None}
        if kind == "chat":
            choice["message"] = {"role": "assistant", "content": content}
        else:
            choice["text"] = content
        self._note = _note(done)
        self._send_json(200, {**self._envelope(kind, rid, False), "choices": [choice],
                              "usage": done["usage"]})

    def _stream(self, job, kind, rid, first, events) -> None:
        """Server-sent events: one chunk per piece of final text, in order."""
        head = self._envelope(kind, rid, True)

        def chunk(text: Optional[str], finish: Optional[str], role: bool = False) -> dict:
            choice: Dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
            if kind == "chat":
                delta: Dict[str, Any] = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                choice["delta"] = delta
            else:
                choice["text"] = text or ""
            return {**head, "choices": [choice]}

        self._start_stream()
        if kind == "chat":
            self._sse(chunk("", None, role=True))
        for event in _chain(first, events):
            if event[0] == "text":
                self._sse(chunk(event[1], None))
            elif event[0] == "error":
                self._sse(event[1].body())
                self._note = f"error {event[1].message}"
                break
            else:
                done = event[1]
                last = chunk(None if kind == "chat" else "", done["finish_reason"])
                if job.request.include_usage:  # OpenAI's shape: usage in a chunk of its own
                    self._sse(last)
                    self._sse({**head, "choices": [], "usage": done["usage"]})
                else:
                    self._sse({**last, "usage": done["usage"]})
                self._note = _note(done)
        self._sse("[DONE]")
        self._end_stream()

    def _envelope(self, kind: str, rid: str, stream: bool) -> dict:
        obj = "text_completion" if kind == "text" else ("chat.completion.chunk" if stream else "chat.completion")
        return {"id": rid, "object": obj, "created": int(time.time()), "model": self.server.model_id,
                "system_fingerprint": self.server.fingerprint}

    # -- writing -----------------------------------------------------------

    def _cors_headers(self) -> None:
        origins = self.server.allowed_origins
        headers = getattr(self, "headers", None)
        origin = headers.get("Origin") if headers is not None else None
        if "*" in origins:
            self.send_header("Access-Control-Allow-Origin", "*")
        elif origin and origin in origins:
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")

    def _send_json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 503:
            self.send_header("Retry-After", "1")
        if self.close_connection:
            self.send_header("Connection", "close")
        self._cors_headers()
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _send_error(self, error: APIError) -> None:
        self._note = error.message
        try:
            self._send_json(error.status, error.body())
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            self.close_connection = True

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        if self.request_version == "HTTP/1.1":
            self.send_header("Transfer-Encoding", "chunked")
            self._chunked = True
        else:
            self.send_header("Connection", "close")
            self.close_connection = True
        self._cors_headers()
        self.end_headers()

    def _sse(self, obj) -> None:
        data = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
        if self._chunked:
            data = b"%X\r\n%s\r\n" % (len(data), data)
        self.wfile.write(data)

    def _end_stream(self) -> None:
        if self._chunked:
            self.wfile.write(b"0\r\n\r\n")

    # -- logging -----------------------------------------------------------

    def log_request(self, code="-", size="-"):
        self._status = getattr(code, "value", code)

    def log_message(self, format, *args):
        log.debug("%s - %s", self.address_string(), format % args)


def _chain(first, rest) -> Iterator[tuple]:
    yield first
    yield from rest


def _note(done: dict) -> str:
    """The log line's summary of a finished request."""
    u, stats = done["usage"], done["stats"]
    note = f"prompt={u['prompt_tokens']} completion={u['completion_tokens']} finish={done['finish_reason']}"
    if stats:
        note += f" steps={stats['steps']} tokens/forward={stats['tokens_per_forward']:.2f}"
    return note


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


class APIServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with the engine and the server's settings attached."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 128  # 20+ clients connecting at once must not overflow the backlog

    def __init__(self, address, engine: Engine, *, model_id: str, defaults, default_max_tokens: int,
                 max_body_bytes: int, allowed_origins: Sequence[str]):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, Handler)
        self.engine = engine
        self.model_id = model_id
        self.defaults = defaults
        self.default_max_tokens = default_max_tokens
        self.max_body_bytes = max_body_bytes
        self.allowed_origins = list(allowed_origins)
        self.created = int(time.time())
        self.fingerprint = f"refusion-mlx-{uuid.uuid4().hex[:8]}"

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], (ConnectionError, socket.timeout)):  # the client went away
            log.debug("connection from %s closed by the client", client_address)
            return
        log.exception("unhandled error while serving %s", client_address)


# --------------------------------------------------------------------------
# Python API


class RefusionServer:
    """An OpenAI-compatible server for one ReFusion model.

    Binds at construction (so a taken port fails before the model loads);
    ``start()`` loads the model and serves on a background thread (tests,
    embedding), ``serve_forever()`` serves on the calling thread (the CLI).
    """

    def __init__(self, model: Optional[str] = None, *, host: str = "127.0.0.1", port: int = 8080,
                 dtype: Optional[str] = None, params=None, default_max_tokens: Optional[int] = None,
                 model_id: Optional[str] = None, max_active: int = DEFAULT_MAX_ACTIVE,
                 max_queue: int = DEFAULT_MAX_QUEUE, max_body_bytes: int = DEFAULT_MAX_BODY,
                 allowed_origins: Sequence[str] = ()):
        from ..decode.params import RefusionParams

        params = params or RefusionParams()
        params.layout()  # a bad default is a startup error, not a 400 on every request
        self.engine = Engine(model, dtype=dtype, max_active=max_active, max_queue=max_queue)
        self.httpd = APIServer((host, port), self.engine, model_id=model_id or default_model_id(model),
                               defaults=params, default_max_tokens=default_max_tokens or params.gen_length,
                               max_body_bytes=max_body_bytes, allowed_origins=allowed_origins)
        self._thread: Optional[threading.Thread] = None

    @property
    def host(self) -> str:
        return self.httpd.server_address[0]

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def load(self) -> None:
        self.engine.start()

    def start(self) -> "RefusionServer":
        self.load()
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="refusion-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.25)

    def close(self) -> None:
        """Stop accepting, end open requests (503), stop the engine thread."""
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(5)
        self.httpd.server_close()
        self.engine.stop()

    def __enter__(self) -> "RefusionServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def default_model_id(model: Optional[str]) -> str:
    if model is None:
        return "tiny-refusion"
    return str(model).rstrip("/")


# --------------------------------------------------------------------------
# CLI


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be within 0..65535, got {value}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from ..cli import OneLineParser, add_decoding_args

    parser = OneLineParser(prog="python -m refusion_mlx.server",
                           description="OpenAI-compatible HTTP server for a ReFusion model.")
    parser.add_argument("--model", help="model folder or hub repo id (default: the bundled demo model)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=_port, default=8080, help="port (default 8080; 0 picks a free one)")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="compute dtype")
    parser.add_argument("--model-id", help="the model name reported by /v1/models (default: --model)")
    add_decoding_args(parser)  # server-wide defaults; requests override them
    parser.add_argument("--max-active", type=_positive, default=DEFAULT_MAX_ACTIVE,
                        help=f"generations interleaved step by step (default {DEFAULT_MAX_ACTIVE})")
    parser.add_argument("--max-queue", type=_positive, default=DEFAULT_MAX_QUEUE,
                        help=f"requests waiting beyond those; more get 503 (default {DEFAULT_MAX_QUEUE})")
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
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    from ..cli import params_from_args

    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)
    server = None
    try:
        params = params_from_args(args)
        default_max = params.gen_length  # --max-tokens, else the preset's, else 512
        origins = [o.strip() for o in args.allowed_origins.split(",") if o.strip()]
        try:
            server = RefusionServer(args.model, host=args.host, port=args.port, dtype=args.dtype,
                                    params=params, default_max_tokens=default_max, model_id=args.model_id,
                                    max_active=args.max_active, max_queue=args.max_queue,
                                    max_body_bytes=args.max_body_bytes, allowed_origins=origins)
        except OSError as e:
            raise RefusionError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
        if server.host not in ("127.0.0.1", "::1", "localhost"):
            log.warning("listening on %s: other machines can reach this server", server.host)
        log.info("loading %s ...", server.httpd.model_id)
        server.load()
        log.info("serving %s at %s (Ctrl-C to stop)", server.httpd.model_id, server.url)
        server.serve_forever()
    except RefusionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        log.info("shutting down")
    finally:
        if server is not None:
            server.close()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
