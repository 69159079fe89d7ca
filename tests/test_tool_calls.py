"""The model's tool calls read out of its answer text (serve/core/tool_calls.py), without a server.

The format and the parser are mlx-lm's choice for the tokenizer: the demo
model's tokenizer, whose chat template renders tools as Qwen3's does, gets
``json_tools``; the text fed
here is shaped as such a model writes calls (``<tool_call>\\n{"name": ...,
"arguments": {...}}\\n</tool_call>``), cut into pieces at every point, as a
stream releases it.
"""

from __future__ import annotations

import json
import random

import pytest

from refusion_mlx.models.loading import DEMO_MODEL, load_tokenizer
from refusion_mlx.serve.core.refusal import Refusal
from refusion_mlx.serve.core.tool_calls import (ToolCall, ToolCallSplitter, ToolFormat, check_results, function_tool,
                                           template_tools)
from tests.agent_server import TOOLS
from tests.helpers import FIXTURE_MODEL

SVEN = '<tool_call>\n{"name": "lookup_person", "arguments": {"name": "Sven"}}\n</tool_call>'
CALC = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
MARKED = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "see </tool_call> here"}}\n</tool_call>'
BAD = '<tool_call>\n{"cmd": "say "hi now"}}\n</tool_call>'  # a quote left unescaped: no JSON


@pytest.fixture(scope="module")
def fmt():
    assert ToolFormat.of(load_tokenizer(FIXTURE_MODEL)) is None  # the golden fixture's template renders no tools
    fmt = ToolFormat.of(load_tokenizer(DEMO_MODEL))
    assert fmt is not None and (fmt.start, fmt.end, fmt.parser) == ("<tool_call>", "</tool_call>", "json_tools")
    return fmt


def split(fmt, text, cuts=(), single=False, final=True):
    """Feed ``text`` cut at ``cuts``; the items, with adjacent strings joined, and the splitter."""
    splitter = ToolCallSplitter(fmt, TOOLS, single=single)
    bounds = [0, *sorted(cuts), len(text)]
    items = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        items += splitter.feed(text[a:b], final=final and i == len(bounds) - 2)
    joined = []
    for item in items:
        if isinstance(item, str) and joined and isinstance(joined[-1], str):
            joined[-1] += item
        else:
            joined.append(item)
    return [(c.name, c.args) if isinstance(c, ToolCall) else c for c in joined], splitter


CASES = [
    (SVEN, [("lookup_person", {"name": "Sven"})]),
    ("Let me look.\n" + SVEN, ["Let me look.", ("lookup_person", {"name": "Sven"})]),
    (SVEN + "\n" + CALC, [("lookup_person", {"name": "Sven"}), ("calculator", {"expression": "6*7"})]),
    (CALC + "\nThe answer follows.", [("calculator", {"expression": "6*7"}), "The answer follows."]),
    ("1 < 2 and <tool> is no call.", ["1 < 2 and <tool> is no call."]),
    ('<tool_call>\n{"name": "calculator", "arguments": \n</tool_call>',
     ['<tool_call>\n{"name": "calculator", "arguments": \n</tool_call>']),  # does not parse: stays text
    ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}',
     [("calculator", {"expression": "1+1"})]),  # no end marker before EOS, but whole: a call
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', ['<tool_call>\n{"arguments": {}}\n</tool_call>']),  # no name
    # markup that does not parse goes out as the text it was, the whitespace before it too
    ("Some text and <tool_call> inside text.", ["Some text and <tool_call> inside text."]),
    ('Break:\n<tool_call>\n{"name": "calculator", "arguments": \n</tool_call>',
     ['Break:\n<tool_call>\n{"name": "calculator", "arguments": \n</tool_call>']),
    (CALC + '\n<tool_call>\n{"arguments": {}}\n</tool_call>',  # after a call its whitespace is dropped as ever
     [("calculator", {"expression": "6*7"}), '<tool_call>\n{"arguments": {}}\n</tool_call>']),
    # the end marker's text inside an argument (a file about tool calls) is the argument's: the call ends at
    # the marker after its JSON, escaped quotes and backslashes read as such
    (MARKED + "\nDone.", [("calculator", {"expression": "see </tool_call> here"}), "Done."]),
    ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "a \\" </tool_call> \\\\"}}\n</tool_call>',
     [("calculator", {"expression": 'a " </tool_call> \\'})]),
    (MARKED + "\n" + MARKED, [("calculator", {"expression": "see </tool_call> here"})] * 2),
    ("<tool_call>\ncalculator 6*7</tool_call>", ["<tool_call>\ncalculator 6*7</tool_call>"]),  # not JSON: first marker
    # a body that cannot be JSON (its quotes misread) ends at the first marker: the text and call after it are theirs
    (BAD + "\nSome text.\n" + CALC, [BAD + "\nSome text.", ("calculator", {"expression": "6*7"})]),
    ('<tool_call>\n{"a": "x</tool_call>\nNo quote.', ['<tool_call>\n{"a": "x</tool_call>\nNo quote.']),
]


def spans_text(text, splitter):
    """The text the splitter says went out as text, read from the text fed by its offsets."""
    return "".join(text[a:b] for a, b in splitter.spans)


@pytest.mark.parametrize("text,want", CASES)
def test_calls_are_read_from_the_answer_in_any_pieces(fmt, text, want):
    """... and the offsets of the text that went out are known (the tokens of a call's markup are not the
    answer's: their logprobs are left out, as OpenAI's cover the content alone)."""
    whole, splitter = split(fmt, text)
    said = "".join(w for w in want if isinstance(w, str))
    assert whole == want and spans_text(text, splitter) == said and splitter.decided >= len(text)
    assert splitter.calls == sum(isinstance(w, tuple) for w in want)
    assert splitter.failed == sum(isinstance(w, str) and "<tool_call>" in w for w in want)
    for cut in range(1, len(text)):  # every place a stream can cut the text, and random multi-cuts
        items, pieces = split(fmt, text, [cut])
        assert items == want and spans_text(text, pieces) == said, cut
    rng = random.Random(0)
    for _ in range(50):
        items, pieces = split(fmt, text, rng.sample(range(1, len(text)), 5))
        assert items == want and spans_text(text, pieces) == said
    markup = text.rfind("<tool_call>")
    if want and isinstance(want[-1], tuple):  # the last call's markup: decided, not kept
        assert not splitter.kept(markup, markup + len("<tool_call>"))


def test_a_stream_never_shows_markup_before_the_call_is_known(fmt):
    """Until the end marker, nothing of a call goes out; text before it goes out at once (less a
    trailing space or newline, which waits for what follows)."""
    splitter = ToolCallSplitter(fmt, TOOLS)
    out = []
    text = "Let me look.\n" + SVEN
    for ch in text:
        items = splitter.feed(ch, final=False)
        out += items
        assert not any(isinstance(i, str) and "<" in i for i in items), items
    assert "".join(i for i in out if isinstance(i, str)) == "Let me look." and isinstance(out[-1], ToolCall)
    assert "".join(i for i in out[:-1]) == "Let me look."  # each character out as it came, the newline dropped


def test_a_call_cut_short_by_the_budget_is_left_out(fmt):
    """max_tokens ended the answer inside a call: its markup is neither text nor a call (the answer finishes
    "length"); text before it stays, and a call that parses whole is still one; ended by EOS, it stays text."""
    for before in ("", "Let me look.\n"):
        text = before + SVEN[:30]
        splitter = ToolCallSplitter(fmt, TOOLS)
        items = splitter.feed(text, final=True, cut=True)
        assert items == ([before.strip()] if before else []) and (splitter.cut, splitter.failed) == (1, 0)
        said, ended = split(fmt, text)  # an EOS there: what the model wrote, as text
        assert said == [before + SVEN[:30]] and ended.failed == 1
    whole = ToolCallSplitter(fmt, TOOLS)
    assert [i.name for i in whole.feed(SVEN.removesuffix("</tool_call>"), final=True, cut=True)] == ["lookup_person"]
    assert whole.cut == 0


def test_single_call_ends_the_answer(fmt):
    items, splitter = split(fmt, SVEN + "\n" + CALC, single=True, final=False)
    assert items == [("lookup_person", {"name": "Sven"})] and splitter.done
    assert splitter.feed("more text", final=True) == []


def test_ids_are_unique_and_arguments_json(fmt):
    splitter = ToolCallSplitter(fmt, TOOLS)
    calls = splitter.feed(SVEN + SVEN, final=True)
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert json.loads(calls[0].arguments) == {"name": "Sven"}


@pytest.mark.parametrize("spec,param", [
    ("lookup", "tools[0]"),
    ({"description": "no name"}, "tools[0].name"),
    ({"name": "has space"}, "tools[0].name"),
    ({"name": "f", "parameters": {"type": "string"}}, "tools[0].parameters"),
    ({"name": "f", "parameters": {"type": "object", "properties": 3}}, "tools[0].parameters"),
    ({"name": "f", "parameters": {"type": "object", "required": "x"}}, "tools[0].parameters"),
    ({"name": "f", "description": 7}, "tools[0].description"),
])
def test_malformed_tool_is_one_clear_refusal(spec, param):
    with pytest.raises(Refusal) as e:
        function_tool(spec, "tools[0]")
    assert e.value.param == param and e.value.message.startswith(param + ":") and "\n" not in e.value.message


def test_tool_choice_and_results():
    tools = [function_tool(t["function"], "t") for t in TOOLS]
    assert template_tools(tools, "auto", True, "tools", "tool_choice") == tuple(tools)
    assert template_tools(tools, "none", False, "tools", "tool_choice") == ()  # none: nothing to render or read
    for choice in ("required", "calculator"):  # forced calls: decoded under a grammar (serve/core/structured.py)
        assert template_tools(tools, choice, True, "tools", "tool_choice") == tuple(tools)
    for choice, given in (("nope", tools), ("required", [])):
        with pytest.raises(Refusal) as e:
            template_tools(given, choice, True, "tools", "tool_choice")
        assert e.value.reason.value == "invalid_value" and e.value.param == "tool_choice"
    with pytest.raises(Refusal, match="no tool-call format"):
        template_tools(tools, "auto", False, "tools", "tool_choice")
    with pytest.raises(Refusal, match="two tools"):
        template_tools(tools + tools[:1], "auto", True, "tools", "tool_choice")
    made = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}]}
    check_results([made, {"role": "tool", "tool_call_id": "c1"}], ["m0", "m1"])
    with pytest.raises(Refusal) as e:
        check_results([made, {"role": "tool", "tool_call_id": "c2"}], ["m0", "m1"])
    assert e.value.param == "m1"


class ByteTokenizer:
    """Tokens of known bytes, spelled in the byte-level alphabet (as a BPE's are)."""

    PIECES = {0: b"Hi", 1: b"\xc3", 2: b"\xa9", 3: b"!", 4: b"<tool_call>",
              5: b'\n{"name": "f", "arguments": {}}\n', 6: b"</tool_call>", 9: b""}
    eos_token_id = 9

    def __len__(self):
        return 10

    def decode(self, ids):
        return b"".join(self.PIECES[i] for i in ids).decode("utf-8", "replace")

    def convert_ids_to_tokens(self, t):
        from refusion_mlx.serve.core.text import _byte_level_alphabet

        spell = {v: k for k, v in _byte_level_alphabet().items()}
        return "".join(spell[b] for b in self.PIECES[t])


def test_logprobs_with_tools_cover_the_content_in_any_steps():
    """The entries of a call's markup are left out and the content's kept, however the steps cut them: a
    character split across two steps keeps both its bytes' entries (its first was lost once), text before a
    call keeps its own."""
    from types import SimpleNamespace

    from refusion_mlx.decode.params import make_params
    from refusion_mlx.serve.core.engine_request import EngineRequest
    from refusion_mlx.serve.core.job import Job

    fmt = ToolFormat("<tool_call>", "</tool_call>", lambda body, tools: json.loads(body), "json")
    tools = ({"type": "function", "function": {"name": "f", "parameters": {}}},)
    steps = [("Hi", [0, 1], None), ("\u00e9!", [2, 3], None), ("<tool_call>", [4], None),
             ('\n{"name": "f", "arguments": {}}\n</tool_call>', [5, 6], None), ("", [9], "stop")]

    def entries(tool_format):
        request = EngineRequest(prompt_ids=[1], params=make_params(max_tokens=16), tools=tools, logprobs=0)
        job, out, calls = Job(request, None, eos_id=9, tool_format=tool_format), [], []
        for text, tokens, finish in steps:
            response = SimpleNamespace(text=text, tokens=tokens, logprobs=[(-0.1, [])] * len(tokens),
                                       finish_reason=finish, commits=None)
            events, _, _ = job.step(response, ByteTokenizer())
            out += [e["token"] for kind, payload in events if kind == "logprobs" for e in payload[1]]
            calls += [payload for kind, payload in events if kind == "tool_call"]
        return out, calls

    plain, _ = entries(None)
    assert plain == ["Hi", "bytes:\\xc3", "bytes:\\xa9", "!", "<tool_call>", '\n{"name": "f", "arguments": {}}\n',
                     "</tool_call>"]
    content, calls = entries(fmt)
    assert content == ["Hi", "bytes:\\xc3", "bytes:\\xa9", "!"] and [c.name for c in calls] == ["f"]



def test_stop_strings_skip_a_call_whose_arguments_hold_its_end_marker():
    """A stop string inside a call's arguments, after the end marker's text there, is the call's (the call's
    bounds are the splitter's: :mod:`refusion_mlx.serve.core.call_bounds`), however the text comes."""
    from refusion_mlx.serve.core.text import TextShaper

    text = MARKED.replace("here", "here STOP") + " after STOP more"
    for cut in range(1, len(text)):
        shaper = TextShaper(["STOP"], 0, ("<tool_call>", "</tool_call>"))
        first, _ = shaper.feed(text[:cut], [], final=False)
        rest, reason = shaper.feed(text[cut:], [], final=True)
        assert first + rest == text[:text.rindex(" STOP")] + " " and reason == "stop", cut


def test_a_body_that_cannot_be_json_ends_at_the_first_marker_in_any_pieces(fmt):
    """A quote the model left unescaped does not make the rest of the answer the call's: what follows the
    first end marker streams as it comes, a budget cut keeps it, one call ends the answer, stop strings fire."""
    from refusion_mlx.serve.core.text import TextShaper

    text = BAD + "\nSome STOP text.\n" + CALC + "\nAfter."
    shown = text.index("\nSome") + len("\nSome STOP text.")
    for cut in range(1, len(text)):
        splitter = ToolCallSplitter(fmt, TOOLS)
        first = splitter.feed(text[:cut], final=False)
        if cut >= shown:  # the text after the bad call is out before the answer ends
            assert "".join(i for i in first if isinstance(i, str)).startswith(text[:shown]), cut
        rest = splitter.feed(text[cut:], final=True, cut=True)  # the budget ran out at the end: nothing lost
        names = [i.name for i in first + rest if isinstance(i, ToolCall)]
        assert "".join(i for i in first + rest if isinstance(i, str)) == text[:shown] + "After." and \
            names == ["calculator"] and (splitter.failed, splitter.cut) == (1, 0), cut
        items, single = split(fmt, text, [cut], single=True, final=False)
        assert items == [BAD + "\nSome STOP text.", ("calculator", {"expression": "6*7"})] and single.done, cut
        shaper = TextShaper(["STOP"], 0, ("<tool_call>", "</tool_call>"))
        said, _ = shaper.feed(text[:cut], [], final=False)
        more, reason = shaper.feed(text[cut:], [], final=True)
        assert said + more == text[:text.index("STOP")] and reason == "stop", cut
    open_call = '<tool_call>\n{"a": "x</tool_call>\nNo quote.'  # still open at the cut: the first marker ends it
    splitter = ToolCallSplitter(fmt, TOOLS)
    assert splitter.feed(open_call, final=True, cut=True) == ['<tool_call>\n{"a": "x</tool_call>', "\nNo quote."]
