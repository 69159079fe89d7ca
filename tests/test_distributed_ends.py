"""Two ranks that do not end well (started as ``mlx.launch`` starts them,
``tests/ranks.py``): a rank killed mid-answer ends generate and the chat
with one line (the server, which answers its open requests first:
``test_distributed.py``, on the server its other tests use); a collective
that goes silent times out; Ctrl-C stops every rank at the same step."""

import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import FIXTURE_MODEL
from tests.ranks import ROOT, start_ranks, wait_for


def test_a_killed_rank_ends_the_run_with_one_line(tmp_path):
    argv = ["--model", str(FIXTURE_MODEL), "--prompt", "Count to 1000.", "--max-tokens", "2000",
            "--block-length", "4"]
    procs = start_ranks(tmp_path, argv)
    try:
        assert procs[0].stdout.read(1)  # decoding has started on both ranks
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        _, err = procs[0].communicate(timeout=30)
        assert time.monotonic() - t0 < 20
    finally:
        for p in procs:
            p.kill()
            p.wait()
    err = err.decode()
    assert procs[0].returncode == 1
    lines = err.strip().splitlines()  # the backend's per-socket complaints are filtered out
    # the ring's error when MLX raises it; when the peer dies while an evaluation is in flight MLX
    # can wait for ever instead, and the watchdog (4 s here) ends the rank
    assert len(lines) == 1, err
    assert lines[0].startswith(("error: rank 0: lost the other ranks",
                                "error: rank 0: no progress from the other ranks for 4 s")), err


def test_a_killed_rank_ends_a_chat_with_one_line(tmp_path):
    """The chat as generate: a rank killed mid-answer is one error line on rank 0 and exit 1 (it was a
    traceback of the ring's RuntimeError)."""
    argv = ["--model", str(FIXTURE_MODEL), "--max-tokens", "2000", "--block-length", "4"]
    procs = start_ranks(tmp_path, argv, command="refusion_mlx.chat", feed=b"Count to 1000.\n")
    try:
        assert procs[0].stdout.read(1)  # the answer has started on both ranks
        procs[1].send_signal(signal.SIGKILL)
        _, err = procs[0].communicate(timeout=30)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    err = err.decode()
    assert procs[0].returncode == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith(("error: rank 0: lost the other ranks",
                                                    "error: rank 0: no progress from the other ranks")), err


def test_a_silent_collective_times_out_with_one_line():
    """A link that goes quiet (a peer stopped, a cable pulled) raises nothing:
    the watchdog ends the rank. (Shown here without a second rank; under
    mlx.launch a SIGSTOPped rank 1 gives rank 0 this line.)"""
    code = ("import time\nfrom refusion_mlx.distributed import watchdog\n"
            "watchdog.install(0, timeout=0.5)\n"
            "with watchdog.armed():\n    time.sleep(0.2)\n    watchdog.pet()\n    time.sleep(30)\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and time.monotonic() - t0 < 15
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: no progress from the other ranks for 0.5 s")


@pytest.mark.parametrize("pause", [0.5, 0.0])
def test_ctrl_c_in_a_two_rank_chat_stops_every_rank_at_the_same_step(tmp_path, pause):
    """Ctrl-C reaches every rank of the terminal's process group. Mid-answer it drops the turn on every rank
    at one step, and the chat goes on (the ranks stopped at different steps and waited on each other); at the
    prompt it ends the chat on every rank as Ctrl-C ends a command: "interrupted", exit 130 (rank 0 aborted
    once: its input thread was blocked in stdin). ``pause`` 0: Ctrl-C as the turn's summary is written,
    before rank 0 reads again (it ended rank 0 alone; rank 1 lost it, exit 1). The next turn is one the
    fixture model answers in a sentence (18 tokens; "Count from 1 to 5." ran on for 90, seconds of two
    ranks' decoding)."""
    argv = ["--model", str(FIXTURE_MODEL), "--max-tokens", "2000", "--block-length", "4"]
    procs = start_ranks(tmp_path, argv, timeout_s="20", command="refusion_mlx.chat", feed=b"Count to 1000.\n")
    try:
        wait_for(procs[0].stdout, b" ")  # the answer has started on both ranks
        for p in procs:
            p.send_signal(signal.SIGINT)
        wait_for(procs[0].stderr, b"[interrupted")
        procs[0].stdin.write(b"Who is Sven?\n")
        procs[0].stdin.flush()
        wait_for(procs[0].stderr, b"tokens/forward")  # the next turn is answered on both ranks
        time.sleep(pause)
        for p in procs:  # at the prompt, or on its way there
            p.send_signal(signal.SIGINT)
        out, err = procs[0].communicate(timeout=30)
        _, err1 = procs[1].communicate(timeout=30)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [130, 130], (err + err1).decode()
    assert err.decode().strip().splitlines()[-1] == "interrupted", err.decode()
    assert b"Traceback" not in err + err1 and b"Fatal" not in err + err1, (err + err1).decode()
