"""The soak test's report (:mod:`.soak`): what the clients saw and what the
server's ``/metrics`` counted over the run, as a dict, a table, and the
verdict (None when nothing went wrong)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from refusion_mlx.bench.report import format_table


def summarize(tally, before: dict, after: dict, state: dict, wall: float, clients: int) -> dict:
    c = tally.counts
    lat = np.array(tally.latencies or [0.0])
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after if not k.endswith("_bytes")}
    outcome = {o: int(delta.get(f'refusion_requests_total{{outcome="{o}"}}', 0))
               for o in ("completed", "cancelled", "failed", "refused")}
    fourxx = sum(n for s, n in tally.status.items() if 400 <= s < 500)
    fivexx = sum(n for s, n in tally.status.items() if s >= 500)
    exact = sum(c.get(k + "_exact", 0) for k in ("stream", "long", "conversation_first_turn"))
    checked = sum(c.get(k, 0) for k in ("stream", "long", "conversation_first_turn"))
    drops = c.get("drops_mid_stream", 0) + c.get("drops_before_answer", 0)
    # completions no client read: dropped requests that finished before the server saw the client leave
    read = sum(c.get(k + "_ok", 0) for k in ("stream", "long", "conversation_first_turn", "over_budget"))
    unseen = outcome["completed"] - read - c.get("conversation_later_turns", 0)
    steps = delta.get("refusion_step_seconds_count", 0)
    return {
        "clients": clients, "seconds": round(wall, 2),
        "exact": exact, "checked": checked,
        "streams": c.get("stream", 0), "long": c.get("long", 0),
        "conversation_later_turns": c.get("conversation_later_turns", 0),
        "conversation_cache_hits": c.get("conversation_cache_hits", 0),
        "drops_mid_stream": c.get("drops_mid_stream", 0), "drops_before_answer": c.get("drops_before_answer", 0),
        "drops_finished_first": unseen, "drops_unaccounted": drops - outcome["cancelled"] - unseen,
        "malformed": c.get("malformed", 0), "over_budget_sent": c.get("over_budget_sent", 0),
        "status": {str(k): v for k, v in sorted(tally.status.items())}, "4xx": fourxx, "5xx": fivexx,
        "transport_errors": c.get("transport_errors", 0),
        "latency_p50_s": round(float(np.percentile(lat, 50)), 4),
        "latency_p95_s": round(float(np.percentile(lat, 95)), 4),
        "metrics": {"requests": outcome, "generated_tokens": int(delta.get("refusion_generated_tokens_total", 0)),
                    "prefilled_tokens": int(delta.get("refusion_prefilled_tokens_total", 0)),
                    "cached_prompt_tokens": int(delta.get("refusion_cached_prompt_tokens_total", 0)),
                    "kv_waits": int(delta.get("refusion_kv_waits_total", 0)),
                    "steps": int(steps),
                    "mean_step_ms": round(1000 * delta.get("refusion_step_seconds_sum", 0) / steps, 3) if steps else 0,
                    "mean_tokens_per_forward": round(delta.get("refusion_tokens_per_forward_sum", 0) / steps, 3)
                    if steps else 0,
                    "prompt_cache_bytes": int(after.get("refusion_prompt_cache_bytes", 0)),
                    "memory_active_bytes": int(after.get("refusion_memory_active_bytes", 0)),
                    "memory_peak_bytes": int(after.get("refusion_memory_peak_bytes", 0))},
        "left_active": state.get("active"), "left_queued": state.get("queued"),
        "problems": tally.problems,
    }


def format_report(r: dict) -> str:
    m = r["metrics"]
    rows = [
        ("exact answers (streams, long, first turns)", f"{r['exact']} / {r['checked']}"),
        ("streams / long requests", f"{r['streams']} / {r['long']}"),
        ("later conversation turns (prompt-cache hits)",
         f"{r['conversation_later_turns']} ({r['conversation_cache_hits']})"),
        ("drops mid-stream / before the answer", f"{r['drops_mid_stream']} / {r['drops_before_answer']}"),
        ("drops cancelled / finished first / unaccounted",
         f"{m['requests']['cancelled']} / {r['drops_finished_first']} / {r['drops_unaccounted']}"),
        ("4xx (malformed sent)", f"{r['4xx']} ({r['malformed']})"),
        ("over --max-kv-bytes sent (each cut to it)", r["over_budget_sent"]),
        ("metrics: requests that waited for KV memory", m["kv_waits"]),
        ("5xx", r["5xx"]), ("transport errors", r["transport_errors"]),
        ("latency p50 / p95 (s)", f"{r['latency_p50_s']:.3f} / {r['latency_p95_s']:.3f}"),
        ("metrics: completed / cancelled / failed / refused",
         " / ".join(str(m["requests"][k]) for k in ("completed", "cancelled", "failed", "refused"))),
        ("metrics: generated / prefilled / cached prompt tokens",
         f"{m['generated_tokens']} / {m['prefilled_tokens']} / {m['cached_prompt_tokens']}"),
        ("metrics: steps, mean ms, tokens per forward",
         f"{m['steps']}, {m['mean_step_ms']}, {m['mean_tokens_per_forward']}"),
        ("metrics: prompt cache / active / peak MiB",
         " / ".join(f"{m[k] / (1 << 20):.1f}" for k in ("prompt_cache_bytes", "memory_active_bytes",
                                                        "memory_peak_bytes"))),
        ("left active / queued", f"{r['left_active']} / {r['left_queued']}"),
    ]
    head = f"soak: {r['clients']} clients for {r['seconds']} s"
    return "\n".join([head, format_table(["", "value"], rows)] + [f"problem: {p}" for p in r["problems"]])


def failed(r: dict) -> Optional[str]:
    if r["5xx"]:
        return f"{r['5xx']} responses were 5xx"
    if r["exact"] != r["checked"]:
        return f"{r['checked'] - r['exact']} answers were not exact"
    if r["left_active"] or r["left_queued"]:
        return "requests were left active or queued"
    if r["drops_unaccounted"]:
        return f"{r['drops_unaccounted']} dropped requests were neither cancelled nor completed"
    if r["transport_errors"]:
        return f"{r['transport_errors']} requests failed in transport"
    return None
