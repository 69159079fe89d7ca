"""Shared fixtures. Importing refusion_mlx first lets it preload an optimized BLAS."""

import gc
import json
import os
import threading
from pathlib import Path

# MKL's OpenMP threads spin for 200 ms after each parallel region before they sleep (KMP_BLOCKTIME): with
# two test workers on two cores, one worker's spinning threads took the other's core (the convert and
# half-precision tests ~10% more CPU, 3.5 against 0.5 CPU-s for the half-precision ones). Set before MKL
# loads (below), for the subprocesses too; a setting of the user's is kept.
os.environ.setdefault("KMP_BLOCKTIME", "0")

import refusion_mlx  # noqa: F401,E402  (before mlx.core)
import numpy as np
import pytest

from refusion_mlx._startup import freeze_imports  # noqa: E402
from refusion_mlx.models.loading import load  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
pytest_plugins = ["tests.browser"]  # the web page's browser: the chromium fixture, the line when it is missing


def blas_lines():
    """The BLAS the tests' matmuls run on (and its threads): the reference one
    makes the suite ~10x slower, and then one more line says how to fix it."""
    from refusion_mlx import _blas

    warning = _blas.reference_warning()
    return [f"BLAS: {_blas.describe()}"] + ([f"WARNING: {warning}"] if warning else [])


AGENTS_SKIPPED = "the coding agents' tests did not run"


def pytest_terminal_summary(terminalreporter):
    """One line when the coding agents' tests skipped (``-q`` shows no skip reasons), with how to run them."""
    reasons = [r.longrepr[2] if isinstance(r.longrepr, tuple) else str(r.longrepr)
               for r in terminalreporter.stats.get("skipped", [])]
    missing = [r for r in reasons if "npm install --prefix .ci/agents" in r]
    if missing:
        terminalreporter.write_line(f"{AGENTS_SKIPPED}: {missing[0].removeprefix('Skipped: ')}")


# pytest-xdist gives each worker one file at a time (--dist loadfile). Left to itself it queues the files with
# the most tests first, which put the longest one last (the new-family fine-tune: 4 tests, ~60 s) while the
# other worker ran out of files. These go first, longest first (wall seconds on a 2-core VM; the coding
# agents' and the browser's skip where node or chromium is missing), and the rest in collection order.
LONGEST_FIRST = ("test_new_family.py", "test_convert.py", "test_backend.py", "test_train.py",
                 "test_coding_agents.py", "test_web.py", "test_web_turns.py", "test_cli_streams.py",
                 "test_limits.py", "test_distributed.py", "test_distributed_start.py", "test_server_ops.py",
                 "test_server.py", "test_generate.py", "test_distributed_ends.py")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # xdist's --no-loadscope-reorder: the order below stands
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: a file's tests keep their order


def pytest_collection(session):
    """On a fresh clone pytest rewrites each test module's asserts as it first imports it, and caches the
    result; every worker imports the modules in one order, so each rewrote them all. Every other worker
    (gw1, gw3, ...) imports them last first: two workers each rewrite about half and read the rest from
    the other's cache (their collection on a two-core VM: 12.0 s -> 9.7 s). Collection, which finds them
    imported, keeps its own order. The worker's id is xdist's own, not ``PYTEST_XDIST_WORKER``: a test's
    pytest in a child process inherits that variable (it imported every module too: 1.3 s -> 16 s)."""
    worker = getattr(session.config, "workerinput", {}).get("workerid", "")
    if not (worker.startswith("gw") and worker[2:].isdigit() and int(worker[2:]) % 2):
        return
    import importlib

    for path in sorted(Path(__file__).parent.glob("test_*.py"), reverse=True):
        try:
            importlib.import_module(f"tests.{path.stem}")
        except Exception:  # noqa: BLE001 (collection imports it again and reports what fails, as ever)
            pass


def pytest_sessionstart(session):
    """Written at the top of every run, ``-q`` included (which hides pytest's own header)."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        for line in blas_lines():
            reporter.write_line(line)


# Objects the test process has made since it last froze (imports, mostly: transformers' ~100k, the API
# SDKs' ~200k) past which the next test file starts by freezing them (``_startup.freeze_imports``)
FREEZE_PAST = 20_000


@pytest.fixture(autouse=True, scope="module")
def imports_out_of_the_collector():
    """Each test file starts with the imports before it out of the cyclic collector's scans, as the server
    command does: every in-process server's close collects its cycles (``Engine._release``), and a full
    collection over a test process's imports took 0.2-0.4 s; all collections were ~7% of the server tests'
    time. Not while an engine runs (its arrays must stay collectable before its streams are freed)."""
    if len(gc.get_objects(generation=2)) > FREEZE_PAST and not any(
            t.name == "refusion-engine" for t in threading.enumerate()):
        freeze_imports()
    yield


@pytest.fixture(scope="session")
def demo():
    """The golden fixture model (the demo model the reference decoded) in float32."""
    return load(FIXTURES / "tiny-refusion", dtype="float32")


@pytest.fixture(scope="session")
def golden_cases():
    return json.loads((FIXTURES / "golden_outputs.json").read_text())


@pytest.fixture(scope="session")
def golden_logits():
    return dict(np.load(FIXTURES / "golden_logits.npz"))


@pytest.fixture
def set_paths(monkeypatch):
    """Set REFUSION_MLX_PATHS and have the runtime read it (a model load
    would); the environment and the mode as read are restored after."""
    from refusion_mlx.models import backend

    def set_to(value):
        monkeypatch.setenv(backend.ENV, value)
        return backend.mode()

    yield set_to
    monkeypatch.undo()
    backend.mode()
