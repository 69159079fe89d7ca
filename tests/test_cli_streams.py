"""The commands' standard streams as a user's shell gives them: block-buffered (no PYTHONUNBUFFERED), a full
disk, a log that takes both streams, Ctrl-C, input that is not UTF-8."""

from __future__ import annotations

import os
import subprocess
import sys
import time

# a user's environment: Python buffers standard output when it is not a terminal
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
ENV["PYTHONPATH"] = os.pathsep.join(sys.path)


def command(name: str, *argv: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"refusion_mlx.{name}", *argv], env={**ENV, **kwargs.pop("env", {})},
                          timeout=180, **kwargs)


def test_a_full_disk_under_standard_output_is_one_line_and_exit_1(tmp_path):
    """The answer is written before the command returns, where a failed write is one line and exit 1, and what
    could not be written is dropped: never Python's "Exception ignored" note at exit (exit 120)."""
    (tmp_path / "p.txt").write_text("Who is Sven?\nCount from 1 to 5.\n")
    runs = [("generate", ["--max-tokens", "16", "--json"], None), ("generate", ["--max-tokens", "16"], None),
            ("generate", ["--max-tokens", "16", "--prompts-file", str(tmp_path / "p.txt")], None),
            ("chat", ["--max-tokens", "16"], b"Who is Sven?\n")]
    unbuffered_runs = [(run, {"PYTHONUNBUFFERED": "1"}) for run in (runs[1], runs[3])]
    for (name, argv, given), unbuffered in [(run, {}) for run in runs] + unbuffered_runs:
        with open("/dev/full", "wb") as full:  # unbuffered (as many containers set), the write itself raises
            proc = command(name, *argv, input=given, stdout=full, stderr=subprocess.PIPE, env=unbuffered)
        err = proc.stderr.decode()
        assert proc.returncode == 1, (argv, proc.returncode, err)
        assert err.endswith("error: No space left on device: standard output\n") and "Exception" not in err, err


def test_a_prompts_file_prints_each_answer_once_it_and_those_before_are_done(tmp_path):
    """Answers come in file order as they are done, not all at the end: Ctrl-C keeps the ones printed (exit
    130, "interrupted"), and a reader of the output (a JSONL consumer) reads the first before the last is
    decoded."""
    import signal

    prompts = tmp_path / "many.txt"
    # more than a loaded machine decodes between the first answer and the signal (80 once all finished first)
    prompts.write_text("".join(f"Count from {i} to {i + 30}.\n" for i in range(1, 801)))
    proc = subprocess.Popen([sys.executable, "-m", "refusion_mlx.generate", "--prompts-file", str(prompts),
                             "--max-tokens", "128", "--batch-size", "2"], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    signals = []
    try:
        start = time.monotonic()
        first = proc.stdout.readline()  # the first answer, while the others decode
        # One suite run saw the signal come to nothing (exit 0 after every answer, nothing on stderr); ten
        # runs alone and under load did not. One known gap: MLX ignores SIGINT while its first kernel build
        # asks for g++ (system(3)), which came before the first answer whenever it was traced. A user
        # presses Ctrl-C again; so does this test, 30 s on, and it says when it signalled if that fails too.
        for wait in (30, 180):
            signals.append((round(time.monotonic() - start, 1), proc.poll()))
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                pass
        rest, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    lines = (first + rest).splitlines(keepends=True)
    seen = (proc.returncode, err, signals, first[:40], len(lines))  # (s after the start, exit status then)
    assert proc.returncode == 130 and err.endswith("interrupted\n"), seen
    assert first.startswith("[0] 1 2 3") and 1 <= len(lines) < 800, lines
    assert [line.split()[0] for line in lines] == [f"[{i}]" for i in range(len(lines))]
    assert all(line.endswith("\n") for line in lines)


def test_a_line_that_is_not_utf8_fails_its_turn_alone_in_any_locale(capsys):
    """The chat reads a line with a byte that is not UTF-8 as a UTF-8 locale does (the byte kept as such),
    under a strict one (PYTHONIOENCODING=utf-8:strict) too: that turn fails in one line and the next is
    answered; never a traceback. Any command's input read strictly elsewhere is one line too."""
    from refusion_mlx.cli import run

    for encoding in ("utf-8:strict", "utf-8"):
        proc = command("chat", "--max-tokens", "32", input=b"Who is \xff Sven?\nWho is Zoe?\n",
                       capture_output=True, env={"PYTHONIOENCODING": encoding})
        out, err = proc.stdout.decode(), proc.stderr.decode()
        assert proc.returncode == 1 and "Traceback" not in err, (encoding, err)
        assert "error: a user message is not valid UTF-8 text" in err and "Zoe" in out, (encoding, out, err)
    assert run(lambda: b"Who is \xff Sven?".decode("utf-8")) == 1
    assert capsys.readouterr().err == "error: an input is not utf-8 text (invalid start byte)\n"


def test_a_log_of_both_streams_has_each_answer_before_its_statistics(tmp_path):
    """``generate --verbose > log 2>&1``: the answer's line is ended and written before the statistics go to
    standard error (they ran into its last line, and its newline came last, at exit)."""
    (tmp_path / "p.txt").write_text("Who is Sven?\nCount from 1 to 5.\n")
    log = tmp_path / "log.txt"
    for argv in (["--prompt", "Who is Sven?"], ["--prompt", "Who is Sven?", "--json"],
                 ["--prompts-file", str(tmp_path / "p.txt")]):
        with open(log, "wb") as both:
            proc = command("generate", "--max-tokens", "32", "--verbose", *argv, stdout=both, stderr=both)
        lines = log.read_text().splitlines()
        assert proc.returncode == 0 and not log.read_text().endswith("\n\n"), log.read_text()
        answers = [i for i, line in enumerate(lines) if "Sven lives in" in line or line.startswith("[1] 1 ")]
        stats = [i for i, line in enumerate(lines) if "layout: blocks of" in line]
        assert len(answers) == len(stats) == (2 if "--prompts-file" in argv else 1), lines
        for answer, stat in zip(answers, stats):
            assert answer < stat and "layout: blocks" not in lines[answer], lines
            assert lines[stat].removeprefix("[0] ").removeprefix("[1] ").startswith("layout: "), lines


def test_ctrl_c_in_a_streamed_answer_ends_its_line_before_interrupted(capsys, monkeypatch):
    """``interrupted`` comes on a line of its own, as the chat's "[interrupted: ...]" does: it was written
    right after the partial answer ("0, 1, 2, 3interrupted")."""
    import refusion_mlx.generate as generate

    real = generate.stream_generate

    def interrupted(*args, **kwargs):
        for response in real(*args, **kwargs):
            yield response
            if response.text:
                raise KeyboardInterrupt

    monkeypatch.setattr(generate, "stream_generate", interrupted)
    assert generate.main(["--prompt", "Count from 1 to 40.", "--max-tokens", "64"]) == 130
    out, err = capsys.readouterr()
    assert out.startswith("1 ") and out.endswith("\n") and out.count("\n") == 1 and err == "interrupted\n", (out, err)


def test_a_file_a_full_disk_refuses_is_named(tmp_path):
    """A full disk's write error names no file: ``write_text`` (a report, a trace) names its own, so the
    one line says which output failed, not standard output's."""
    from refusion_mlx.cli.output import write_text

    for unbuffered in ({}, {"PYTHONUNBUFFERED": "1"}):
        proc = command("chat", "--max-tokens", "8", "--trace", "/dev/full", input=b"Who is Sven?\n",
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=unbuffered)
        err = proc.stderr.decode()
        assert proc.returncode == 1 and err.endswith("No space left on device: /dev/full\n"), err
    try:
        write_text("/dev/full", "x" * 10000)
    except OSError as e:
        assert e.filename == "/dev/full"
    else:
        raise AssertionError("a write to /dev/full did not fail")
