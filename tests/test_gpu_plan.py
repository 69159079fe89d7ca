"""The lent GPU's prepared run (docs/benchmarks.md, "On a lent GPU"):
benchmarks/gpu_record.sh and benchmarks/gpu_wheels.sh, run here with a
stand-in Python that records each measurement's command instead of running it."""

import datetime
import json
import os
import shutil
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
# REFUSION_MLX_* settings they ran under) and answers as FAKE_RC says; its
# default device is a GPU unless FAKE_NO_GPU is set.
FAKE = """#!/usr/bin/env bash
case "$*" in
  "-c "*"DeviceType.gpu"*) [ -z "${FAKE_NO_GPU:-}" ] || exit 3; exit 0 ;;
  "-m benchmarks.forward_cost"*|"-m refusion_mlx.bench"*|"-m pytest"*)
    echo "$(env | grep '^REFUSION_MLX_' | sort | tr '\\n' ' ')| $*" >> "$FAKE_LOG"
    [ "$2" = pytest ] && echo "33 passed, 47 deselected in 1.00s"
    exit "${FAKE_RC:-0}" ;;
esac
exec "%s" "$@"
"""


def runner(folder: Path):
    """The script's runs under the stand-in Python, kept in ``folder``: (process, the measurements' commands)."""
    python = folder / "python"
    python.write_text(FAKE % sys.executable)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    log = folder / "calls.txt"

    def run(*args, rc=0, env=None):
        proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHON": str(python), "FAKE_LOG": str(log), "FAKE_RC": str(rc),
                                   **(env or {})})
        calls = log.read_text().splitlines() if log.is_file() else []
        log.unlink(missing_ok=True)
        return proc, calls

    return run


@pytest.fixture
def fake(tmp_path):
    return runner(tmp_path)


@pytest.fixture(scope="module")
def forced(tmp_path_factory):
    """Every step in one call (--force), run once (a run's Pythons take a CPU-second) for the tests that read its
    commands, its log (every step's lines, the golden runs' among them) or run.json: (process, calls, folder)."""
    folder = tmp_path_factory.mktemp("forced")
    proc, calls = runner(folder)("--force", str(folder / "out"))
    return proc, calls, folder / "out"


def test_every_step_name_is_checked_before_any_runs(fake, tmp_path):
    """A typo after a valid step used to cost the valid step's device time, then exit 2."""
    proc, calls = fake(str(tmp_path / "out"), "golden", "shape-bf17")
    assert proc.returncode == 2 and calls == []
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "unknown step shape-bf17" in proc.stderr


def test_a_real_shape_off_a_gpu_is_refused_in_one_line(fake, tmp_path):
    """At refusion-8b on a machine whose MLX has no GPU the script built 8B bf16
    weights on the CPU (killed for memory), then went on to a step estimated at hours."""
    proc, calls = fake(str(tmp_path / "out"), "fc-bf16", env={"FAKE_NO_GPU": "1"})
    assert proc.returncode == 2 and calls == [] and not (tmp_path / "out").exists()
    (line,) = proc.stderr.strip().splitlines()
    assert "not a GPU" in line and "SHAPE=tiny" in line
    proc, calls = fake(str(tmp_path / "dry"), "fc-bf16", env={"FAKE_NO_GPU": "1", "SHAPE": "tiny"})
    assert proc.returncode == 0 and len(calls) == 1  # the dry run runs anywhere
    proc = subprocess.run(["bash", str(SCRIPT), "--plan", "fc-bf16"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "FAKE_NO_GPU": "1"})
    assert proc.returncode == 0 and "total: about 120 s" in proc.stdout  # the plan runs nothing


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


def test_a_candidate_switch_run_skips_ar(forced):
    """A run under a candidate switch (overlap on, the 4-bit padding off/on) timed
    AR's forward too, rows the record tags with the switch and drops: time spent for nothing."""
    _, calls, _ = forced
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


def test_every_step_in_one_call_is_refused_unless_forced(fake, forced, tmp_path):
    """Every step in one call needs more than a command's 10 minutes at refusion-8b."""
    assert plan() > 540
    proc, calls = fake(str(tmp_path / "out"))
    assert proc.returncode == 2 and calls == [] and not (tmp_path / "out").exists()
    (line,) = proc.stderr.strip().splitlines()
    assert "more than one call's 540 s" in line and "--force" in line
    proc, calls, _ = forced  # the same call with --force
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
        assert len(files) + 2 <= 8, files  # and log.txt, run.json


def test_every_command_the_script_makes_parses(forced, monkeypatch):
    """The instrument's and bench's own parsers accept each command the steps
    make (as docs/benchmarks.md's 4-bit padding command once did not)."""
    from benchmarks import forward_cost
    from refusion_mlx.bench import __main__ as bench

    _, calls, _ = forced
    assert len(calls) >= 12
    monkeypatch.setattr(forward_cost, "run", lambda body: 0)
    monkeypatch.setattr(bench, "run", lambda body: 0)
    mains = {"benchmarks.forward_cost": forward_cost.main, "refusion_mlx.bench": bench.main}
    for call in calls:
        argv = shlex.split(call.split("| ", 1)[1])
        if argv[1] in mains:
            assert mains[argv[1]](argv[2:]) == 0, call


def test_the_record_labels_every_golden_run(forced):
    """The CPU paths' run was the third entry of the record's golden line, unlabelled."""
    from benchmarks import gpu_record

    proc, _, out = forced
    assert proc.returncode == 0
    assert gpu_record.golden_line(out / "log.txt") == "; ".join(
        f"{label}: 33 passed, 47 deselected in 1.00s" for label in ("auto", "bucketed", "the CPU paths, on the device"))


def _git(cwd, *args):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def test_a_record_names_the_runs_day_and_the_commit_it_measured(tmp_path):
    """The record's commit was the HEAD where it was assembled, its date that
    day: now both come from the run's run.json, the commit found from the hash
    of the files the device's copy (no .git) measured."""
    from benchmarks import gpu_record, run_stamp
    from refusion_mlx.errors import RefusionError

    repo = tmp_path / "repo"
    for rel, text in (("refusion_mlx/a.py", "A = 1\n"), ("benchmarks/b.py", "B = 2\n"),
                      ("benchmarks/records/r.json", "{}\n"), ("docs/x.md", "x\n")):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    _git(tmp_path, "init", "-q", str(repo))
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    first = _git(repo, "rev-parse", "HEAD")
    assert run_stamp.stamp(repo)["commit"] == first  # where git works, the stamp names it too
    device = tmp_path / "device"  # a lent GPU's copy: no .git, its caches and a new record beside the files
    shutil.copytree(repo, device, ignore=shutil.ignore_patterns(".git"))
    (device / "refusion_mlx" / "__pycache__").mkdir()
    (device / "refusion_mlx" / "__pycache__" / "a.cpython-312.pyc").write_bytes(b"\0")
    (device / "benchmarks" / "records" / "new.json").write_text("{}\n")
    (device / "docs" / "x.md").write_text("changed\n")
    stamped = run_stamp.stamp(device)
    assert stamped["commit"] is None and stamped["tree"] == run_stamp.commit_tree(repo, first)
    assert stamped["date"] == datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    (repo / "refusion_mlx" / "a.py").write_text("A = 2\n")  # the code moves on after the run
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "two")
    call2, call3 = tmp_path / "call2", tmp_path / "call3"
    for out in (call2, call3):
        out.mkdir()
        (out / "run.json").write_text(json.dumps({**stamped, "date": "2026-11-28"}))
    assert gpu_record.provenance([call2, call3], root=repo) == {"commit": first, "tree": stamped["tree"],
                                                                "date": "2026-11-28"}
    (device / "refusion_mlx" / "a.py").write_text("A = 3\n")  # measured from files no commit has
    (call3 / "run.json").write_text(json.dumps(run_stamp.stamp(device)))
    assert gpu_record.provenance([call3], root=repo)["commit"] == "uncommitted"
    with pytest.raises(RefusionError, match="the calls measured 2 trees"):
        gpu_record.provenance([call2, call3], root=repo)
    assert gpu_record.provenance([call2, call3], "abc", root=repo)["commit"] == "abc"


def test_the_script_stamps_its_folder(forced):
    from benchmarks import run_stamp

    proc, _, out = forced
    assert proc.returncode == 0
    stamped = json.loads((out / "run.json").read_text())
    assert stamped["tree"] == run_stamp.files_tree(ROOT)
    assert stamped["date"] == datetime.datetime.now(datetime.timezone.utc).date().isoformat()


def test_a_python_without_mlx_lm_ends_the_script_in_one_line_before_any_step(fake, tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['mlx_lm'] = None\n")
    proc, calls = fake(str(tmp_path / "out"), "golden", env={"PYTHONPATH": f"{hide}{os.pathsep}{ROOT}"})
    assert proc.returncode == 1 and calls == [], proc.stdout
    (line,) = proc.stdout.strip().splitlines()  # the script's output and its log.txt
    assert "cannot import mlx, mlx_lm and pytest" in line
    assert fake(str(tmp_path / "out"), "golden")[0].returncode == 0  # the same, with mlx_lm


@pytest.fixture
def no_cuda(tmp_path):
    """A PATH whose loader knows no library (ldconfig) and whose ldd answers LDD's lines."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, body in (("ldconfig", "exit 0"), ("ldd", 'printf "$LDD"')):
        (bin_ / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_ / name).chmod(0o755)

    def run(mode, site, ldd=""):
        env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "PYTHON": sys.executable, "SITE": str(site),
               "LDD": ldd, "LD_LIBRARY_PATH": ""}
        return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_wheels.sh"), mode], capture_output=True,
                              text=True, env=env, timeout=120)

    return run


def test_the_wheels_name_a_missing_cuda_library_in_one_line(no_cuda, tmp_path):
    """mlx-cuda-13 is carried without its NVIDIA dependencies: a machine
    without one of their libraries is one line naming it, not a run that fails later."""
    proc = no_cuda("verify", tmp_path / "nowhere")  # before the wheels are unpacked: the loader's view
    assert proc.returncode == 1 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("mlx-cuda-13 cannot load here: libcuda.so.1 libcudnn.so.9") and "nvidia-cudnn-cu13" in line
    lib = tmp_path / "site" / "mlx" / "lib"
    lib.mkdir(parents=True)
    (lib / "libmlx.so").write_bytes(b"")
    proc = no_cuda("verify", tmp_path / "site", "\\tlibcudnn.so.9 => not found\\n\\tlibc.so.6 => /lib/libc.so.6\\n")
    assert proc.returncode == 1 and "cannot load here: libcudnn.so.9 not found (it needs" in proc.stderr
    proc = no_cuda("verify", tmp_path / "site", "\\tlibc.so.6 => /lib/libc.so.6\\n")  # all there, but no GPU here
    (line,) = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and line.endswith("(the CUDA driver and runtime) fails: mlx computes on "
                                                  "Device(cpu, 0), not a GPU"), line
    proc = no_cuda("unpack", tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == "usage: benchmarks/gpu_wheels.sh [prepare|check|install|verify]"


def documented_commands(tools):
    """``(file, tool, arguments)`` of every ``python -m TOOL ...`` in README.md and
    docs/*.md: code blocks' lines (continuations joined) and inline code spans."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        spans = []
        for i, part in enumerate(re.split(r"^```[^\n]*\n", path.read_text(), flags=re.M)):
            if i % 2:  # a code block
                spans += [line.split(" #")[0] for line in re.sub(r"\\\n\s*", " ", part).splitlines()]
            else:
                spans += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", part)]
        for span in spans:
            for tool in tools:
                m = re.search(rf"python -m {re.escape(tool)}(?=\s|$)(.*)", span)
                if m and "..." not in m[1]:  # "..." elides flags
                    found.append((path.name, tool, re.split(r"&&|\|", m[1])[0].strip()))
    return found


def test_every_documented_instrument_command_parses(monkeypatch, capsys):
    """docs/benchmarks.md's 4-bit padding command left out --phases plan and
    exited 2 (an infill pass of 7 tokens is not whole slots of 4)."""
    from benchmarks import forward_cost
    from refusion_mlx.bench import __main__ as bench

    monkeypatch.setattr(forward_cost, "run", lambda body: 0)
    monkeypatch.setattr(bench, "run", lambda body: 0)
    mains = {"benchmarks.forward_cost": forward_cost.main, "refusion_mlx.bench": bench.main}
    commands = documented_commands(mains)
    assert sum(tool == "benchmarks.forward_cost" for _, tool, _ in commands) >= 4
    bad = []
    for name, tool, args in commands:
        try:
            rc = mains[tool](shlex.split(args))
        except SystemExit as e:
            rc = e.code
        if rc:
            bad.append(f"{name}: python -m {tool} {args}: {capsys.readouterr().err.strip()}")
    assert not bad, bad


def test_the_instrument_warns_that_bf16_on_the_cpu_is_for_parity(capsys):
    from benchmarks import forward_cost

    with pytest.raises(SystemExit):
        forward_cost.main(["--help"])
    assert "bfloat16 is for parity, not speed" in " ".join(capsys.readouterr().out.split())


def test_a_half_precision_run_on_the_cpu_says_how_long_it_takes(capsys):
    """--dtype bfloat16 --q-bits 4 on the CPU took hours at qwen3-0.6b (12.5 s a one-token forward) and said
    so only in --help: the run now says at its start, from a one-token forward it times, what it will take."""
    import mlx.core as mx

    from benchmarks import forward_cost

    if mx.default_device() == mx.gpu:
        pytest.skip("the note is the CPU's")
    argv = ["--shape", "tiny", "--widths", "1,4", "--kv", "16", "--repeat", "1", "--phases", "plan", "--no-split",
            "--no-ar", "--json", "-"]
    assert forward_cost.main(argv + ["--dtype", "bfloat16", "--q-bits", "4"]) == 0
    err = capsys.readouterr().err.splitlines()
    (note,) = [line for line in err if line.startswith("note: bfloat16, 4-bit on the CPU is for parity")]
    assert "a one-token forward took" in note and "this run's 4 forwards and parts take" in note  # 2 widths x 2
    assert err.index(note) < min(i for i, line in enumerate(err) if line.startswith("auto plan width"))
    assert forward_cost.main(argv) == 0  # float32: nothing to say
    assert "parity" not in capsys.readouterr().err


def test_the_nsys_step_traces_where_nsys_is_and_costs_nothing_where_not(fake, tmp_path):
    """MLX's CUDA backend names each op's host work in an NVTX range; the step
    records them under nsys (its summaries come back, its forwards stay out of the record)."""
    out = tmp_path / "out"
    if not subprocess.run(["bash", "-c", "command -v nsys"], capture_output=True).returncode == 0:
        proc, calls = fake(str(out), "nsys")
        assert proc.returncode == 0 and calls == [] and "nsys: not on this machine" in proc.stdout
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "nsys").write_text("""#!/usr/bin/env bash
if [ "$1" = profile ]; then while [[ $1 != --output=* ]]; do shift; done; shift; exec "$@"; fi
while [ "$1" != --output ]; do shift; done
touch "$2_nvtx_sum.csv" "$2_cuda_gpu_kern_sum.csv"
""")
    (bin_ / "nsys").chmod(0o755)
    proc, calls = fake(str(out), "nsys", env={"PATH": f"{bin_}:{os.environ['PATH']}"})
    assert proc.returncode == 0 and f"nsys: {bin_ / 'nsys'}" in proc.stdout
    (call,) = calls
    assert "-m benchmarks.forward_cost" in call and "--json" not in call
    assert sorted(p.name for p in out.glob("nsys*")) == ["nsys_cuda_gpu_kern_sum.csv", "nsys_nvtx_sum.csv"]


def test_the_docs_give_the_commands_the_script_runs():
    """The docs gave fc-q4-pad's command as --phases plan --widths 2,4,7,8 (the script runs more flags), the
    H200 record's 0.97x without the --dtype bfloat16 its rows need, and the bench flag table lacked --batch and
    --cost-curve."""
    text = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    script = " ".join(SCRIPT.read_text().replace("\\\n", " ").split())
    pad = "--q-bits 4 --attention bucketed --phases plan --widths 1,2,4,7,8 --kv 1024 --no-ar --no-split"
    assert pad in script and f"REFUSION_MLX_QMM_PAD=off python -m benchmarks.forward_cost --shape refusion-8b " \
                              f"--dtype bfloat16 {pad}" in text
    assert "--dtype bfloat16 --q-bits 4 --forecast-only --cost-curve benchmarks/records/nvidia-h200-2026-11-28.json` " \
           "gives 0.97x" in text
    assert "| `--batch N` | with `--shape`" in text and "| `--cost-curve FILE` | with `--shape`" in text
