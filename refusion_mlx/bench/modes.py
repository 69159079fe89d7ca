"""The benchmark's measurements besides the AR comparison, each a function of
the parsed flags returning its report dict: aggregate throughput of N
concurrent requests in process (``run_concurrency``) or through the server's
streams (``run_http``), a conversation's prefill with and without the prompt
cache (``run_conversation``), the block-layout sweep (``measure_layouts``),
the recorded forwards replayed at a real model's shape (``measure_shape``)."""

from __future__ import annotations

import sys
from typing import Any, Dict

from ..decode.decoder import check_context
from ..decode.params import FIELDS, RefusionParams
from ..decode.stream import chat_prompt
from .compare import load_models, params_dict, resolve_all, settings_line
from .concurrency import baseline
from .report import environment, format_table, header_lines
from .suite import Suite, resolve_params


def settings_of(args, suite: Suite, overrides: Dict[str, Any], params, chat_template: bool = True) -> dict:
    """What a measurement ran: the suite, preset and flags, each prompt's
    decoding settings (``params``: those used), the KV cache, the chat
    template and the dtype (its JSON's ``settings``)."""
    return {"suite": suite.name, "suite_source": suite.source, "prompts": len(suite.cases), "preset": args.preset,
            "overrides": dict(overrides), "params": [params_dict(p) for p in params], **_kv(args),
            "chat_template": chat_template, "dtype": args.dtype, "adapter_path": args.adapter_path}


def _rounds(args) -> str:
    return f"{args.rounds} round{'s' if args.rounds != 1 else ''}"


def _header(env: dict, settings: dict) -> list:
    return header_lines(env) + [settings_line(settings, settings["params"])]


def run_concurrency(args, suite: Suite, overrides: Dict[str, Any], log) -> dict:
    """The --concurrency report: one row per level, and the environment."""
    from .concurrency import format_levels, run_levels

    params = resolve_all(suite, args.preset, overrides)
    model, tokenizer, _ = load_models(args.model, args.dtype, ar=False, adapter_path=args.adapter_path)
    prompts = [chat_prompt(tokenizer, c.prompt, system=c.system, chat_template=not args.no_chat_template)
               for c in suite.cases]
    for ids, p in zip(prompts, params):  # the library would cut the budget: a measurement runs what it was asked
        check_context(model, len(ids), p)
    env = environment(model, args.model or "bundled demo model (refusion_mlx/demo/tiny-refusion)")
    results = run_levels(model, tokenizer, prompts, params, args.concurrency, args.rounds, log=log, kv=_kv(args))
    settings = settings_of(args, suite, overrides, params, not args.no_chat_template)
    text = "\n".join(_header(env, settings) + [f"{_rounds(args)} of the suite, in process", "",
                                               format_levels(results, format_table)])
    return {"environment": env, "settings": settings, "levels": [r.as_dict() for r in results],
            "rounds": args.rounds, "report": text}


def _server(args, suite: Suite, overrides: Dict[str, Any], **kw):
    from ..serve.http_server import RefusionServer

    params = resolve_all(suite, args.preset, overrides)
    return RefusionServer(args.model, port=0, dtype=args.dtype, adapter_path=args.adapter_path,
                          **_kv(args), **kw), params


def _kv(args) -> Dict[str, Any]:
    """--kv-bits and --kv-group-size, as the Python API's keywords."""
    return {"kv_bits": args.kv_bits, "kv_group_size": args.kv_group_size}


def _request_fields(p: RefusionParams) -> dict:
    """A suite case's settings as the server's request fields (``FIELDS``'
    request names), those set; one layout, block_length over serial_num_blocks."""
    fields = {f.request: ({str(k): v for k, v in getattr(p, f.name)} if f.type is dict else getattr(p, f.name))
              for f in FIELDS if f.request is not None and getattr(p, f.name) is not None}
    if p.block_length is not None:
        fields.pop("serial_num_blocks", None)
    return fields


def run_http(args, suite: Suite, overrides: Dict[str, Any], log) -> dict:
    """--concurrency --http: the same workload through the server's streams."""
    from .serving import http_level

    say = log or (lambda _m: None)
    server, params = _server(args, suite, overrides, max_batch=max(args.concurrency))
    bodies = [{"messages": ([{"role": "system", "content": c.system}] if c.system else []) +
               [{"role": "user", "content": c.prompt}], **_request_fields(p)}
              for c, p in zip(suite.cases, params)]
    work = bodies * args.rounds
    with server:
        for c, p in zip(suite.cases, params):  # the server would cut the budget: refused as in process
            check_context(server.engine.model, len(chat_prompt(server.engine.tokenizer, c.prompt, system=c.system)), p)
        env = environment(server.engine.model, args.model or "bundled demo model (refusion_mlx/demo/tiny-refusion)")
        http_level(server.url, bodies[:max(args.concurrency)], max(args.concurrency))  # warm-up
        levels = []
        for n in args.concurrency:
            lv = http_level(server.url, work, n)
            say(f"{n} streams: {lv.tokens} tokens in {lv.wall_seconds:.2f} s")
            levels.append(lv.as_dict())
    clients, base = baseline(levels)
    rows = [[d["clients"], d["requests"], d["tokens"], d["wall_seconds"], d["tokens_per_second"],
             f"{d['tokens_per_second'] / base:.2f}x" if base else "-", d["latency_p50_s"], d["latency_p90_s"],
             d["first_text_p50_s"]] for d in levels]
    table = format_table(["streams", "requests", "tokens", "wall s", "tok/s", f"vs {clients}", "latency p50 s",
                          "p90 s", "first text p50 s"], rows)
    settings = settings_of(args, suite, overrides, params)
    return {"environment": env, "settings": settings, "http_levels": levels, "rounds": args.rounds,
            "report": "\n".join(_header(env, settings) + [
                f"{_rounds(args)} of the suite through the HTTP server (streaming, loopback)", "", table])}


def run_conversation(args, suite: Suite, overrides: Dict[str, Any], log) -> dict:
    """--conversation TURNS: prefilled tokens per turn, with and without the prompt cache. The server
    without it is sent the history of the one with it (its answers): the same prompts turn by turn."""
    from .serving import conversation, new_since_previous_turn

    questions = [suite.cases[i % len(suite.cases)].prompt for i in range(args.conversation)]
    sides = {}
    env = None
    for name, cache_bytes in (("reuse", None), ("no reuse", 0)):
        kw = {} if cache_bytes is None else {"prompt_cache_bytes": cache_bytes}
        history = [r["answer"] for r in sides["reuse"]] if sides else None
        server, params = _server(args, suite, overrides, **kw)
        with server:
            env = env or environment(server.engine.model, args.model or "bundled demo model")
            sides[name] = conversation(server.url, questions, history, **_request_fields(params[0]))
        if log:
            log(f"{name}: prefilled {[r['prefilled_tokens'] for r in sides[name]]}")
    reuse, fresh = sides["reuse"], sides["no reuse"]
    new = new_since_previous_turn(reuse)
    rows = [[f"{a['turn']}*" if a["max_tokens_cut"] else a["turn"], a["prompt_tokens"], n if n is not None else "-",
             a["cached_tokens"], a["prefilled_tokens"], b["prefilled_tokens"], a["answer_tokens"]]
            for a, b, n in zip(reuse, fresh, new)]
    total = [sum(r["prefilled_tokens"] for r in side) for side in (reuse, fresh)]
    rows.append(["all", "", "", "", total[0], total[1], ""])
    table = format_table(["turn", "prompt tokens", "new since last turn", "cached", "prefilled (reuse)",
                          "prefilled (no reuse)", "answer tokens"], rows)
    differ = [a["turn"] for a, b in zip(reuse, fresh) if a["answer"] != b["answer"]]
    cut = [f"turn {a['turn']} {a['max_tokens_cut']}" for a in reuse if a["max_tokens_cut"]]
    notes = [_differing(differ, len(reuse))] + [
        f"* max_tokens cut by the server to fit the model's context (X-Max-Tokens-Cut): {', '.join(cut)}"] * bool(cut)
    settings = {**settings_of(args, suite, overrides, params[:1]), "turns": args.conversation}
    return {"environment": env, "settings": settings, "conversation": sides, "same_answers": not differ,
            "differing_answers": differ, "report": "\n".join(_header(env, settings) + ["", table] + notes)}


def _differing(turns: list, of: int) -> str:
    """The report's line on the answers that differ with and without the prompt cache (the same prompts)."""
    if not turns:
        return f"answers with and without reuse: the same on all {of} turns"
    return (f"answers with and without reuse differ on {len(turns)} of {of} turns ({', '.join(map(str, turns))}): "
            "a continued cache keeps the K/V each answer row was decoded with, not a fresh prefill's "
            "(docs/serving.md, Prompt cache)")


def measure_layouts(args, suite: Suite, overrides: Dict[str, Any], log) -> dict:
    """--layouts: the block-layout sweep (``layouts``), with the environment."""
    from .layouts import run_layouts

    # each prompt's settings as the suite, --preset and the flags resolve them (--data's rows: the suite's
    # defaults); the sweep sets the budget, slot size and blocks itself
    fixed = ("gen_length", "slot_size", "block_length", "serial_num_blocks")
    given = {k: v for k, v in overrides.items() if k not in fixed}
    bases = [resolve_params(suite, case, args.preset, given) for case in ([None] if args.data else suite.cases)]
    model, tokenizer, _ = load_models(args.model, args.dtype, ar=False, adapter_path=args.adapter_path)
    env = environment(model, args.model or "bundled demo model (refusion_mlx/demo/tiny-refusion)")
    result = run_layouts(args, model, tokenizer, suite, bases, log)
    result["environment"] = env
    result["settings"] = {**settings_of(args, suite, overrides, bases),
                          "budgets": args.budgets, "slot_sizes": args.slot_sizes, "layouts": args.layouts,
                          "data": args.data, "limit": args.limit if args.data else None}
    result["report"] = "\n".join(header_lines(env) + ["", result.pop("table")])
    return result


def measure_shape(args, suite: Suite, overrides: Dict[str, Any], log) -> dict:
    """--shape NAME: the forwards of the demo model (or of --record-with's
    folder) and of derived profiles, priced and replayed on a model of that
    shape (random weights), against mlx-lm on the same arrays (``shapes``)."""
    from .shape_report import before_timing, format_shape_report
    from .shapes import run_shape

    cases = Suite(suite.name, suite.cases[:args.prompts], suite.defaults, suite.source)
    params = resolve_all(cases, args.preset, {"gen_length": 64, **overrides})
    shown = []

    def show(partial: dict) -> None:  # the CPU: the forecast before a slow timing (the table's stream)
        print(before_timing(partial), file=sys.stderr if args.json == "-" else sys.stdout, flush=True)
        shown.append(True)

    curve = None
    if args.cost_curve:
        from .cost_curve import CostCurve

        curve = CostCurve.load(args.cost_curve, args.dtype, args.q_bits, args.shape)
    result = run_shape(args.shape, cases, params, args.dtype, args.q_bits, not args.no_ar, log,
                       record_model=args.record_with, tokens_per_forward=args.tokens_per_forward,
                       measure=not args.forecast_only, show=show, kv=_kv(args), batch=args.batch or 1,
                       cost_curve=curve)
    result["report"] = format_shape_report(result, shown=bool(shown))
    return result
