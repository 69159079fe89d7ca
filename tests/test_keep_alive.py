"""Keep-alives in a stream that has nothing to say (serve/edge/answering.py ``KEEP_ALIVE``): a forced call
is held back whole while it is decoded, and agents give up on a stream silent for 300 s. With the interval
lowered, each API's stream carries its own form, and the SDKs read the streams as ever."""

from __future__ import annotations

import anthropic
import httpx
import httpx2
import openai
import pytest

from refusion_mlx.serve.edge import answering
from refusion_mlx.serve.http_server import RefusionServer

WRITE = {"type": "object", "properties": {"content": {"type": "string", "minLength": 40, "maxLength": 48}}, "required": ["content"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "Write", "parameters": WRITE}}]
ASK = [{"role": "user", "content": "write it"}]


@pytest.fixture(scope="module")
def server():
    patch = pytest.MonkeyPatch()
    patch.setattr(answering, "KEEP_ALIVE", 0.01, raising=False)  # every pause between two decoding steps
    srv = RefusionServer(None, model_id="tiny-refusion", port=0).start()
    yield srv
    srv.close()
    patch.undo()


def raw(server, path, body):
    with httpx.stream("POST", server.url.removesuffix("/v1") + path, json={"stream": True, **body}, timeout=120,
                      headers={"x-api-key": "local", "anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200
        return r.read().decode()


def recording(lib=httpx):
    """An SDK's HTTP client (of ``lib``: httpx, or the httpx2 the anthropic SDK takes) that keeps the bytes of
    the stream it reads: one request checks the wire form (the comments and pings an SDK hides) and the SDK's
    reading of that very stream. Returns the client and the list of the bytes as they came."""
    sink = []

    class Recorded(lib.SyncByteStream):
        def __init__(self, stream):
            self.stream = stream

        def __iter__(self):
            for chunk in self.stream:
                sink.append(chunk)
                yield chunk

        def close(self):
            self.stream.close()

    class Recording(lib.HTTPTransport):
        def handle_request(self, request):
            response = super().handle_request(request)
            return lib.Response(response.status_code, headers=response.headers, request=request,
                                stream=Recorded(response.stream), extensions=response.extensions)

    return lib.Client(transport=Recording(), timeout=120), sink


def wire(sink) -> str:
    return b"".join(sink).decode()


def test_chat_and_completions_streams_carry_sse_comments(server):
    # the choices' merged stream, then one choice as the SDK reads it
    text = raw(server, "/v1/chat/completions", {"model": "tiny-refusion", "messages": ASK, "max_tokens": 200, "n": 2,
                                                "tools": CHAT_TOOLS, "tool_choice": "required"})
    assert ": keep-alive\n\n" in text and text.endswith("data: [DONE]\n\n"), 2
    http, sink = recording()
    oai = openai.OpenAI(base_url=server.url, api_key="local", max_retries=0, timeout=120, http_client=http)
    chunks = list(oai.chat.completions.create(model="tiny-refusion", messages=ASK, max_tokens=200, stream=True,
                                              tools=CHAT_TOOLS, tool_choice="required"))
    text = wire(sink)
    assert ": keep-alive\n\n" in text and text.endswith("data: [DONE]\n\n"), 1
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_messages_stream_carries_pings(server):
    body = {"model": "tiny-refusion", "messages": ASK, "max_tokens": 200, "tools": [{"name": "Write",
                                                                                    "input_schema": WRITE}],
            "tool_choice": {"type": "any"}}
    http, sink = recording(httpx2)
    claude = anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key="local", max_retries=0,
                                 timeout=120, http_client=http)
    with claude.messages.stream(**body) as stream:
        message = stream.get_final_message()
    assert wire(sink).count("event: ping\n") > 1  # more than the one after message_start
    assert message.stop_reason == "tool_use" and len(message.content[0].input["content"]) >= 40


def test_responses_stream_repeats_in_progress(server):
    tools = [{"type": "function", "name": "Write", "parameters": WRITE}]
    body = {"model": "tiny-refusion", "input": "write it", "max_output_tokens": 200, "tools": tools,
            "tool_choice": "required"}
    http, sink = recording()
    oai = openai.OpenAI(base_url=server.url, api_key="local", max_retries=0, timeout=120, http_client=http)
    events = list(oai.responses.create(stream=True, **body))
    assert wire(sink).count("event: response.in_progress\n") > 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.completed" and events[-1].response.output[0].type == "function_call"
    with oai.responses.stream(**body) as stream:  # the SDK's own accumulation of the snapshots
        final = stream.get_final_response()
    assert final.output[0].type == "function_call"
