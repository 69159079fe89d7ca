"""What ``benchmarks.forward_cost`` says of its timings: each row's spread
over its repeats, the machine's load, the warnings, and the tables.

A timing on a shared machine is the device's cost plus whatever the other
jobs took from it, and a median of a few repeats hides how much that was.
So every row carries its fastest and slowest repeat beside the median
(``ms_min``, ``ms_max``, and ``spread``: their difference over the median),
the run carries the load average at its start and end, and a run whose
load exceeded the cores or whose repeats spread widely says so in one line
each: numbers to read as an upper bound, not the device's.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional, Sequence

import numpy as np

from refusion_mlx.bench.report import format_table

PARTS = ("proj", "mlp", "attn", "head")
# A row whose slowest repeat is this much (of the median) above its fastest is noisy: warned about.
SPREAD_WARN = 0.5


def load_now() -> Optional[List[float]]:
    """The 1, 5 and 15-minute load averages (None where the system has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def spread(seconds: Sequence[float]) -> dict:
    """A row's timing in ms: the median (``ms``), the fastest and slowest
    repeat, and ``spread`` = (slowest - fastest) / median (None for one repeat)."""
    ms = sorted(1000 * t for t in seconds)
    mid = float(np.median(ms))
    return {"ms": round(mid, 4), "ms_min": round(ms[0], 4), "ms_max": round(ms[-1], 4),
            "spread": round((ms[-1] - ms[0]) / mid, 3) if len(ms) > 1 and mid > 0 else None}


def _name(r: dict) -> str:
    if r["phase"] == "ar":
        return f"AR at {r['kv_len']}"
    return f"{r['attention']} {r['phase']} width {r['width']} at {r['kv_len']}"


def warnings(result: dict) -> List[str]:
    """One line each: a load average above the cores (at the start, the end
    or between), repeats that spread by more than :data:`SPREAD_WARN`."""
    out = []
    load = result.get("load") or {}
    cores = load.get("cores") or 0
    seen = [(when, v[0] if isinstance(v, list) else v) for when, v in
            (("start", load.get("start")), ("end", load.get("end")), ("peak", load.get("peak_1min")))
            if v is not None]
    hot = [(when, v) for when, v in seen if cores and v > cores]
    if hot:
        out.append(f"the load average was above the {cores} cores ({', '.join(f'{v:g} at the {w}' for w, v in hot)}):"
                   " other work shared the machine, so these times are the device's plus theirs (read the min "
                   "column, and measure again when the machine is quiet)")
    rows = [r for r in result["rows"] + result["ar"] if r.get("spread") is not None]
    wide = [r for r in rows if r["spread"] > SPREAD_WARN]
    if wide:
        worst = max(wide, key=lambda r: r["spread"])
        out.append(f"{len(wide)} of {len(rows)} rows' repeats differ by more than {SPREAD_WARN:.0%} of their "
                   f"median (worst: {_name(worst)}, {worst['ms_min']:.3f}-{worst['ms_max']:.3f} ms): the "
                   "medians and ratios of those rows are noise as much as cost (more --repeat, or a quieter "
                   "machine)")
    return out


def _pct(r: dict) -> str:
    return "-" if r.get("spread") is None else f"{100 * r['spread']:.0f}%"


def _other(r: dict) -> str:
    if r.get("other") is not None:
        return f"{r['other']:.3f}"
    return "<0" if r.get("split_exceeds_total") else "-"


def print_tables(result: dict, file=None) -> None:
    """The rows, AR's one-token forwards, the machine's load and the key, on
    ``file`` (default standard output)."""
    file = file or sys.stdout
    split = any("proj" in r for r in result["rows"])
    parts = list(PARTS) if split else []
    headers = ["attention", "phase", "width", "kv", "ms", "min", "spread", "build"] + parts \
        + (["other"] if split else []) + ["x AR"]
    body = [[r["attention"], r["phase"], r["width"], r["kv_len"], f"{r['ms']:.3f}", f"{r['ms_min']:.3f}", _pct(r),
             f"{r['build_ms']:.3f}"] + [f"{r[p]:.3f}" for p in parts] + ([_other(r)] if split else [])
            + [f"{r['x_ar']:.2f}" if "x_ar" in r else "-"] for r in result["rows"]]
    print(format_table(headers, body, left=[0, 1]), file=file)
    if result["ar"]:
        print(file=file)
        print(format_table(["AR one-token forward", "kv", "ms", "min", "spread", "build", "forwards"],
                           [["mlx-lm", r["kv_len"], f"{r['ms']:.3f}", f"{r['ms_min']:.3f}", _pct(r),
                             f"{r['build_ms']:.3f}", r["samples"]] for r in result["ar"]]), file=file)
    load = result.get("load") or {}
    if load.get("start") is not None:
        print(f"\nload average (1, 5, 15 min) on {load['cores']} cores: {load['start']} at the start, "
              f"{load.get('end')} at the end, {load.get('peak_1min')} at most (1 min) between", file=file)
    exceeds = sum(1 for r in result["rows"] if r.get("split_exceeds_total"))
    print("\nkv: the cache length a row starts from (its forwards: a new length each, a few rows past it, "
          "kv_range in the JSON; --fixed-kv: kv each); "
          "ms per forward: median of the repeats, min the fastest, spread (slowest - fastest) / median; build: "
          "the host's part before the evaluation (Python building the graph; on the CPU paths and with "
          "REFUSION_MLX_OVERLAP=on, also the first layers computed meanwhile)"
          + (f"; parts timed alone, each less an empty evaluation ({result['sync_ms']:.3f} ms): proj the q/k/v/o "
             "projections, mlp, attn attention with its K/V write, head the LM head, other the whole less the "
             "parts" if split else "")
          + (f" (<0: in {exceeds} of {len(result['rows'])} rows the parts alone took longer than the whole "
             "forward, as ops the whole runs side by side do on a CPU, or as other work slowed the parts' timing: "
             "there they are shares, not a sum)" if exceeds else "")
          + ("; x AR: the forward over mlx-lm's one-token forward at the same cache length timed right after "
             "it, median of the repeats' ratios" if result["ar"] else ""), file=file)
