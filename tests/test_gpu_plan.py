"""The lent GPU's prepared run (docs/benchmarks.md, "On a lent GPU"):
benchmarks/gpu_record.sh and benchmarks/gpu_wheels.sh, run here with a
stand-in Python that records each measurement's command instead of running it."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_record.sh"

# A Python that runs everything but the measurements: those it logs (with the
# REFUSION_MLX_* settings they ran under) and answers as FAKE_RC says.
FAKE = """#!/usr/bin/env bash
case "$*" in
  "-m benchmarks.forward_cost"*|"-m refusion_mlx.bench"*|"-m pytest"*)
    echo "$(env | grep '^REFUSION_MLX_' | sort | tr '\\n' ' ')| $*" >> "$FAKE_LOG"
    [ "$2" = pytest ] && echo "33 passed, 47 deselected in 1.00s"
    exit "${FAKE_RC:-0}" ;;
esac
exec "%s" "$@"
"""


@pytest.fixture
def fake(tmp_path):
    python = tmp_path / "python"
    python.write_text(FAKE % sys.executable)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "calls.txt"

    def run(*args, rc=0, env=None):
        proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHON": str(python), "FAKE_LOG": str(log), "FAKE_RC": str(rc),
                                   **(env or {})})
        calls = log.read_text().splitlines() if log.is_file() else []
        log.unlink(missing_ok=True)
        return proc, calls

    return run


def test_every_step_name_is_checked_before_any_runs(fake, tmp_path):
    """A typo after a valid step used to cost the valid step's device time, then exit 2."""
    proc, calls = fake(str(tmp_path / "out"), "golden", "shape-bf17")
    assert proc.returncode == 2 and calls == []
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "unknown step shape-bf17" in proc.stderr


def test_the_script_keeps_its_own_log_and_exit_status(fake, tmp_path):
    """The documented calls piped the script into tee, so a call's status was
    tee's (always 0); the script now writes OUT/log.txt itself and exits with
    the number of steps that failed."""
    out = tmp_path / "out"
    proc, calls = fake(str(out), "fc-bf16", rc=3)
    log = (out / "log.txt").read_text()
    assert proc.returncode == log.count("step failed: 3") == len(calls) >= 1
    assert f"done: {len(calls)} failed" in log and log == proc.stdout
    proc, _ = fake(str(out), "golden")  # appended: a second call into the same folder keeps the first's lines
    assert proc.returncode == 0 and (out / "log.txt").read_text().startswith(log)


def test_a_candidate_switch_run_skips_ar(fake, tmp_path):
    """A run under a candidate switch (overlap on, the 4-bit padding off/on) timed
    AR's forward too, rows the record tags with the switch and drops: time spent for nothing."""
    _, calls = fake(str(tmp_path / "out"), "fc-bf16", "fc-q4")
    switched = [c for c in calls if "REFUSION_MLX_OVERLAP=on" in c or "REFUSION_MLX_QMM_PAD=" in c]
    assert switched and all("--no-ar" in c.split() for c in switched), switched
