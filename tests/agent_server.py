"""A server for the agent tests: the bundled demo model, whose chat template
renders tools in Qwen3's format and which calls its two tools itself
(``lookup_person``, ``calculator``: examples/demo_model/tool_data.py), and
a test double at the decoding boundary for answers the demo never writes:
text followed by two calls at once, a call that does not parse, and text
after a call.

* :class:`ScriptedCalls` (THE TEST DOUBLE): the real ``BatchGenerator`` --
  every request is really prefilled and decoded, batched, cached, with its
  real token counts and steps -- except that for a request whose last turn
  holds a key of :data:`SCRIPTS`, each response's *text* is replaced by that
  script, released a piece per step (the rest with the last response). All
  that reads the text -- stop strings, the tool-call splitter, the three
  APIs' adapters and streams, the clients -- runs for real on it. Every
  other request's answer, calls included, is the demo model's own.
"""

from __future__ import annotations

import contextlib
import json
from typing import Dict, List

import pytest

from refusion_mlx.decode import batch
from refusion_mlx.serve.http_server import RefusionServer

TOOLS = [
    {"type": "function", "function": {
        "name": "lookup_person", "description": "Facts about a person, by name.",
        "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}},
    {"type": "function", "function": {
        "name": "calculator", "description": "The value of an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
]


def call(function: str, arguments: dict) -> str:
    """A call as Qwen3's template writes one (and as the demo model does)."""
    return f'<tool_call>\n{json.dumps({"name": function, "arguments": arguments})}\n</tool_call>'


# A key in the last user turn -> the answer's text, in the pieces the steps release.
SCRIPTS: Dict[str, List[str]] = {
    "Who are Sven and Zoe?": ["I will look both up.\n", call("lookup_person", {"name": "Sven"}) + "\n",
                              call("lookup_person", {"name": "Zoe"})],
    "Break the call.": ["<tool_call>\n{\"name\": \"calculator\", \"arguments\": \n</tool_call>"],
    "Call, then say.": [call("calculator", {"expression": "1+1"}) + "\nThe answer follows."],
}


class ScriptedCalls(batch.BatchGenerator):
    """TEST DOUBLE at the decoding boundary (see the module's docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scripted: Dict[int, List[str]] = {}

    def insert(self, prompt, params=None, cache=None, constraint=None, logprobs=None) -> int:
        uid = super().insert(prompt, params, cache=cache, constraint=constraint, logprobs=logprobs)
        held = [t for _, _, t in cache.in_position_order()] if cache is not None else []
        text = self.tokenizer.decode(held + [int(t) for t in prompt])
        turns = text.rsplit("<|im_start|>", 2)
        last_turn = turns[-2] if len(turns) == 3 else ""  # the turn before the assistant's generation prompt
        for key, pieces in SCRIPTS.items():
            if key in last_turn:
                self.scripted[uid] = list(pieces)
        return uid

    def step(self):
        out = super().step()
        for r in out:
            pieces = self.scripted.get(r.uid)
            if pieces is None:
                continue
            if r.finish_reason is not None:
                r.text = "".join(pieces)
                del self.scripted[r.uid]
            else:
                r.text = pieces.pop(0) if pieces else ""
        return out


@contextlib.contextmanager
def scripted_server(**settings):
    """A started RefusionServer on the demo model whose engine decodes with :class:`ScriptedCalls`."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(batch, "BatchGenerator", ScriptedCalls)
        server = RefusionServer(None, model_id="tiny-refusion", port=0, **settings).start()
    try:
        yield server
    finally:
        server.close()
