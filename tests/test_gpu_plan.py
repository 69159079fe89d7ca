"""The lent GPU's prepared run (docs/benchmarks.md, "On a lent GPU"):
benchmarks/gpu_record.sh and benchmarks/gpu_wheels.sh, run here with a
stand-in Python that records each measurement's command instead of running it."""

import os
import re
import shlex
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
    _, calls = fake(str(tmp_path / "out"), "fc-q4-pad", "fc-overlap")
    switched = [c for c in calls if "REFUSION_MLX_OVERLAP=on" in c or "REFUSION_MLX_QMM_PAD=" in c]
    assert switched and all("--no-ar" in c.split() for c in switched), switched


ESSENTIAL = ["fc-bf16", "fc-q4", "shape-bf16", "shape-q4", "golden"]  # what issue 49 needs first, in that order


def plan(*steps) -> int:
    """gpu_record.sh --plan's total for ``steps``, in seconds."""
    proc = subprocess.run(["bash", str(SCRIPT), "--plan", *steps], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return int(re.search(r"total: about (\d+) s", proc.stdout)[1])


def documented_calls():
    """The step lists of docs/benchmarks.md's gpu_record.sh calls on a lent GPU."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    section = text[text.index("### On a lent GPU: the whole run"):]
    block = section[section.index("```bash"):section.index("```\n", section.index("```bash") + 3)]
    return [line.split("$OUT", 1) for line in block.splitlines() if "gpu_record.sh" in line and "$OUT" in line]


def test_the_steps_come_in_the_order_issue_49_needs_them():
    listed = subprocess.run(["bash", str(SCRIPT), "--plan"], capture_output=True, text=True, timeout=60).stdout
    assert [line.split()[0] for line in listed.splitlines()[:5]] == ESSENTIAL


def test_every_step_in_one_call_is_refused_unless_forced(fake, tmp_path):
    """Every step in one call needs more than a command's 10 minutes at refusion-8b."""
    assert plan() > 540
    proc, calls = fake(str(tmp_path / "out"))
    assert proc.returncode == 2 and calls == [] and not (tmp_path / "out").exists()
    (line,) = proc.stderr.strip().splitlines()
    assert "more than one call's 540 s" in line and "--force" in line
    proc, calls = fake("--force", str(tmp_path / "out"))
    assert proc.returncode == 0 and len(calls) >= 12, proc.stdout
    assert sum(c.endswith("test_every_golden_case_in_one_batch_is_token_exact") for c in calls) == 3
    assert sum("--batch" in c.split() for c in calls) == 1  # 8 at once: bf16, the runtime's attention
    proc, calls = fake(str(tmp_path / "small"), env={"SHAPE": "tiny"})  # a dry run: the estimates are 8B's
    assert proc.returncode == 0 and len(calls) >= 12


def test_a_budget_skips_the_steps_that_would_end_past_it(fake, tmp_path):
    proc, calls = fake("--budget", "100", str(tmp_path / "out"), "fc-bf16", "golden")
    assert proc.returncode == 0 and len(calls) == 1 and "-m pytest" in calls[0]
    assert "== skipped fc-bf16: about 120 s" in (tmp_path / "out" / "log.txt").read_text()


def test_each_documented_call_fits_one_command_and_brings_back_at_most_8_files(fake, tmp_path):
    calls = documented_calls()
    assert len(calls) == 3 and "--budget SECONDS" in calls[-1][0]  # the last: what the lease still holds
    assert [s for _, steps in calls[:2] for s in steps.split()][:5] == ESSENTIAL
    for i, (_, steps) in enumerate(calls):
        steps = steps.split()
        assert plan(*steps) <= 540, steps
        _, made = fake(str(tmp_path / f"call{i}"), *steps)
        files = {c.split()[c.split().index("--json") + 1] for c in made if "--json" in c.split()}
        assert len(files) + 1 <= 8, files  # and log.txt


def test_every_command_the_script_makes_parses(fake, tmp_path, monkeypatch):
    """The instrument's and bench's own parsers accept each command the steps
    make (as docs/benchmarks.md's 4-bit padding command once did not)."""
    from benchmarks import forward_cost
    from refusion_mlx.bench import __main__ as bench

    _, calls = fake("--force", str(tmp_path / "out"))
    assert len(calls) >= 12
    monkeypatch.setattr(forward_cost, "run", lambda body: 0)
    monkeypatch.setattr(bench, "run", lambda body: 0)
    mains = {"benchmarks.forward_cost": forward_cost.main, "refusion_mlx.bench": bench.main}
    for call in calls:
        argv = shlex.split(call.split("| ", 1)[1])
        if argv[1] in mains:
            assert mains[argv[1]](argv[2:]) == 0, call


def test_the_record_labels_every_golden_run(fake, tmp_path):
    """The CPU paths' run was the third entry of the record's golden line, unlabelled."""
    from benchmarks import gpu_record

    out = tmp_path / "out"
    assert fake(str(out), "golden", "golden-bucketed", "golden-cpu")[0].returncode == 0
    assert gpu_record.golden_line(out / "log.txt") == "; ".join(
        f"{label}: 33 passed, 47 deselected in 1.00s" for label in ("auto", "bucketed", "the CPU paths, on the device"))
