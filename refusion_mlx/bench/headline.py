"""The comparison's headline: ratios of the same work, not of whatever each
side happened to write.

Tokens per second alone rewards runaway output: a side that writes garbage
until the budget runs makes many tokens fast, and a side that answers with
EOS alone makes one token slowly. So the summary leads with two ratios that
compare the same work, each side's answers as they are:

* **time to answer** over every prompt: the sum of AR's wall times over the
  sum of ReFusion's (each prompt answered once by each side, however long
  the answer). Above 1: ReFusion answers the suite sooner.
* **tokens/s on matched prompts**: the prompts where both sides stopped at
  EOS (not at the budget) with answers of about the same length (within
  ``LENGTH_TOLERANCE`` of the longer, or one token), or with identical
  answers; over those, ReFusion's tokens/s over AR's (tokens summed, wall
  summed). This is the decoder's speed on comparable answers.

The tokens/s ratio over all prompts stays, as a secondary figure, with how
many prompts each side ended at the budget ("length").
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

LENGTH_TOLERANCE = 0.10  # matched lengths: within 10% of the longer answer (or one token)


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """a / b rounded, None when either is missing or b is 0."""
    return round(a / b, 4) if a is not None and b else None


def match(rf: dict, ar: dict) -> Optional[str]:
    """How a prompt's two answers compare: "identical" ids, "length" (both
    stopped at EOS, lengths within the tolerance) or None (not the same work)."""
    if rf["output_ids"] == ar["output_ids"]:
        return "identical"
    a, b = rf["generated_tokens"], ar["generated_tokens"]
    if rf["finish_reason"] == ar["finish_reason"] == "stop" and abs(a - b) <= max(1, LENGTH_TOLERANCE * max(a, b)):
        return "length"
    return None


def _sum(cases: Sequence[dict], side: str, key: str) -> float:
    return sum(c[side][key] for c in cases)


def summary(cases: Sequence[dict]) -> Dict[str, object]:
    """The headline's numbers from the cases (each with ``refusion`` and ``ar``
    side dicts and their ``match``)."""
    matched = [c for c in cases if c["match"] is not None]
    rf_wall, ar_wall = _sum(cases, "refusion", "wall_seconds"), _sum(cases, "ar", "wall_seconds")
    out: Dict[str, object] = {
        "time_to_answer_ratio": ratio(ar_wall, rf_wall),
        "matched_prompts": [c["index"] for c in matched],
        "matched_tokens_per_second_ratio": None,
        "length_tolerance": LENGTH_TOLERANCE,
        "budget_hits": {s: sum(c[s]["finish_reason"] == "length" for c in cases) for s in ("refusion", "ar")},
        "tokens": {s: int(_sum(cases, s, "generated_tokens")) for s in ("refusion", "ar")},
    }
    if matched:
        rf_tps = _sum(matched, "refusion", "generated_tokens") / max(_sum(matched, "refusion", "wall_seconds"), 1e-12)
        ar_tps = _sum(matched, "ar", "generated_tokens") / max(_sum(matched, "ar", "wall_seconds"), 1e-12)
        out["matched_tokens_per_second_ratio"] = ratio(rf_tps, ar_tps)
    return out


def _x(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}x"


def headline_lines(s: dict, total: dict, prompts: int) -> List[str]:
    """The summary lines under the table (``s``: ``summary``'s dict): the same-work ratios first."""
    n = len(s["matched_prompts"])
    hits = s["budget_hits"]
    tol = f"{s['length_tolerance']:.0%}"
    return [
        f"ReFusion vs AR, same work: time to answer {_x(s['time_to_answer_ratio'])} over all {prompts} prompts "
        f"(sum of AR wall / sum of ReFusion wall; above 1: ReFusion answers sooner); "
        f"tokens/s {_x(s['matched_tokens_per_second_ratio'])} on the {n}/{prompts} matched prompts "
        f"(both ended at EOS with lengths within {tol}, or identical answers)",
        f"secondary, each side's own answers, whatever their length (ReFusion {s['tokens']['refusion']} tokens, "
        f"AR {s['tokens']['ar']}): ReFusion / AR tokens per second {_x(total['ratio'])} end to end, "
        f"{_x(total.get('decode_ratio'))} decode only; identical answers on {total['same_answers']}/{prompts} "
        f"prompts; ended at the budget: ReFusion {hits['refusion']}, AR {hits['ar']}",
    ]
