"""The GPU record's notes (benchmarks.record_notes): each of the issue's
targets and the record's fields with no data is said, with why, where a
CPU dry run, a cut step or a lost one left it out."""

import json
from pathlib import Path

from benchmarks import gpu_record

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"

AR = {"phase": "ar", "width": 1, "kv_len": 256, "dtype": "bfloat16", "q_bits": None, "ms": 8.0}
WIDE = {**AR, "phase": "plan", "width": 16, "attention": "auto", "ms": 10.0}
SHAPE = {"device": "x", "dtype": "bfloat16", "q_bits": None, "ar_tok_s": 9.0}
MEASURED = {"source": "derived", "tokens_per_forward": 2.5, "measured": {"tok_s": 20.0, "ratio": 2.2}}


def record(tmp_path, capsys, files, log="== golden cases, float32\n33 passed in 1s\n"):
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    (tmp_path / "log.txt").write_text(log)
    path = tmp_path / "record.json"
    assert gpu_record.main([str(tmp_path), "--commit", "x", "--record", str(path)]) == 0
    return json.loads(path.read_text()), [line for line in capsys.readouterr().out.splitlines()
                                          if line.startswith("note: ")]


def test_a_cpu_dry_runs_record_says_what_it_lacks_and_why(tmp_path, capsys):
    """The dry run's record had "vs_ar": [] and two targets, and said nothing of the rest."""
    rec, notes = record(tmp_path, capsys, {
        "fc-bf16.json": {"device": "x", "forward_cost": [AR, WIDE]},
        "shape-bf16-auto.json": {**SHAPE, "measured_on": "cpu", "profiles": [{**MEASURED, "measured": None}]},
        "shape-q4-auto.json": {**SHAPE, "q_bits": 4, "measured_on": "cpu", "profiles": []}}, log="")
    assert rec["vs_ar"] == [] and rec["golden"] is None and len(rec["targets"]) == 1  # the record's shape kept
    off_gpu = "not measured off a GPU: bench --shape replays the derived profiles on a GPU only"
    assert notes == [
        "note: no target for the 16-token forward against AR's one-token forward (4-bit): no fc-q4.json: "
        "step fc-q4 is missing or failed",
        f"note: no target for ReFusion / AR at 2.5 tokens per forward (bf16): {off_gpu}, and shape-bf16-auto.json "
        "ran on cpu",
        f"note: no target for ReFusion / AR at 2.5 tokens per forward (4-bit): {off_gpu}, and shape-q4-auto.json "
        "ran on cpu",
        f"note: no target for the batched replay of requests' forwards against one at a time (bf16): {off_gpu}, and "
        "shape-bf16-auto.json ran on cpu",
        f"note: vs_ar is empty: {off_gpu}, and its runs ran on cpu",
        "note: golden is null: no golden cases' line in the log (step golden is missing or was cut)"]


def test_a_cut_or_lost_step_is_named(tmp_path, capsys):
    """A shape step cut (no file), a cut 4-bit instrument run, a shape run without --batch: each said."""
    rec, notes = record(tmp_path, capsys, {
        "fc-bf16.json": {"device": "x", "forward_cost": [AR, WIDE]},
        "fc-q4.json": {"device": "x", "complete": False, "forward_cost": [{**AR, "q_bits": 4}]},
        "shape-bf16-auto.json": {**SHAPE, "measured_on": "gpu", "profiles": [MEASURED]}})
    assert rec["golden"] and rec["vs_ar"] and len(rec["targets"]) == 2
    assert notes == [
        "note: fc-q4.json's run was cut before its end: the record holds the rows it finished",
        "note: no target for the 16-token forward against AR's one-token forward (4-bit): fc-q4.json's run was "
        "cut before its end, before its 16-token forwards",
        "note: no target for ReFusion / AR at 2.5 tokens per forward (4-bit): no shape-q4-auto.json: step "
        "shape-q4 is missing, failed or was cut (bench --shape writes at its end)",
        "note: no target for the batched replay of requests' forwards against one at a time (bf16): shape-bf16-auto.json "
        "has no batched replay: step shape-bf16 runs bench --shape with --batch 8"]


def test_a_whole_record_has_no_notes(tmp_path, capsys):
    """And its 8-request target says what it measured: the forwards of 8 requests replayed in one batch
    (bench --shape --batch 8), which the record called "8 requests at once" as if it were the server's."""
    batched = {**MEASURED, "batched": {"requests": 8, "speedup": 4.0}}
    four = {**AR, "q_bits": 4}
    rec, notes = record(tmp_path, capsys, {
        "fc-bf16.json": {"device": "x", "forward_cost": [AR, WIDE]},
        "fc-q4.json": {"device": "x", "forward_cost": [four, {**WIDE, "q_bits": 4}]},
        "shape-bf16-auto.json": {**SHAPE, "measured_on": "gpu", "profiles": [batched]},
        "shape-q4-auto.json": {**SHAPE, "q_bits": 4, "measured_on": "gpu", "profiles": [MEASURED]}})
    assert notes == []
    (eight,) = [t for t in rec["targets"] if "batch" in t["target"]]
    assert eight["target"].startswith("8 requests' forwards replayed in one batch (bench --shape --batch")
    assert "not the HTTP server" in eight["target"] and eight["met"]
    text = DOCS.read_text()
    table = text[text.index("### Targets (`python -m benchmarks.gpu_record`)"):text.index("### Kernels per forward")]
    assert "| 8 concurrent" not in table and "`bench --shape --batch 8`" in table and "not the HTTP server" in table
    assert "left to a device that has one" in table and "(#many-requests-at-once)" in table
