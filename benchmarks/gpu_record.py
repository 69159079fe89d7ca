"""A GPU record from what ``benchmarks/gpu_record.sh OUT`` wrote:

    python -m benchmarks.gpu_record OUT [OUT ...] [--log LOG] [--commit SHA] [--record benchmarks/records/NAME.json]

Reads each OUT's ``fc-*.json`` (``benchmarks.forward_cost``),
``shape-<weights>-<attention>.json`` (``bench --shape``) and ``log.txt``
(one OUT per device call: each call's files come back in a folder of their
own) and writes one JSON record (default ``benchmarks/records/<device>-<date>.json``):
``device``, ``mlx_version``, ``commit`` (the commit whose files the run
measured, found from the ``tree`` its ``run.json`` stamped, or
``uncommitted``), ``tree``, ``date`` (the run's UTC day),
``shape`` (the model shape every run measured, ``--shape``: what
``bench --cost-curve`` checks a record against),
``forward_cost`` (every forward timed: ``{phase, width, kv_len, dtype,
q_bits, ms}`` and its attention mode and parts; AR's one-token forward as
``phase: "ar"``, width 1), ``runs`` (each forward-cost run's machine load,
warnings and BLAS), ``vs_ar`` (every derived profile of every
``bench --shape`` run: ``{tokens_per_forward, dtype, q_bits,
refusion_tok_s, ar_tok_s, ratio}``, its attention mode, and with
``--batch`` the requests' forwards replayed in one batch against one at a
time: what a server batch runs, not a measurement of the HTTP server), ``golden`` (the
float32 golden cases' pytest summary line from the log) and ``targets``:
the issue's three, each met or not with the numbers that decide it, for
the runtime's own attention and for each candidate measured beside it
(``bucketed``), the other switches as the runtime sets them; and
``decisions``: for each switch measured both ways (bucketed attention,
``REFUSION_MLX_OVERLAP=on``, the 4-bit padding; a run's ``switches``), the
candidate's time against the other's over forwards alike in all else, and
which of the two the numbers suggest for ``auto``. It prints each target,
then a note for each target or field with no data and why
(``benchmarks.record_notes``), then the decisions.
"""

from __future__ import annotations

import datetime
import json
import re
import sys
from pathlib import Path
from typing import List, Optional

from refusion_mlx.bench.cost_curve import ROW_KEYS, SWITCHES, as_default, check_fields
from refusion_mlx.cli import OneLineParser, run
from refusion_mlx.errors import RefusionError

from . import record_notes
from .run_stamp import CHECKOUT, tree_commit

RECORDS = Path(__file__).resolve().parent / "records"
SHAPE_FILE = re.compile(r"shape-(?P<weights>[a-z0-9]+)-(?P<attention>[a-z]+)\.json$")


def _given(_value) -> bool:
    return True


NUMBER = (int, float)


def _name(what: str) -> tuple:
    return str, bool, what  # bool: not empty


# What each file of a call's folder must hold for the record: key -> (its types, a check, what it should be)
# (``cost_curve.check_fields``); a file that does not is one line naming it and what it lacks.
FC_KEYS = {"forward_cost": (list, _given, "the list of rows python -m benchmarks.forward_cost writes"),
           "device": _name("the device it ran on")}
OPTIONAL = {"shape": _name("the model shape it measured")}
FC_OPTIONAL = {**OPTIONAL, "switches": (dict, lambda v: all(isinstance(x, str) for x in v.values()),
                                        "an object of the run's settings, each a name")}
FC_ROW_KEYS = {**ROW_KEYS, "dtype": _name("the weights' dtype"),
               "q_bits": ((int, type(None)), _given, "the weights' bits or null")}
ATTENTION = {"attention": ((str, type(None)), _given, "the attention mode (AR's rows: null or none)")}
SHAPE_KEYS = {"profiles": (list, _given, "the list of profiles python -m refusion_mlx.bench --shape writes"),
              "device": FC_KEYS["device"], "dtype": FC_ROW_KEYS["dtype"], "q_bits": FC_ROW_KEYS["q_bits"],
              "ar_tok_s": ((*NUMBER, type(None)), _given, "AR's tokens per second or null")}
PROFILE_KEYS = {"source": _name("derived or recorded")}
MEASURED_KEYS = {"tokens_per_forward": (NUMBER, _given, "a number"),
                 "measured": (dict, _given, "an object with tok_s and ratio")}
SPEED_KEYS = {"tok_s": (NUMBER, _given, "a number"), "ratio": (NUMBER, _given, "a number")}
BATCHED_KEYS = {"requests": (int, _given, "a number of requests"), "speedup": (NUMBER, _given, "a number")}
STAMP_KEYS = {"tree": _name("the files' id (python -m benchmarks.run_stamp)"), "date": _name("the run's day")}
STAMP_OPTIONAL = {"commit": ((str, type(None)), _given, "a commit or null")}


def _load(path: Path, keys: dict, optional: Optional[dict] = None) -> dict:
    """The JSON object of ``path`` with each of ``keys`` (and of ``optional``, where present) as it should
    be: else one line naming the file and what is missing."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise RefusionError(f"{path}: not a JSON file of the GPU record ({e})") from None
    check_fields(str(path), data, keys, "a JSON object of the GPU record")
    check_fields(str(path), data, optional or {}, required=False)
    return data


def _fc_run(path: Path) -> dict:
    """A ``forward_cost`` run's JSON, every row checked."""
    run = _load(path, FC_KEYS, FC_OPTIONAL)
    for i, row in enumerate(run["forward_cost"]):
        check_fields(f"{path}: forward_cost[{i}]", row, FC_ROW_KEYS, "a row (an object)")
        check_fields(f"{path}: forward_cost[{i}]", row, ATTENTION, required=row["phase"] != "ar")
    return run


def _shape_run(path: Path) -> dict:
    """A ``bench --shape`` run's JSON, every profile the record reads checked."""
    run = _load(path, SHAPE_KEYS, OPTIONAL)
    for i, p in enumerate(run["profiles"]):
        where = f"{path}: profiles[{i}]"
        check_fields(where, p, PROFILE_KEYS, "a profile (an object)")
        if p["source"] == "derived" and p.get("measured"):
            check_fields(where, p, MEASURED_KEYS)
            check_fields(f"{where}.measured", p["measured"], SPEED_KEYS)
            if p.get("batched"):
                check_fields(f"{where}.batched", p["batched"], BATCHED_KEYS)
    return run


def _files(outs: List[Path], pattern: str) -> List[Path]:
    return [path for out in outs for path in sorted(out.glob(pattern))]


def forward_costs(outs: List[Path]) -> List[dict]:
    """Every row of the folders' ``fc-*.json``, each with the switches its run had."""
    rows = []
    for path in _files(outs, "fc-*.json"):
        run = _fc_run(path)
        switches = {**SWITCHES, **run.get("switches", {})}
        rows += [{**r, **switches} for r in run["forward_cost"]]
    return rows


def run_conditions(outs: List[Path]) -> List[dict]:
    """Each forward-cost run's file with the machine's load while it ran and its warnings (a busy device's
    timings say so in the record too), and ``complete`` false where the run was cut before its end (its JSON
    holds the rows it finished)."""
    return [{"file": path.name, **{k: run[k] for k in ("load", "warnings", "blas", "complete") if k in run}}
            for path in _files(outs, "fc-*.json") for run in [_fc_run(path)]]


def shape_runs(outs: List[Path]) -> List[tuple]:
    """Each ``bench --shape`` run of the folders: (its file's name, its attention mode, its JSON)."""
    return [(path.name, m["attention"], _shape_run(path)) for path in _files(outs, "shape-*.json")
            for m in [SHAPE_FILE.search(path.name)] if m]


def versus_ar(outs: List[Path]) -> List[dict]:
    """Each derived profile measured (on a GPU only: bench --shape replays none elsewhere) against AR."""
    rows = []
    for _, attention, r in shape_runs(outs):
        for p in r["profiles"]:
            if p["source"] != "derived" or not p.get("measured"):
                continue
            row = {"tokens_per_forward": p["tokens_per_forward"], "dtype": r["dtype"], "q_bits": r["q_bits"],
                   "attention": attention, "refusion_tok_s": p["measured"]["tok_s"],
                   "ar_tok_s": r["ar_tok_s"], "ratio": p["measured"]["ratio"]}
            if p.get("batched"):
                row["batched"] = p["batched"]
            rows.append(row)
    return rows


PART_NAMES = ("proj", "mlp", "attn", "head", "other")


def _median(values: List[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def _mean_parts(rows: List[dict]) -> dict:
    """Mean ms of each op class over rows split by op class."""
    split = [r for r in rows if "proj" in r]
    out = {}
    for k in PART_NAMES:  # "other" is None where the parts alone added up to more than the whole
        values = [r[k] for r in split if r.get(k) is not None]
        if values:
            out[k] = round(sum(values) / len(values), 3)
    return out


def _closest(rows: List[dict], key: str, value: float) -> List[dict]:
    best = min((abs(r[key] - value) for r in rows), default=None)
    return [r for r in rows if best is not None and abs(r[key] - value) == best]


def _build_ms(wide: List[dict], ar: List[dict]) -> dict:
    """Median ms of building the graphs in Python, for the 16-token forwards
    and for AR's (records from before forward_cost timed it have none)."""
    if not all("build_ms" in r for r in wide + ar) or not wide or not ar:
        return {}
    return {"build_ms_width_16": round(_median([r["build_ms"] for r in wide]), 3),
            "build_ms_ar": round(_median([r["build_ms"] for r in ar]), 3)}


# The attention modes whose targets a record reports: the runtime's own
# choice (``auto``, or ``unfused`` where no ``auto`` row is: what ``auto``
# takes on CUDA for several query rows), and each candidate measured beside it.
CANDIDATES = ("bucketed",)


def targets(forward_cost: List[dict], vs_ar: List[dict], attention: str = "auto") -> List[dict]:
    """The issue's targets against what was measured with ``attention``
    (``auto``: the runtime's choice; or a candidate of :data:`CANDIDATES`),
    the other switches as the runtime sets them."""
    out = []
    forward_cost = as_default(forward_cost)  # a candidate's rows are compared in decisions
    named = "" if attention == "auto" else f", attention {attention}"
    ar = {(r["dtype"], r["q_bits"], r["kv_len"]): r["ms"] for r in forward_cost if r["phase"] == "ar"}
    for q_bits, limit in ((None, 1.5), (4, 2.0)):
        mine = [r for r in forward_cost if r["phase"] != "ar" and r["width"] == 16 and r["q_bits"] == q_bits]
        chosen = [r for r in mine if r["attention"] == attention] or (
            [r for r in mine if r["attention"] == "unfused"] if attention == "auto" else [])
        ratios = [r["ms"] / ar[(r["dtype"], q_bits, r["kv_len"])] for r in chosen
                  if (r["dtype"], q_bits, r["kv_len"]) in ar]
        if ratios:
            narrow = [r for r in forward_cost if r["phase"] != "ar" and r["width"] == 1 and r["q_bits"] == q_bits
                      and r["attention"] in ("auto", "fused")]
            wide, one = _mean_parts(chosen), _mean_parts(narrow)
            grew = {k: round(wide[k] - one.get(k, 0.0), 3) for k in wide}
            out.append({"target": f"a 16-token forward at most {limit}x AR's one-token forward "
                                  f"({'bf16' if q_bits is None else f'{q_bits}-bit'}{named}), every phase and KV length",
                        "measured_worst": round(max(ratios), 3), "measured_median": round(_median(ratios), 3),
                        "met": max(ratios) <= limit, "parts_ms_width_16": wide, "parts_ms_width_1": one,
                        "held_back_by": max(grew, key=grew.get) if grew else None, "growth_ms": grew,
                        **_build_ms(chosen, [r for r in forward_cost if r["phase"] == "ar" and r["q_bits"] == q_bits])})
    for q_bits, limit in ((None, 1.5), (4, 1.3)):
        rows = [r for r in vs_ar if r["q_bits"] == q_bits and r["attention"] == attention]
        at = _closest(rows, "tokens_per_forward", 2.5)
        if at:
            out.append({"target": f"ReFusion / AR at least {limit}x at 2.5 tokens per forward "
                                  f"({'bf16' if q_bits is None else f'{q_bits}-bit'}{named})",
                        "measured": at[0]["ratio"], "met": at[0]["ratio"] >= limit})
            if at[0].get("batched"):
                speedup = at[0]["batched"]["speedup"]
                n = at[0]["batched"]["requests"]  # forward_replay.time_batched: no server, no HTTP
                out.append({"target": f"{n} requests' forwards replayed in one batch (bench --shape --batch: what a "
                                      f"server batch of {n} runs, not the HTTP server) at least 3x one at a time "
                                      f"({'bf16' if q_bits is None else f'{q_bits}-bit'}{named}, 2.5 tok/fwd)",
                            "measured": speedup, "met": speedup >= 3})
    return out


# What each switch was measured against: (switch, candidate value, the value it would replace, the
# forwards compared); a candidate that takes at most CHOOSE of the time is suggested for auto.
COMPARED = (("attention", "bucketed", "auto", "forwards of 2 tokens or more"),
            ("overlap", "on", "auto", "forwards of any width"),
            ("qmm_pad", "on", "off", "quantized forwards of 2 to 7 tokens"))
CHOOSE = 0.95


def _compared(row: dict, switch: str) -> bool:
    """Whether ``row`` is a forward ``switch`` is compared on (:data:`COMPARED`)."""
    if row["phase"] == "ar":
        return False
    if switch == "qmm_pad":  # its runs are made for it: the other switches as they were
        return bool(row["q_bits"]) and 2 <= row["width"] < 8
    if any(row.get(k, v) != v for k, v in SWITCHES.items() if k != switch):
        return False  # a forward of another switch's candidate
    return row["width"] >= 2 if switch == "attention" else True


def decisions(forward_cost: List[dict]) -> List[dict]:
    """For each switch of :data:`COMPARED` measured both ways: the ratio of the
    candidate's ms to the other's over forwards alike in everything else
    (median, best, worst, how many), and what the numbers suggest."""
    out = []
    for switch, candidate, other, which in COMPARED:
        def key(r):
            return tuple(r.get(k) for k in ("phase", "width", "kv_len", "dtype", "q_bits", "attention", "overlap",
                                            "qmm_pad") if k != switch)

        rows = [r for r in forward_cost if _compared(r, switch)]
        against = {key(r): r["ms"] for r in rows if r.get(switch) == other}
        ratios = sorted(r["ms"] / against[key(r)] for r in rows if r.get(switch) == candidate and key(r) in against)
        if not ratios:
            continue
        median = _median(ratios)
        out.append({"switch": switch, "candidate": candidate, "against": other, "forwards": which,
                    "pairs": len(ratios), "median_ratio": round(median, 3), "best_ratio": round(ratios[0], 3),
                    "worst_ratio": round(ratios[-1], 3),
                    "suggests": candidate if median <= CHOOSE else other})
    return out


def golden_line(*logs: Path) -> Optional[str]:
    """The golden cases' pytest summary from the logs: the line itself, or
    ``label: line`` for each run the script labelled (``golden cases, float32
    (attention auto)``: ``auto``; ``(the CPU paths, on the device)``: that), joined by "; "."""
    text = "".join(log.read_text(errors="replace") for log in logs if log.is_file())
    parts = re.split(r"golden cases, float32(?: \(([^)\n]*)\))?", text)
    found = []
    for label, text in zip(parts[1::2], parts[2::2]):
        line = re.search(r"^\d+ passed.*$|^.*failed.*$", text, re.M)
        if line:
            label = label and re.sub(r"^attention ", "", label)
            found.append(f"{label}: {line.group(0).strip()}" if label else line.group(0).strip())
    return "; ".join(found) or None


def provenance(outs: List[Path], commit: Optional[str] = None, root: Path = CHECKOUT) -> dict:
    """``commit``, ``tree`` and ``date`` of the runs in ``outs``, from their ``run.json``
    (``benchmarks.run_stamp``): the commit of ``root`` whose files the runs measured
    (``commit`` given: that one), or ``uncommitted``; the first run's UTC day."""
    stamps = [_load(out / "run.json", STAMP_KEYS, STAMP_OPTIONAL) for out in outs if (out / "run.json").is_file()]
    trees = sorted({s["tree"] for s in stamps})
    if len(trees) > 1 and not commit:
        raise RefusionError(f"the calls measured {len(trees)} trees ({', '.join(t[:12] for t in trees)}): "
                            "one record is one tree's (--commit names the one to record)")
    if not stamps:  # folders from before the runs were stamped
        return {"commit": commit or "unknown", "date": datetime.date.today().isoformat()}
    found = commit or next((s["commit"] for s in stamps if s.get("commit")), None) or tree_commit(trees[0], root)
    return {"commit": found or "uncommitted", "tree": trees[0], "date": min(s["date"] for s in stamps)}


def build(outs: List[Path], log: Optional[Path] = None, commit: Optional[str] = None, root: Path = CHECKOUT) -> dict:
    """The record of the runs in ``outs`` (the golden line from ``log``, else from each folder's log.txt)."""
    fc = forward_costs(outs)
    shapes = [p for p in _files(outs, "shape-*.json") if SHAPE_FILE.search(p.name)]
    if not fc and not shapes:
        where = " ".join(str(out) for out in outs)
        raise RefusionError(f"{where}: no fc-*.json or shape-*.json (run benchmarks/gpu_record.sh OUT first)")
    runs = [_fc_run(path) for path in _files(outs, "fc-*.json")] + [_shape_run(path) for path in shapes]
    first = runs[0]
    devices = {run["device"] for run in runs}
    if len(devices) > 1:
        raise RefusionError(f"the runs were made on {len(devices)} devices ({', '.join(sorted(devices))}): "
                            "one record is one device's")
    device = first["device"]
    measured = {run.get("shape") for run in runs} - {None}
    if len(measured) > 1:
        raise RefusionError(f"the runs measured {len(measured)} model shapes ({', '.join(sorted(measured))}): "
                            "one record is one shape's")
    vs = versus_ar(outs)
    mlx_version = first.get("mlx_version") or "unknown"
    logs = [log] if log else [out / "log.txt" for out in outs]
    return {"device": device, "mlx_version": mlx_version, **provenance(outs, commit, root),
            "shape": next(iter(measured), None), "golden": golden_line(*logs),
            "forward_cost": fc, "runs": run_conditions(outs), "vs_ar": vs,
            "targets": [t for mode in ("auto", *CANDIDATES) for t in targets(fc, vs, mode)],
            "decisions": decisions(fc)}


def record_name(device: str, date: str) -> str:
    """``nvidia-h200-2026-11-28.json`` from ``gpu (NVIDIA H200)``."""
    inner = re.search(r"\((.*)\)", device)
    name = re.sub(r"[^a-z0-9]+", "-", (inner.group(1) if inner else device).lower()).strip("-")
    return f"{name or 'gpu'}-{date}.json"


def main(argv: Optional[List[str]] = None) -> int:
    parser = OneLineParser(prog="python -m benchmarks.gpu_record",
                           description="Make a GPU record from what benchmarks/gpu_record.sh wrote.")
    parser.add_argument("out", nargs="+", help="the folders benchmarks/gpu_record.sh wrote (one per device call)")
    parser.add_argument("--log", help="the log with the golden cases' line (default: each OUT's log.txt)")
    parser.add_argument("--commit", help="the commit measured (default: the one whose files each OUT's run.json "
                                         "stamped, found in this checkout; else uncommitted)")
    parser.add_argument("--record", help="where to write (default benchmarks/records/<device>-<date>.json)")
    args = parser.parse_args(argv)

    def body() -> int:
        outs = [Path(out).expanduser() for out in args.out]
        for out in outs:
            if not out.is_dir():
                raise RefusionError(f"{out}: no such folder")
        record = build(outs, Path(args.log) if args.log else None, args.commit)
        path = Path(args.record) if args.record else RECORDS / record_name(record["device"], record["date"])
        if not path.parent.is_dir():
            raise RefusionError(f"cannot write {path}: its folder does not exist")
        path.write_text(json.dumps(record, indent=1) + "\n")
        for t in record["targets"]:
            print(f"{'met    ' if t['met'] else 'MISSED '} {t['target']}: "
                  f"{t.get('measured', t.get('measured_worst'))}"
                  + (f" (median {t['measured_median']}; held back by {t['held_back_by']}: {t['growth_ms']} ms "
                     "more than a 1-token forward)" if "measured_median" in t else ""))
        for line in record_notes.notes(record, shape_runs(outs)):
            print(line)
        for d in record["decisions"]:
            print(f"{d['switch']} {d['candidate']} against {d['against']}: {d['median_ratio']}x the time "
                  f"(median of {d['pairs']} {d['forwards']}; {d['best_ratio']}-{d['worst_ratio']}x): "
                  f"suggests {d['suggests']}")
        print(f"wrote {path}")
        return 0

    return run(body)


if __name__ == "__main__":
    sys.exit(main())
