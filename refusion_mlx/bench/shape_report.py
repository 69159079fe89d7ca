"""The text of the --shape report (``shapes.run_shape`` makes the dict): what
the shape decides, then on a GPU the measurement first and the forecast
beside it with the gap between them; on the CPU the forecast first (it is
for Apple GPUs, and ready before a slow CPU timing) and the CPU's
measurement after it, labelled as a CPU's."""

from __future__ import annotations

import textwrap
from typing import List

from .forecast import format_forecast, row_label
from .kv_memory import format_kv_memory
from .report import format_table


def _whose(r: dict) -> str:
    return "the bundled demo model" if r["recorded_with"] == "bundled demo model" else r["recorded_with"]


def format_head(r: dict) -> str:
    c, s = r["config"], r["settings"]
    quant = f", {r['q_bits']}-bit weights" if r["q_bits"] else ""
    wb = r["weight_bytes"]
    head = "its LM head's" if not c["tie_word_embeddings"] else "the tied embeddings' as LM head:"
    return "\n".join([
        f"shape {r['shape']}: hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
        f"{c['num_attention_heads']}/{c['num_key_value_heads']} heads, vocab {c['vocab_size']}; "
        f"{r['parameters'] / 1e6:.0f}M parameters, random weights, {r['dtype']}{quant}",
        f"device: {r['device']}; paths: {r['paths']}",
        f"settings: {s['slot_size']}-token slots, blocks of {s['block_length']}, budget {s['gen_length']}, "
        f"thresholds {s['slot_threshold']:g} / {s['token_threshold']:g}; {r['prompts']} prompts of the suite, "
        f"{sum(r['generated_tokens'])} tokens; forwards recorded with {_whose(r)}: "
        f"{r['forwards']} ({r['tokens_per_forward']:.2f} tokens per forward)",
        f"what the shape decides, per forward: {wb['body'] / 1e6:.0f} MB of weights read + {head} "
        f"{wb['head'] / 1e6:.0f} MB; {r['flops_per_token_fed'] / 1e9:.2f} GFLOP per token fed + "
        f"{r['flops_per_head_row'] / 1e9:.2f} per LM-head row",
        "what the model's confidence decides: tokens per forward and how wide the passes are "
        "(the profiles: [a] derived, [b] recorded)",
    ])


def _measured_rows(r: dict, gpu: bool) -> List[list]:
    rows = []
    if r["ar_tok_s"] is not None:
        ar = ["AR (mlx-lm generate_step)", "1.00", r["ar_forwards"], r["ar_seconds"], r["ar_tok_s"], ""]
        rows.append(ar + (["", ""] if gpu else [r["weight_bytes_per_token"]["ar"] / 1e6,
                                                r["flops_per_token"]["ar"] / 1e9]))
    for p in r["profiles"]:
        m = p["measured"]
        if m is None:
            continue
        ratio = f"{m['ratio']:.2f}x" if m["ratio"] is not None else "-"
        row = [row_label(p), f"{p['tokens_per_forward']:.2f}", p["forwards"], m["seconds"], m["tok_s"], ratio]
        if gpu:
            ratio_gap = f"{m['measured_over_forecast']:.2f}" if m["measured_over_forecast"] is not None else "-"
            row += [f"{m['forecast_ratio']:.2f}x", ratio_gap]
        else:
            row += [p["weight_bytes_per_token"]["refusion"] / 1e6, p["flops_per_token"]["refusion"] / 1e9]
        rows.append(row)
    return rows


def format_batched(r: dict) -> str:
    """Each profile's requests at once against one at a time (``--batch``)."""
    rows = [[row_label(p), p["batched"]["requests"], p["batched"]["serial_tok_s"], p["batched"]["batched_tok_s"],
             f"{p['batched']['speedup']:.2f}x"] for p in r["profiles"] if p.get("batched")]
    if not rows:
        return ""
    return "\n" + format_table(["profile", "requests", "one at a time tok/s", "at once tok/s", "at once / one"],
                               rows)


def format_measured(r: dict) -> str:
    gpu = r["measured_on"] == "gpu"
    if gpu:
        title = (f"measured on this GPU ({r['device']}): the model alone (forwards replayed bare, random weights), "
                 "beside the forecast's bandwidth-bound ReFusion / AR (its ceiling on any chip)")
        cols = ["profile", "tok/fwd", "forwards", "seconds", "tok/s", "ReFusion / AR", "forecast",
                "measured / forecast"]
    else:
        title = (f"measured on this CPU ({r['device']}): a CPU's timing, not an Apple GPU's (the forecast is "
                 "for Apple GPUs); the recorded forwards only (a GPU replays the derived profiles too)")
        cols = ["profile", "tok/fwd", "forwards", "seconds", "tok/s", "ReFusion / AR", "weight MB/tok",
                "GFLOP/tok"]
    lines = textwrap.wrap(title, width=110, subsequent_indent="    ") + [format_table(cols, _measured_rows(r, gpu))]
    if r["ratio"] is not None:
        whose = ("the demo model's forwards [b], not a real checkpoint's"
                 if r["recorded_with"] == "bundled demo model" else f"the forwards of {r['recorded_with']} [b]")
        lines += textwrap.wrap(
            f"ReFusion / AR measured here: {r['ratio']:.3f}x, with {whose}; LM head: {r['head_rows_per_chunk']} "
            f"rows per read on these paths, {r['head_reads_per_step']} reads per step (max "
            f"{r['head_reads_per_step_max']})", width=110, subsequent_indent="    ")
    return "\n".join(lines) + format_batched(r)


def format_curve(r: dict) -> str:
    """Every profile priced from a device's measured cost curve (--cost-curve)."""
    if not r.get("cost_curve"):
        return ""
    c = r["cost_curve"]
    first = r["profiles"][0]["from_curve"]
    rows = [["AR (mlx-lm), its one-token forward", "1.00", first["ar_seconds"], first["ar_tok_s"], ""]]
    rows += [[row_label(p), f"{p['tokens_per_forward']:.2f}", p["from_curve"]["refusion_seconds"],
              p["from_curve"]["refusion_tok_s"], f"{p['from_curve']['ratio']:.2f}x"] for p in r["profiles"]]
    title = (f"priced from the cost of a forward by width measured on {c['device'] or 'the device'} ({c['file']}): "
             "each forward at the measured milliseconds of its phase, width and cache length")
    notes = [f"note: {c['file']} has no {phase} forwards of these weights: the {phase} passes are priced as {used} "
             "passes of their width and cache length" for phase, used in (c.get("priced_as") or {}).items()]
    return "\n".join(textwrap.wrap(title, width=110, subsequent_indent="    ")
                     + [format_table(["profile", "tok/fwd", "seconds", "tok/s", "ReFusion / AR"], rows)]
                     + [line for note in notes for line in textwrap.wrap(note, width=110, subsequent_indent="    ")])


def _forecast(r: dict) -> str:
    """The forecast (and the device curve's pricing, if given) and what the
    KV cache costs (per token, per conversation)."""
    curve = format_curve(r)
    return format_forecast(r) + ("\n\n" + curve if curve else "") + "\n\n" + format_kv_memory(r["kv_memory"])


def before_timing(r: dict) -> str:
    """What the CPU run prints before it times: the head and the forecast."""
    gb = (r["weight_bytes"]["body"] + r["weight_bytes"]["head"]) / 1e9
    return "\n".join([format_head(r), "", _forecast(r), "",
                      f"timing next on this CPU: {r['forwards']} ReFusion and {r['ar_forwards']} AR forwards of "
                      f"{gb:.2f} GB of weights each, which takes long for a large shape (--forecast-only skips it)"])


def format_shape_report(r: dict, shown: bool = False) -> str:
    """The whole report; ``shown``: the head and forecast were printed
    already (``before_timing``), so only the measurement is left."""
    if r["measured_on"] is None:  # --forecast-only
        return "\n".join([format_head(r), "", _forecast(r), "", "not measured (--forecast-only)"])
    if shown:
        return "\n" + format_measured(r)
    if r["measured_on"] == "gpu":
        return "\n".join([format_head(r), "", format_measured(r), "", _forecast(r)])
    return "\n".join([format_head(r), "", _forecast(r), "", format_measured(r)])
