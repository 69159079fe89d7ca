"""Two ranks on loopback started as ``mlx.launch --backend ring`` starts
them -- each with ``MLX_RANK`` and ``MLX_HOSTFILE`` -- so that a test sees
each rank's own exit status and standard error (``tests/test_distributed*.py``):
a command's (:func:`start_ranks`), a server's once it answers
(:func:`two_rank_server`)."""

import contextlib
import http.client
import json
import os
import random
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import FIXTURE_MODEL

ROOT = Path(__file__).resolve().parents[1]


BAND = 1500  # ports a pytest worker draws its ranks' from
WORKERS = 8  # bands below the kernel's ephemeral range (one per xdist worker, gw0 to gw7, then again)


def _ephemeral_low() -> int:
    """The first port of the kernel's range for ``bind(0)`` and outgoing connections (Linux's default 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive ports free now (mlx.launch gives rank i ``--starting-port`` + i).

    Drawn from a band of this pytest worker's own below the ephemeral range. MLX's ring listens with
    SO_REUSEPORT: two groups whose ports overlap (ports another worker's ranks drew next to ours, which
    ``bind(0)`` handed out) both listened, and a rank's connection could reach the other group's rank; the
    rank it was meant for waited in ``accept`` for ever. A port in the ephemeral range could also be taken,
    before the rank it was chosen for listened there, as the local port of an outgoing connection: another
    test's, or rank 0's own connection to it, which then reached itself (TCP's self-connect)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    top = max(_ephemeral_low(), 1024 + BAND * WORKERS) - BAND * ((int(worker) if worker.isdigit() else 0) % WORKERS)
    rng = random.Random()  # not the tests' seeded generator: a rerun draws other ports
    for _ in range(100):
        base = rng.randrange(top - BAND, top - n + 1)
        socks = []
        try:
            for i in range(n):
                s = socket.socket()  # no SO_REUSEADDR/SO_REUSEPORT: a port anyone holds, listening or not, fails
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports in {top - BAND}-{top - 1}")


def start_ranks(tmp_path, argv, timeout_s="4", command="refusion_mlx.generate", feed=None, port=None):
    """Two ranks started as mlx.launch starts them (MLX_RANK, MLX_HOSTFILE),
    so the test sees rank 0's own exit status. ``timeout_s`` None: the
    collectives' default timeout (120 s)."""
    hostfile = tmp_path / "hosts.json"
    port = free_ports(2) if port is None else port  # the ranks' first (a caller's, drawn with its own)
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    procs = []
    for rank in range(2):
        env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile))
        env.pop("REFUSION_MLX_COLLECTIVE_TIMEOUT", None)
        if timeout_s is not None:
            env["REFUSION_MLX_COLLECTIVE_TIMEOUT"] = timeout_s
        own = argv[rank] if argv and isinstance(argv[0], list) else argv  # a list per rank, or one for both
        run = ["-m", command] if isinstance(command, str) else command  # a module, or the interpreter's arguments
        procs.append(subprocess.Popen([sys.executable, *run, *own], cwd=ROOT, env=env,
                                      stdin=subprocess.PIPE if feed is not None and rank == 0 else None,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    if feed is not None:  # rank 0 reads the user's lines (a chat); they reach the others by broadcast
        procs[0].stdin.write(feed)
        procs[0].stdin.flush()
    return procs


def wait_for(stream, needle: bytes, timeout: float = 60) -> bytes:
    """Read ``stream`` (a pipe) until ``needle`` shows; what was read."""
    seen, deadline = b"", time.monotonic() + timeout
    while needle not in seen:
        assert time.monotonic() < deadline, seen
        if select.select([stream], [], [], 0.5)[0]:
            chunk = os.read(stream.fileno(), 4096)
            assert chunk, seen
            seen += chunk
    return seen


def _get(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path)
    response = conn.getresponse()
    response.read()
    return response.status


@contextlib.contextmanager
def two_rank_server(folder, flags, timeout_s=None, model=FIXTURE_MODEL):
    """A server on two ranks, started as mlx.launch starts them, once it answers: (HTTP port, [rank 0, 1])."""
    ranks = free_ports(3)  # the ranks' two, then the HTTP port: all from this worker's band
    port = ranks + 2
    procs = start_ranks(folder, [*(["--model", str(model)] if model else []), "--port", str(port), *flags],
                         timeout_s=timeout_s, command="refusion_mlx.server", port=ranks)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if _get(port, "/health") == 200:
                    break
            except OSError:
                pass
            assert procs[0].poll() is None and time.monotonic() < deadline, procs[0].communicate()[1]
            time.sleep(0.2)
        yield port, procs
    finally:
        for p in procs:
            p.kill()
            p.wait()
