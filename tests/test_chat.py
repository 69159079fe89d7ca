"""The chat REPL: committed-cache reuse across turns, commands, the live view and the trace."""

from __future__ import annotations

import io
import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

from refusion_mlx.cli.repl import Terminal, repl, run_turn
from refusion_mlx.cli.slot_view import SlotView
from refusion_mlx.decode.conversation import ChatSession
from refusion_mlx.decode.prefix import common_prefix
from refusion_mlx.decode.stats import SlotCommit
from refusion_mlx.errors import RefusionError

from tests.helpers import FIXTURE_MODEL, commit, committed_cache
from refusion_mlx.generate import GenerationResponse, make_params

ROOT = Path(__file__).resolve().parents[1]
TURNS = ["Who is Sven?", "Count from 17 to 38.", "Reverse the words: sugar forest orange"]


@pytest.fixture(scope="module")
def loaded():
    from refusion_mlx.models.loading import load

    return load(FIXTURE_MODEL)


def session(loaded, reuse=True, **params):
    model, tok = loaded
    return ChatSession(model, tok, make_params(**{"max_tokens": 32, "block_length": 16, **params}), reuse=reuse)


def positions_in_order(cache):
    return sorted(cache.positions)


def test_each_turn_prefills_only_the_new_suffix(loaded):
    s = session(loaded)
    for text in TURNS:
        before = len(s.cache)
        answer = s.send(text)
        t = s.turns[-1]
        assert answer == s.messages[-1]["content"] and s.messages[-2]["content"] == text
        assert t.reused_tokens == before  # everything the cache held was reused
        assert t.prefill_tokens == t.prompt_tokens - t.reused_tokens == t.stats.prompt_tokens
        # the cache now holds exactly this turn's prompt and answer, positions 0..n-1
        assert positions_in_order(s.cache) == list(range(t.prompt_tokens + t.stats.generated_tokens))
    first, *later = s.turns
    assert first.reused_tokens == 0 and first.prefill_tokens == first.prompt_tokens
    for prev, t in zip(s.turns, later):
        assert t.reused_tokens == prev.prompt_tokens + prev.stats.generated_tokens
        assert t.prefill_tokens < t.prompt_tokens / 2
    totals = s.totals()
    assert totals["prefill_tokens"] < totals["prefill_tokens_without_reuse"]
    print("\nprefill per turn (with reuse / without):",
          [(t.prefill_tokens, t.prompt_tokens) for t in s.turns])


def test_without_reuse_prefills_everything(loaded):
    s = session(loaded, reuse=False)
    for text in TURNS[:2]:
        s.send(text)
    assert [t.prefill_tokens for t in s.turns] == [t.prompt_tokens for t in s.turns]
    assert all(t.reused_tokens == 0 for t in s.turns)


def test_edited_history_truncates_the_cache_at_the_divergence(loaded):
    s = session(loaded)
    s.send(TURNS[0])
    s.send(TURNS[1])
    old = [t for _, t in sorted(zip(s.cache.positions, s.cache.tokens))]
    s.messages[2]["content"] = "Count from 20 to 30."  # an app rewrote the second question
    s.send(TURNS[2])
    new_ids = s.prompt_ids()[: s.turns[-1].prompt_tokens]
    diverge = next(i for i, (a, b) in enumerate(zip(old, new_ids)) if a != b)
    assert s.turns[-1].reused_tokens == diverge
    assert positions_in_order(s.cache) == list(range(len(s.cache)))


def test_reset_clears_conversation_and_cache(loaded):
    s = session(loaded)
    s.send(TURNS[0])
    s.reset()
    assert len(s.cache) == 0 and s.messages == [] and s.turns == []
    s.send(TURNS[1])
    assert s.turns[-1].reused_tokens == 0


def test_interrupted_turn_is_dropped(loaded):
    s = session(loaded, max_tokens=64)
    s.send(TURNS[0])
    held = len(s.cache)
    stream = s.stream(TURNS[1])
    next(stream)  # one step, then the user hits Ctrl-C
    stream.close()
    assert len(s.messages) == 2 and len(s.turns) == 1
    assert len(s.cache) == held and positions_in_order(s.cache) == list(range(held))
    s.send(TURNS[2])
    assert s.turns[-1].reused_tokens == held


def test_a_turn_refused_while_another_streams_changes_nothing(loaded):
    """A second turn while the first's answer still streams is refused, and neither the cache the open
    answer decodes into nor the history loses anything (it once cut rows out of the cache first)."""
    whole = session(loaded, max_tokens=48)
    whole.send(TURNS[0])
    reference = whole.send(TURNS[1])
    s = session(loaded, max_tokens=48)
    s.send(TURNS[0])
    stream = s.stream(TURNS[1])
    text = next(stream).text
    rows = list(zip(s.cache.positions, s.cache.tokens))
    with pytest.raises(RefusionError, match="the cache is in use"):
        s.send("Who is Zoe?")
    assert list(zip(s.cache.positions, s.cache.tokens)) == rows and s.messages[-1]["content"] == TURNS[1]
    text += "".join(r.text for r in stream)
    assert text == reference and s.messages[-1] == {"role": "assistant", "content": reference}


def test_context_overflow_is_a_clean_error(loaded):
    s = session(loaded, max_tokens=4000)
    with pytest.raises(RefusionError, match="context"):
        s.send("Who is Sven? " * 500)
    assert s.messages == [] and len(s.cache) == 0
    s.send("Who is Sven?")  # a budget past what the conversation leaves is cut to it (decode/fit.py)
    assert s.turns[-1].max_tokens == 2036 and s.turns[-1].finish_reason == "stop"


def test_common_prefix_stops_at_a_gap():
    cache = committed_cache()
    commit(cache, [3, 0, 1], [8, 5, 6])  # rows in commit order, positions 0, 1 and 3
    assert common_prefix(cache, [5, 6, 7, 8]) == (2, [1, 2])
    assert common_prefix(cache, [5, 9]) == (1, [1])


def run_repl(loaded, lines, **kw):
    feed = iter(lines)

    def read(prompt):
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    out, err = io.StringIO(), io.StringIO()
    code = repl(session(loaded), Terminal(read, out, err, interactive=False), **kw)
    return code, out.getvalue(), err.getvalue()


def test_a_cut_budget_names_reset_only_where_earlier_turns_took_the_room(loaded):
    """The first turn's budget cut to the context said "(/reset starts over)", with nothing to reset."""
    feed = iter(["Who is Sven?", "Who is Zoe?", "/reset", "Who is Sven?"])

    def read(prompt):
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    err = io.StringIO()
    assert repl(session(loaded, max_tokens=4000), Terminal(read, io.StringIO(), err, interactive=False)) == 0
    cuts = [line for line in err.getvalue().splitlines() if "cut to" in line]
    assert [line.endswith("(/reset starts over)") for line in cuts] == [False, True, False], cuts


def test_repl_commands(loaded):
    code, out, err = run_repl(loaded, ["Who is Sven?", "/stats", "/bogus", "", "/help",
                                       "Who is Sven?", "/reset", "/stats", "Who is Sven?", "/quit", "never read"])
    assert code == 0
    first_answer = out.splitlines()[0]
    assert first_answer.startswith("Sven lives in Hanoi.")
    assert out.rstrip().endswith(first_answer)  # after /reset: the same answer as a fresh start
    stats = json.loads(out[out.index("{"): out.index("}\n}") + 3])
    assert stats["turn"] == 1 and stats["prefill_tokens"] == stats["prompt_tokens"]
    assert stats["decode"]["generated_tokens"] > 0 and "tokens_per_forward" in stats["decode"]
    assert "no turn yet" in out  # /stats right after /reset
    assert "unknown command /bogus" in err and "/reset clears" in err and "reset:" in err
    prefill = [tuple(map(int, m)) for m in re.findall(r"prefill (\d+) of (\d+) prompt tokens \((\d+) reused", err)]
    assert prefill[0][0] == prefill[0][1] and prefill[0][2] == 0  # turn 1: everything prefilled
    assert prefill[1][0] < prefill[1][1] and prefill[1][2] > 0  # turn 2: history from the cache
    assert prefill[2][2] == 0  # after /reset
    assert err.rstrip().endswith("bye")


def test_a_line_is_a_command_by_its_first_word(loaded):
    """A known command's name first is that command ("/quit now"); mlx_lm.chat's letters only alone; a lone
    unknown /word is "unknown command"; any other line is a message, a path first too."""
    from refusion_mlx.cli.repl import HELP, command_of

    assert [command_of(line) for line in ("/quit now", "/exit", "q", "r", "h", " /stats ", "/reset please")] == [
        "quit", "quit", "quit", "reset", "help", "stats", "reset"]
    assert [command_of(line) for line in ("/usr/bin is a path, explain", "q is a letter", "/usr/bin")] == [
        None, None, "unknown"]
    assert "(or r)" in HELP and "(or h)" in HELP and "q," in HELP
    code, out, err = run_repl(loaded, ["/usr/bin is a path, explain", "/quit now", "never read"])
    assert code == 0 and "unknown command" not in err and err.count("prefill ") == 1 and out.strip()


def test_a_line_piped_from_windows_is_sent_without_its_carriage_return(loaded):
    s = session(loaded)  # input() leaves the \r of a \r\n, which is not part of the message
    assert run_turn(s, "Who is Sven?\r", Terminal(None, io.StringIO(), io.StringIO(), interactive=False))
    assert s.messages[0]["content"] == "Who is Sven?"


def test_piped_turns_that_fail_make_a_failing_exit(loaded):
    too_long = "Who is Sven? " * 500  # past the fixture's 2048-token context
    code, out, err = run_repl(loaded, ["Who is Sven?", too_long, "Who is Sven?"])
    assert code == 1 and err.count("error:") == 1 and "1 turn failed" in err and "(/reset starts over)" in err
    assert out.startswith("Sven lives in Hanoi.") and err.count("prefill ") == 2  # the other turns were answered
    lines = [too_long]

    def read(prompt):
        if not lines:
            raise EOFError
        return lines.pop()

    err = io.StringIO()
    assert repl(session(loaded), Terminal(read, io.StringIO(), err, interactive=True)) == 0  # the user saw it
    assert "error:" in err.getvalue() and "/reset" not in err.getvalue()  # no history: a reset would not help


def test_ctrl_c_at_the_prompt_is_interrupted_and_exit_130(loaded, capsys):
    """Ctrl-C while the chat waits for a line ends it as Ctrl-C ends every command: "interrupted", exit 130
    (it was "bye" and exit 0, as end of input is)."""
    from refusion_mlx.cli import run

    lines = ["Who is Sven?"]

    def read(prompt):
        if not lines:
            raise KeyboardInterrupt
        return lines.pop()

    out, err = io.StringIO(), io.StringIO()
    assert run(lambda: repl(session(loaded), Terminal(read, out, err, interactive=True))) == 130
    assert capsys.readouterr().err == "interrupted\n" and "bye" not in err.getvalue()
    assert out.getvalue().startswith("Sven lives in Hanoi.") and out.getvalue().endswith("\n\n")
    assert run_repl(loaded, ["Who is Sven?"])[0] == 0  # end of input stays a quiet exit 0


def test_a_turn_that_fails_in_mlx_is_one_line_and_the_chat_goes_on(loaded, monkeypatch):
    """Out of memory in one turn: "error: ..." for that turn, the next turn is answered (it ended the chat
    with a traceback once the library raised MLX's own error)."""
    import refusion_mlx.decode.batch as batch

    real, calls = batch.run_passes, []

    def fails_once(model, passes):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("[metal::malloc] Attempting to allocate 99 bytes")
        return real(model, passes)

    monkeypatch.setattr(batch, "run_passes", fails_once)
    code, out, err = run_repl(loaded, ["Who is Sven?", "Who is Sven?"])
    assert code == 1 and "error: [metal::malloc]" in err and "1 turn failed" in err and "Traceback" not in err
    assert out.startswith("Sven lives in Hanoi.")


def test_slot_view_draws_out_of_order_fill():
    class Tok:
        eos_token_id = 0

        def decode(self, ids):
            return "".join(chr(ord("a") + i) for i in ids)

    out, cache = io.StringIO(), committed_cache()
    view = SlotView(Tok(), out, cache, response_start=10, block_lengths=[8, 8], eos_id=0, width=40, color=True)

    def step(n, pos, toks):
        commit(cache, pos, toks)
        return GenerationResponse("", [], [SlotCommit(pos, toks)], "verify", n, 1, 0)

    view.update(step(0, [14, 15, 16, 17], [5, 6, 7, 8]))  # the second slot first
    view.update(step(1, [10, 11, 12, 13], [1, 2, 3, 4]))
    frames = out.getvalue()
    first = frames.split("\x1b[2F")[0]
    assert "░░░░" in first and "fghi" in first and "bcde" not in first
    assert "\x1b[2F\x1b[J" in frames  # the second frame redraws over the first
    assert "\x1b[1;32mbcde" in frames  # newly committed tokens highlighted
    view.finish()
    assert out.getvalue().endswith("\x1b[2F\x1b[J")


def test_cli_visualize_and_trace(tmp_path, capsys, monkeypatch):
    """The command's main in this process (what it draws and traces is the subject, not its process: a
    process of its own cost 3 s of CPU to start), its turns read from a pipe-like standard input and its
    output going to a file-like one, not a terminal."""
    from refusion_mlx.chat import main as chat_main

    trace = tmp_path / "trace.json"
    monkeypatch.setattr(sys, "stdin", io.StringIO("Count from 17 to 38.\n/stats\n/reset\nWho is Sven?\n"))
    code = chat_main(["--model", str(FIXTURE_MODEL), "--max-tokens", "48", "--block-length", "16", "--visualize",
                      "--frame-time", "0", "--trace", str(trace)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "░" in out and "step 1 · " in out and "\x1b" not in out  # a file: frame after frame, no escapes
    plain = [block for block in out.split("\n\n") if not block.startswith("step ")]
    assert plain[0].startswith("17 18 19 20") and plain[1].startswith("Sven lives in")  # the answers, drawn last
    steps = json.loads(trace.read_text())
    assert {"turn", "step", "phase", "positions", "tokens"} <= set(steps[0])
    assert {s["turn"] for s in steps} == {1, 2}
    first = [s for s in steps if s["turn"] == 1]
    assert [s["step"] for s in first] == list(range(len(first)))
    start = first[0]["response_start"]
    filled = sorted(p - start for s in first for p in s["positions"])
    assert filled == list(range(len(filled))) and 0 < len(filled) <= 48  # each answer position once
    assert first[-1]["finish_reason"] in ("stop", "length") and all(s["phase"] in ("verify", "infill") for s in first)

    png = tmp_path / "trace.png"
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "render_trace.py"), str(trace), "-o", str(png),
                        "--turn", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    from PIL import Image

    img = Image.open(png).convert("RGB")
    assert img.size[0] == 1200 and img.size[1] > 200
    colours = {c for _, c in img.getcolors(1 << 20)}
    assert len(colours) > 10  # a timeline and a coloured answer map, not a blank page


@pytest.mark.parametrize("flags,needle", [
    (["--max-tokens", "-5"], "--max-tokens must be a positive integer"),
    (["--slot-size", "4", "--block-length", "6"], "not a multiple"),
    (["--trace", "/nonexistent-dir/trace.json"], "cannot write the trace"),
    (["--trace", ""], "must name a file, not an empty string"),
    (["--bogus"], "unrecognized arguments"),
    (["--visualize", "--frame-time", "-1"], "--frame-time must be within"),
])
def test_cli_bad_flags_one_line(flags, needle):
    r = subprocess.run([sys.executable, "-m", "refusion_mlx.chat", *flags], input="", capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.returncode != 0 and needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_frame_time_without_visualize_is_refused(capsys):
    """--frame-time paces the --visualize drawing: without it the chat ran as if it were not given; refused as
    bench refuses a flag its mode does not read (one line, exit 2)."""
    from refusion_mlx.chat import main

    with pytest.raises(SystemExit) as e:
        main(["--frame-time", "5"])
    assert e.value.code == 2 and capsys.readouterr().err.endswith("error: --frame-time goes with --visualize\n")


def test_ctrl_c_while_the_model_loads_says_interrupted(monkeypatch, capsys):
    import refusion_mlx.chat as chat

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(chat, "load", interrupted)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert chat.main(["--max-tokens", "8"]) == 130 and capsys.readouterr().err == "interrupted\n"


def test_cli_leaves_files_alone_and_reads_no_closed_stdin(tmp_path):
    """A trace is written once a turn is traced: a run that fails first leaves an older trace as it was, and
    a trace that names a folder leaves nothing beside it; closed standard input is one line."""
    old = tmp_path / "trace.json"
    old.write_text("OLD")
    for flags, needle in ((["--model", str(tmp_path / "none"), "--trace", str(old)], "no model folder"),
                          (["--trace", str(tmp_path)], "Is a directory")):
        r = subprocess.run([sys.executable, "-m", "refusion_mlx.chat", *flags], input="", capture_output=True,
                           text=True, timeout=60, cwd=ROOT)
        assert r.returncode == 1 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert old.read_text() == "OLD" and sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]
    assert not (tmp_path.parent / f"{tmp_path.name}.tmp").exists()
    r = subprocess.run([sys.executable, "-m", "refusion_mlx.chat"], stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=60, cwd=ROOT, preexec_fn=lambda: os.close(0))
    assert r.returncode == 1
    assert r.stderr.strip() == "error: the chat reads its turns from standard input, which is closed"


def test_chat_app_example(capsys, monkeypatch):
    """The example run as its own ``__main__`` in this process: a process of its own imported transformers
    and PyTorch (a script is no command of ours, so it keeps PyTorch) for 6 s of CPU before its first turn."""
    import runpy

    script = ROOT / "examples" / "chat_app.py"
    monkeypatch.setattr(sys, "argv", [str(script), "Who is Sven?", "Count from 17 to 38."])
    with pytest.raises(SystemExit) as ended:
        runpy.run_path(str(script), run_name="__main__")
    out, err = capsys.readouterr()
    assert ended.value.code == 0, err
    assert "Sven lives in Hanoi." in out
    reused = [int(n) for n in re.findall(r"prefilled (\d+) of (\d+)", out)[1]]
    assert reused[0] < reused[1]


def test_a_reader_that_leaves_early_ends_the_chat_quietly():
    """``chat | head -c 10``: the reader left, so the chat stops without an error line, as generate does."""
    r = subprocess.run(f"printf 'Count from 1 to 300.\\nWho is Sven?\\n' | {sys.executable} -m refusion_mlx.chat "
                       f"--max-tokens 256 | head -c 10", shell=True, capture_output=True, text=True, timeout=120,
                       cwd=ROOT, executable="/bin/bash")
    assert r.stdout == "1 2 3 4 5 " and "error" not in r.stderr and "Traceback" not in r.stderr
