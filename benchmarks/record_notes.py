"""What a GPU record (``benchmarks.gpu_record``) lacks, and why, one note line each.

A record is made from whatever a run's folders hold: a CPU dry run's
``bench --shape`` replays no derived profile (``vs_ar`` is empty), a step
cut at its call's end or lost writes no file or half of one, a golden step
lost leaves ``golden`` null. The record keeps its shape either way; these
notes say which of the issue's targets (for the runtime's own attention)
and fields have no data, naming the step of ``benchmarks/gpu_record.sh``
that makes them and, where the files tell, why it is missing.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

WEIGHTS = {None: "bf16", 4: "4-bit"}
STEP = {None: "bf16", 4: "q4"}  # gpu_record.sh's names: fc-bf16, shape-q4, ...
# The targets a record needs, for the runtime's own attention: (kind, q_bits, what it compares)
REQUIRED = (("forward", None, "the 16-token forward against AR's one-token forward"),
            ("forward", 4, "the 16-token forward against AR's one-token forward"),
            ("vs_ar", None, "ReFusion / AR at 2.5 tokens per forward"),
            ("vs_ar", 4, "ReFusion / AR at 2.5 tokens per forward"),
            ("batched", None, "the batched replay of requests' forwards against one at a time"))


def _kind(label: str) -> Tuple[str, Optional[int]]:
    """(kind, q_bits) of a target of ``gpu_record.targets``, from its label."""
    kind = "forward" if label.startswith("a 16-token forward") else "vs_ar" if label.startswith("ReFusion") \
        else "batched"
    return kind, 4 if "(4-bit" in label else None


def _forward_why(q_bits: Optional[int], runs: List[dict]) -> str:
    name = f"fc-{STEP[q_bits]}.json"
    run = next((r for r in runs if r["file"] == name), None)
    if run is None:
        return f"no {name}: step fc-{STEP[q_bits]} is missing or failed"
    if run.get("complete") is False:
        return f"{name}'s run was cut before its end, before its 16-token forwards"
    return f"{name} has no 16-token forward beside AR's one-token forward at its KV length"


def _shape_why(q_bits: Optional[int], shapes: List[Tuple[str, str, dict]], batched: bool = False) -> str:
    """Why the runtime's ``bench --shape`` run in ``q_bits`` gave no ratio (``batched``: no batched speedup)."""
    step = f"shape-{STEP[q_bits]}"
    mine = [(name, run) for name, attention, run in shapes if attention == "auto" and run["q_bits"] == q_bits]
    if not mine:
        return f"no {step}-auto.json: step {step} is missing, failed or was cut (bench --shape writes at its end)"
    name, run = mine[0]
    derived = [p for p in run["profiles"] if p["source"] == "derived"]
    if not any(p.get("measured") for p in derived):
        if run.get("measured_on") != "gpu":
            return (f"not measured off a GPU: bench --shape replays the derived profiles on a GPU only, and "
                    f"{name} ran on {run.get('measured_on') or 'no device (--forecast-only)'}")
        return f"{name} measured no derived profile (tokens per forward out of reach: {run.get('out_of_reach')})"
    if batched:
        return f"{name} has no batched replay: step {step} runs bench --shape with --batch 8"
    return f"{name} measured no derived profile near 2.5 tokens per forward"


def notes(record: dict, shapes: List[Tuple[str, str, dict]]) -> List[str]:
    """One line per required target and field of ``record`` with no data, saying why where the files tell;
    ``shapes``: each ``bench --shape`` run read, as (file name, attention, its JSON)."""
    out = [f"note: {r['file']}'s run was cut before its end: the record holds the rows it finished"
           for r in record["runs"] if r.get("complete") is False]
    have = {_kind(t["target"]) for t in record["targets"] if ", attention " not in t["target"]}
    for kind, q_bits, what in REQUIRED:
        if (kind, q_bits) in have:
            continue
        if kind == "forward":
            why = _forward_why(q_bits, record["runs"])
        else:
            why = _shape_why(q_bits, shapes, batched=kind == "batched" and ("vs_ar", q_bits) in have)
        out.append(f"note: no target for {what} ({WEIGHTS[q_bits]}): {why}")
    if not record["vs_ar"]:
        ran_on = sorted({run.get("measured_on") or "no device" for _, _, run in shapes})
        why = ("no shape-*.json: the shape steps are missing, failed or were cut" if not shapes else
               f"not measured off a GPU: bench --shape replays the derived profiles on a GPU only, and its runs "
               f"ran on {', '.join(ran_on)}" if "gpu" not in ran_on else "no bench --shape run measured a profile")
        out.append(f"note: vs_ar is empty: {why}")
    if record["golden"] is None:
        out.append("note: golden is null: no golden cases' line in the log (step golden is missing or was cut)")
    return out
