"""How the benchmark commands end: a failed start, Ctrl-C and a second Ctrl-C
while an in-process server shuts down (never an abort at interpreter exit)."""

import signal
import subprocess
import sys
import threading

import pytest

from refusion_mlx.serve.http_server import RefusionServer


def test_a_server_that_cannot_start_ends_in_one_line_exit_1():
    """The engine thread was still freeing its arrays when the process exited: exit 134 after the line."""
    proc = subprocess.run([sys.executable, "-m", "refusion_mlx.bench", "--concurrency", "1", "--http",
                           "--kv-bits", "4", "--kv-group-size", "128"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == ["error: kv_group_size 128 does not divide the model's head "
                                                "dimension 64"]


def test_a_start_cut_short_closes_the_server(monkeypatch):
    """Ctrl-C while the model loads: ``with server:`` never called close, the engine thread ran on."""
    server = RefusionServer(port=0, kv_bits=4, kv_group_size=128)

    def load():
        server.engine._thread.start()
        raise KeyboardInterrupt

    monkeypatch.setattr(server, "load", load)
    with pytest.raises(KeyboardInterrupt):
        with server:
            pass
    assert not server.engine._thread.is_alive() and server.socket.fileno() == -1


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals: main thread")
def test_a_second_interrupt_ends_at_once():
    from refusion_mlx.cli import interrupt_once, raise_interrupt_once

    def mine(signum, frame):
        pass

    before, term = signal.getsignal(signal.SIGINT), signal.signal(signal.SIGTERM, mine)
    try:
        with interrupt_once():
            assert signal.getsignal(signal.SIGINT) is raise_interrupt_once
            with pytest.raises(KeyboardInterrupt):
                raise_interrupt_once(signal.SIGINT, None)
            assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
        # SIGTERM's too, which the Ctrl-C set to SIG_DFL (it stayed so)
        assert signal.getsignal(signal.SIGINT) is before and signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, term)
