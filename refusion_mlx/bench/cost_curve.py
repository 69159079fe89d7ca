"""A device's measured cost of a forward by width (``benchmarks.forward_cost``),
and the profiles of ``bench --shape`` priced from it (``--cost-curve FILE``).

A roofline prices a forward by the bytes and FLOPs it needs; a backend's
kernels decide what it costs (on MLX's CUDA backend a 16-token forward of
ReFusion-8B cost 2-5x a one-token one where the roofline says 1x). The
curve is what the device measured: milliseconds per forward by phase,
width and cache length, and AR's one-token forward by cache length. Each
forward of a profile is priced at the curve's value for its phase (a
prefill or plan pass at ``plan``'s, a verify at ``verify``'s, an infill
pass at ``infill``'s), interpolated linearly in width and cache length
between the points measured and held at the ends (wider than measured: the
widest's cost grown in proportion to the width past it, which is what a
compute-bound forward does). A phase the curve has no rows of
(``gpu_record.sh``'s 4-bit run measures plan and infill only) is priced at
``plan``'s, and the report names it (:meth:`CostCurve.describe`). AR's prompt is priced as a plan pass of its
length, each token after it at AR's one-token forward.

The curve's rows are the runtime's own settings: measured with every switch
of :data:`SWITCHES` at its default (a GPU record's rows of
``REFUSION_MLX_OVERLAP=on`` or of the 4-bit padding off and on are a
candidate's, measured beside the runtime's, and priced nothing), and the
runtime's own choice of attention: ``auto`` rows where there are some, else
what ``auto`` takes on CUDA (``fused`` for one query row, ``unfused`` for
more: ``models.backend.fused_attention``).
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .suite import BenchError

# The runtime's switches a forward_cost run records (``switches``) and a GPU record tags each of its rows with,
# at their defaults: a row measured under another value is a candidate's, not the runtime's.
SWITCHES = {"overlap": "auto", "qmm_pad": "auto"}


def as_default(rows: Sequence[dict], switches: Optional[dict] = None) -> List[dict]:
    """The rows measured with every switch as the runtime sets it; ``switches``: the run's own (a
    ``forward_cost`` JSON's), for rows that carry none (a row without the tag, nor its run: the default)."""
    run = {**SWITCHES, **(switches or {})}
    return [r for r in rows if all(r.get(k, run[k]) == v for k, v in SWITCHES.items())]


PHASE_OF = {"prefill": "plan", "plan": "plan", "verify": "verify", "infill_draft": "infill",
            "infill_verify": "infill"}


def _interpolate(points: Sequence[Tuple[float, float]], x: float, grow: bool = False) -> float:
    """Linear between sorted (x, y) points, held at the ends; ``grow``: past
    the last point y grows in proportion to x."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        return points[-1][1] * (x / xs[-1] if grow else 1.0)
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class CostCurve:
    """Milliseconds per forward as one device measured them."""

    def __init__(self, rows: Sequence[dict], source: str = "", device: str = ""):
        self.source, self.device = source, device
        self.priced_as: Dict[str, str] = {}  # a phase with no rows -> the phase :meth:`ms` priced it at
        # (phase) -> kv -> [(width, ms)], and AR's kv -> ms
        self.table: Dict[str, Dict[int, List[Tuple[int, float]]]] = {}
        ar: Dict[int, float] = {}
        auto = any(r.get("attention") == "auto" for r in rows if r["phase"] != "ar")
        for r in rows:
            if r["phase"] == "ar":
                ar[r["kv_len"]] = r["ms"]
                continue
            wanted = "auto" if auto else ("fused" if r["width"] == 1 else "unfused")
            if r.get("attention", "auto") != wanted:
                continue
            self.table.setdefault(r["phase"], {}).setdefault(r["kv_len"], []).append((r["width"], r["ms"]))
        for by_kv in self.table.values():
            for points in by_kv.values():
                points.sort()
        self.ar = sorted(ar.items())
        if not self.table or not self.ar:
            raise BenchError(f"{source or 'the cost curve'}: no forwards of the runtime's attention and settings "
                             "(REFUSION_MLX_OVERLAP and REFUSION_MLX_QMM_PAD as it sets them) and no AR forward to "
                             "price against (measure with python -m benchmarks.forward_cost)")

    @classmethod
    def load(cls, path: str, dtype: str, q_bits: Optional[int], shape: Optional[str] = None) -> "CostCurve":
        """From a ``forward_cost`` JSON or a GPU record (``benchmarks/records``):
        its rows of ``dtype`` and ``q_bits``; one line naming the file and what
        is wrong if it is no cost curve, has none of those rows, or (``shape``
        given) measured another shape or does not say which (a curve of
        another shape prices nothing of this one)."""
        data = _read(path)
        if shape:
            measured = data.get("shape")
            if not isinstance(measured, str) or not measured:
                raise BenchError(f"{path} does not say which model shape it measured (no \"shape\"), so it "
                                 f"cannot price {shape}: add \"shape\": \"<the --shape it measured>\" to the file "
                                 "(benchmarks.forward_cost and benchmarks.gpu_record write it)")
            if measured != shape:
                raise BenchError(f"{path} measured {measured}, not {shape}")
        mine = [r for r in data["forward_cost"] if r.get("dtype") == dtype and r.get("q_bits") == q_bits]
        weights = f"{dtype}{f', {q_bits}-bit' if q_bits else ''}"
        if not mine:
            held = sorted({(r.get("dtype"), r.get("q_bits")) for r in data["forward_cost"]}, key=str)
            raise BenchError(f"{path} has no forwards in {weights}; it holds " + "; ".join(
                f"{d}{f', {q}-bit' if q else ''} (pass --dtype {d}{f' --q-bits {q}' if q else ''})"
                for d, q in held))
        mine = as_default(mine, data.get("switches"))  # a candidate's rows price nothing
        if not mine:
            raise BenchError(f"{path} has no forwards in {weights} with the runtime's settings, only a candidate's "
                             "(REFUSION_MLX_OVERLAP or REFUSION_MLX_QMM_PAD set otherwise than by default)")
        return cls(mine, str(path), data.get("device", ""))

    def ms(self, phase: str, width: int, kv: int) -> float:
        """One forward of ``width`` tokens after ``kv`` cached rows; a phase the curve has no rows of at
        ``plan``'s (a verify pass is a plan pass of its width), else at the first phase it has, and
        :attr:`priced_as` says so."""
        wanted = PHASE_OF.get(phase, phase)
        used = wanted if wanted in self.table else "plan" if "plan" in self.table else next(iter(self.table))
        if used != wanted:
            self.priced_as[wanted] = used
        per_kv = sorted((k, _interpolate(points, width, grow=True)) for k, points in self.table[used].items())
        return _interpolate(per_kv, kv)

    def describe(self) -> dict:
        """What a report says of the curve: its file, its device and each phase it priced from another's
        rows (``priced_as``: phase -> the phase whose rows priced it)."""
        return {"file": self.source, "device": self.device, "priced_as": dict(sorted(self.priced_as.items()))}

    def ar_ms(self, kv: int) -> float:
        return _interpolate(self.ar, kv)


def price(curve: CostCurve, forwards, prompt_tokens: Sequence[int], generated: Sequence[int],
          tokens: int) -> dict:
    """A profile's forwards and AR's for the same tokens, priced from the curve."""
    refusion = sum(curve.ms(s.phase, s.tokens, s.visible - s.tokens) for s in forwards) / 1000
    ar = 0.0
    for p, n in zip(prompt_tokens, generated):
        ar += curve.ms("plan", p, 0) + sum(curve.ar_ms(p + j) for j in range(1, n))
    ar /= 1000
    return {"refusion_seconds": round(refusion, 6), "ar_seconds": round(ar, 6),
            "refusion_tok_s": round(tokens / refusion, 3), "ar_tok_s": round(tokens / ar, 3),
            "ratio": round(ar / refusion, 4)}


# What a row of a curve must hold: key -> (its types, a check of its value, what it should be).
ROW_KEYS = {"phase": (str, lambda v: v in ("ar", "plan", "verify", "infill"), "ar, plan, verify or infill"),
            "width": (int, lambda v: v >= 1, "a positive integer"),
            "kv_len": (int, lambda v: v >= 0, "a whole number"),
            "ms": ((int, float), lambda v: v > 0, "a positive number of milliseconds")}


def _read(path: str) -> dict:
    """The JSON of ``path`` checked as a cost curve: a ``forward_cost`` list
    of rows, each with a phase, width, cache length and milliseconds."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise BenchError(f"{path} is a folder, not a cost curve file (--cost-curve)")
    if not p.exists():
        raise BenchError(f"{path}: no such file (--cost-curve)")
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise BenchError(f"cannot read {path}: {e.strerror or e} (--cost-curve)") from None
    except ValueError as e:
        raise BenchError(f"{path}: not JSON ({e}); --cost-curve takes the JSON of python -m "
                         "benchmarks.forward_cost or a record of benchmarks/records") from None
    if not isinstance(data, dict) or "forward_cost" not in data:
        raise BenchError(f"{path}: not a cost curve (no \"forward_cost\" list: the JSON of python -m "
                         "benchmarks.forward_cost or a record of benchmarks/records)")
    if not isinstance(data.get("switches", {}), dict):
        raise BenchError(f"{path}: \"switches\" is {data['switches']!r:.40}, not an object of the run's settings")
    rows = data["forward_cost"]
    if not isinstance(rows, list):
        raise BenchError(f"{path}: not a cost curve (\"forward_cost\" is {rows!r:.40}, not a list of rows)")
    for i, row in enumerate(rows):
        check_fields(f"{path}: forward_cost[{i}]", row, ROW_KEYS, "a row (an object)")
    return data


def check_fields(where: str, value, keys: dict, noun: str = "an object", required: bool = True) -> None:
    """``value`` is an object (else it is not ``noun``) and each of ``keys`` (key -> (its types, a check of
    its value, what it should be); ``required`` False: where present) is in it as it should be: otherwise
    one line naming ``where`` and what is wrong."""
    if not isinstance(value, dict):
        raise BenchError(f"{where} is not {noun}: {value!r:.40}")
    for key, (types, good, what) in keys.items():
        if key not in value and not required:
            continue
        got = value.get(key)
        if key not in value or isinstance(got, bool) or not isinstance(got, types) or not good(got):
            said = f"has no {key}" if key not in value else f"has {key} {got!r:.40}"
            raise BenchError(f"{where} {said}; it should be {what}")
