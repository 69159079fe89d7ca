"""ReFusion against autoregressive decoding of the same weights.

``python -m refusion_mlx.bench`` runs a prompt suite through the ReFusion
decoder and through mlx-lm's AR decoding of the very same weight arrays, in
one process, interleaved, after a warm-up: same chat-templated prompt ids,
same token budget, both greedy, both stopping at EOS. It prints the
environment, a table per prompt and in total, and the headline
(``headline``): time to answer over every prompt and tokens per second on
the prompts both sides answered alike, then the plain tokens-per-second
ratio; ``--json`` writes everything to a file.

    python -m refusion_mlx.bench                       # bundled demo model, default suite
    python -m refusion_mlx.bench --preset gsm8k --repeat 3 --json bench.json
    python -m refusion_mlx.bench --model models/qwen3-0.6b-random --suite my_suite.json

Importable: ``run_benchmark(...)`` returns the same dict that ``--json``
writes; ``format_report(result)`` renders it. The other modes (concurrency,
HTTP, conversation, layouts) are in ``modes``, the command in ``__main__``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from ..cli.launch import ready
from ..cli.output import write_text
from ..decode.params import RefusionParams
from ..decode.stream import chat_prompt
from ..errors import DecodeError
from .headline import LENGTH_TOLERANCE, headline_lines, match, ratio, summary
from .report import environment, format_table, header_lines
from .runs import RunResult, median_run, run_ar, run_refusion, share_weights, storage_of
from .suite import BenchError, Suite, load_suite, resolve_params

SIDES = ("refusion", "ar")
LABELS = {"refusion": "ReFusion", "ar": "AR"}


# --------------------------------------------------------------------------
# Loading


def load_models(model_path: Optional[str], dtype: str = "float32", ar: bool = True,
                adapter_path: Optional[str] = None, dist=None):
    """The ReFusion model and tokenizer, and mlx-lm's model sharing its weights.

    With ``adapter_path`` both sides get the same adapter layers (mlx-lm's
    LoRA/DoRA modules, built from the same folder) over the same arrays: the
    AR side decodes exactly the fine-tuned model ReFusion decodes, and pays
    the same adapter cost per token, so the comparison stays like for like.

    ``dist`` (under ``mlx.launch``): both sides split over the group, the AR
    side by mlx-lm's own ``Model.shard`` (its own copy of this rank's share:
    our joined, sharded arrays do not map back onto mlx-lm's layers); tensor
    parallel only, as mlx-lm's Qwen3 has no pipeline mode.
    """
    from ..models.loading import load

    if dist is not None and ar and dist.mode == "pipeline":
        raise BenchError("mlx-lm's Qwen3 cannot run as a pipeline: add --no-ar to bench with --pipeline")
    model, tokenizer = load(model_path, dtype=dtype, adapter_path=adapter_path, dist=dist)
    if not ar:
        return model, tokenizer, None
    try:
        from mlx_lm.utils import load_model as ar_load_model

        ar_model, _ = ar_load_model(Path(model.model_path), lazy=True)
        if dist is not None:
            import mlx.core as mx

            ar_model.shard(dist.group)
            ar_model.set_dtype(model.model.norm.weight.dtype)
            mx.eval(ar_model.parameters())
            return model, tokenizer, ar_model
        if adapter_path is not None:
            from mlx_lm.tuner.utils import load_adapters as ar_load_adapters

            ar_load_adapters(ar_model, str(Path(adapter_path).expanduser()))
        share_weights(ar_model, model)
    except Exception as e:  # mlx-lm's own errors are of many kinds
        detail = " ".join(str(e).split())[:300] or type(e).__name__
        raise BenchError(f"mlx-lm cannot load {model.model_path} for the AR side: {detail} "
                         "(use --no-ar to skip it)") from None
    return model, tokenizer, ar_model


# --------------------------------------------------------------------------
# Running


def combine(side: str, runs: Sequence[RunResult]) -> RunResult:
    """The sum of several runs (peak memory: the largest)."""
    phases: Dict[str, float] = {}
    for r in runs:
        for k, v in r.phase_seconds.items():
            phases[k] = phases.get(k, 0.0) + v
    committed = [r.committed_tokens for r in runs if r.committed_tokens is not None]
    return RunResult(
        side, sum(r.generated_tokens for r in runs), sum(r.forwards for r in runs),
        sum(r.wall_seconds for r in runs), sum(r.prefill_seconds for r in runs), phases,
        max((r.peak_memory_gb for r in runs), default=0.0), sum(r.host_syncs for r in runs),
        sum(r.steps for r in runs), "-", committed_tokens=sum(committed) if committed else None,
        lookahead_forwards=sum(r.lookahead_forwards for r in runs),
        prefill_tokens=sum(r.prefill_tokens for r in runs))


def _side_dict(run: RunResult, repeats: Sequence[RunResult], keep_output: bool = True) -> dict:
    d = run.as_dict()
    if not keep_output:
        d.pop("output_ids"), d.pop("text"), d.pop("finish_reason")
    d["repeat_wall_seconds"] = [round(r.wall_seconds, 6) for r in repeats]
    return d


def params_dict(p: RefusionParams) -> dict:
    layout = p.layout()
    return {"gen_length": p.gen_length, "slot_size": p.slot_size,
            "block_lengths": sorted(set(layout.block_lengths)), "blocks": len(layout.block_lengths),
            "serial_num_blocks": p.serial_num_blocks, "block_length": p.block_length,
            "slot_threshold": p.slot_threshold, "token_threshold": p.token_threshold,
            "temperature": p.temperature, "seed": p.seed}


def settings_line(settings: dict, params: Sequence[dict], ar: bool = False) -> str:
    """One line of what was decoded: the suite, the preset and the decoding
    settings (``params``: ``params_dict`` of each prompt)."""
    if len({json.dumps(p, sort_keys=True) for p in params}) == 1:
        p = params[0]
        blocks = f"{p['blocks']} block{'s' if p['blocks'] != 1 else ''} of"
        decoding = (f"gen_length {p['gen_length']}, slot_size {p['slot_size']}, {blocks} "
                    f"{'/'.join(map(str, p['block_lengths']))}, slot_threshold {p['slot_threshold']}, "
                    f"token_threshold {p['token_threshold']}, temperature {p['temperature']}")
    else:
        decoding = "per prompt (see --json)"
    if ar and any(p["temperature"] for p in params):
        decoding += " (a temperature is ReFusion's: mlx-lm's side decodes greedily)"
    kv = f" | KV cache: {settings['kv_bits']}-bit" if settings.get("kv_bits") else ""
    return (f"suite: {settings['suite']} ({settings['prompts']} prompts) | preset: {settings['preset'] or 'none'} | "
            f"decoding: {decoding}{kv}")


def run_benchmark(model: Union[str, Path, None] = None, suite: Union[str, Path, Suite, None] = "default",
                  preset: Optional[str] = None, overrides: Optional[Dict[str, Any]] = None,
                  dtype: str = "float32", repeat: int = 1, warmup: int = 1, ar: bool = True,
                  chat_template: bool = True, log: Optional[Callable[[str], None]] = None,
                  adapter_path: Optional[str] = None, dist=None, kv_bits: Optional[int] = None,
                  kv_group_size: Optional[int] = None) -> dict:
    """Run the suite on both sides and return the report as a JSON-able dict.

    ``overrides``: decoding parameters that win over the suite and preset
    (``gen_length``, ``slot_size``, ``serial_num_blocks``, ``block_length``,
    ``slot_threshold``, ``token_threshold``, ``temperature``, ``seed``).
    ``repeat`` timed runs per prompt and side (the median is reported);
    ``warmup`` untimed runs per side first, cycling through the prompts.
    ``adapter_path``: fine-tuned adapters, applied to both sides alike.
    ``dist``: under ``mlx.launch``, this rank's group (``load_models``);
    the report's ``meta`` gains ``distributed``. ``kv_bits`` / ``kv_group_size``:
    quantized KV caches on both sides (mlx-lm's from the first token).
    """
    if not isinstance(repeat, int) or repeat < 1:
        raise BenchError(f"repeat must be a positive integer, got {repeat!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise BenchError(f"warmup must be a non-negative integer, got {warmup!r}")
    suite = suite if isinstance(suite, Suite) else load_suite(suite)
    params = resolve_all(suite, preset, overrides)
    say = log or (lambda _msg: None)
    rmodel, tokenizer, ar_model = load_models(None if model is None else str(model), dtype, ar, adapter_path,
                                              dist)
    ready(dist)
    label = str(model) if model is not None else "bundled demo model (refusion_mlx/demo/tiny-refusion)"
    prompts = [chat_prompt(tokenizer, c.prompt, system=c.system, chat_template=chat_template)
               for c in suite.cases]
    kv = {"kv_bits": kv_bits, "kv_group_size": kv_group_size}
    storage_of(kv, rmodel)  # the group size against the head dimension, before anything runs
    eos_saved = set(tokenizer.eos_token_ids)
    tokenizer.eos_token_ids = {tokenizer.eos_token_id}  # AR stops where ReFusion stops
    try:
        def once(side: str, i: int) -> RunResult:
            if side == "refusion":
                return run_refusion(rmodel, tokenizer, prompts[i], params[i], kv)
            return run_ar(ar_model, tokenizer, prompts[i], params[i].gen_length, kv)  # the same budget, EOS not counted

        sides = SIDES if ar else SIDES[:1]
        for w in range(warmup):
            for side in sides:
                once(side, w % len(prompts))
        runs: List[Dict[str, List[RunResult]]] = [{s: [] for s in sides} for _ in prompts]
        for rep in range(repeat):
            for i in range(len(prompts)):
                order = sides if (rep + i) % 2 == 0 else sides[::-1]  # alternate who goes first
                for side in order:
                    r = once(side, i)
                    runs[i][side].append(r)
                    say(f"[{rep + 1}/{repeat}] #{i + 1} {LABELS[side]}: {r.generated_tokens} tokens, "
                        f"{r.wall_seconds * 1000:.1f} ms")
    finally:
        tokenizer.eos_token_ids = eos_saved
    return summarize(suite, prompts, params, runs, sides, environment(rmodel, label),
                     dict(preset=preset, overrides={k: v for k, v in (overrides or {}).items() if v is not None},
                          repeat=repeat, warmup=warmup, chat_template=chat_template,
                          adapter_path=None if adapter_path is None else str(adapter_path), **kv,
                          **({} if dist is None else {"distributed": dist.as_dict()})))


def resolve_all(suite: Suite, preset: Optional[str], overrides: Optional[Dict[str, Any]]) -> List[RefusionParams]:
    """Every case's parameters, checked before any model is loaded."""
    out = []
    for i, case in enumerate(suite.cases):
        try:
            out.append(resolve_params(suite, case, preset, overrides))
        except DecodeError as e:
            raise DecodeError(f"prompt {i + 1} ({case.prompt[:40]!r}): {e}") from None
    return out


def summarize(suite: Suite, prompts, params, runs, sides, env: dict, settings: dict) -> dict:
    cases, chosen = [], {s: [] for s in sides}
    for i, case in enumerate(suite.cases):
        entry = {"index": i + 1, "family": case.family, "prompt": case.prompt,
                 "prompt_tokens": len(prompts[i]), "params": params_dict(params[i])}
        for s in sides:
            best = median_run(runs[i][s])
            chosen[s].append(best)
            entry[s] = _side_dict(best, runs[i][s])
        if "ar" in sides:
            rf, arr = chosen["refusion"][-1], chosen["ar"][-1]
            entry["ratio"] = ratio(rf.tokens_per_second, arr.tokens_per_second)
            entry["decode_ratio"] = ratio(rf.decode_tokens_per_second, arr.decode_tokens_per_second)
            entry["same_answer"] = rf.output_ids == arr.output_ids
            entry["time_ratio"] = ratio(arr.wall_seconds, rf.wall_seconds)
            entry["match"] = match(entry["refusion"], entry["ar"])
        cases.append(entry)
    total: Dict[str, Any] = {}
    for s in sides:
        combined = combine(s, chosen[s])
        total[s] = _side_dict(combined, [], keep_output=False)
        total[s].pop("repeat_wall_seconds")
    if "ar" in sides:
        rf, arr = combine("refusion", chosen["refusion"]), combine("ar", chosen["ar"])
        total["ratio"] = ratio(rf.tokens_per_second, arr.tokens_per_second)
        total["decode_ratio"] = ratio(rf.decode_tokens_per_second, arr.decode_tokens_per_second)
        total["same_answers"] = sum(c["same_answer"] for c in cases)
    return {"meta": {**env, "suite": suite.name, "suite_source": suite.source,
                     "prompts": len(suite.cases), **settings,
                     "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
            "cases": cases, "total": total, **({"summary": summary(cases)} if "ar" in sides else {})}


# --------------------------------------------------------------------------
# The report


COLUMNS = ["#", "family", "prompt", "side", "tokens", "end", "fwd", "tok/fwd", "tok/s", "dec tok/s",
           "wall ms", "prefill", "plan", "verify", "inf-draft", "inf-verify", "AR steps", "other",
           "peak MB", "match", "x time", "x e2e", "x dec"]
ENDS = {"stop": "eos", "length": "LEN"}  # how each answer ended: at EOS, or cut at the budget
MATCHES = {"identical": "same", "length": "~len", None: "no"}
AR_COLUMNS = ("AR steps", "match", "x time", "x e2e", "x dec")  # empty without the AR side (--no-ar)


def _row(index, family, prompt, side: str, d: dict, ratios=(None, None, None, None)) -> list:
    ph = d["phase_seconds"]

    def ms(key):
        return ph[key] * 1000 if key in ph else None

    return [index, family, prompt, LABELS[side], d["generated_tokens"], ENDS.get(d.get("finish_reason"), "-"),
            d["forwards"],
            d["tokens_per_forward"], d["tokens_per_second"], d["decode_tokens_per_second"],
            d["wall_seconds"] * 1000, d["prefill_seconds"] * 1000, ms("plan"), ms("verify"),
            ms("infill_draft"), ms("infill_verify"), ms("steps"),
            d["other_seconds"] * 1000 if side == "refusion" else None,
            d["peak_memory_gb"] * 1000, *ratios]


def format_report(result: dict) -> str:
    """The terminal report of a ``run_benchmark`` result."""
    meta, cases, total, head = result["meta"], result["cases"], result["total"], result.get("summary")
    sides = [s for s in SIDES if s in total]
    lines = header_lines(meta)
    lines.append(settings_line(meta, [c["params"] for c in cases], ar="ar" in total))
    if "distributed" in meta:
        d = meta["distributed"]
        lines.append(f"distributed: {d['size']} ranks over {d['backend']}, {d['mode']} parallel; weights "
                     f"{d['weight_bytes_per_rank'] / 2**20:.1f} MiB per rank of {d['weight_bytes'] / 2**20:.1f} MiB")
    lines.append(f"timing: {meta['warmup']} warm-up run(s) per side, then {meta['repeat']} timed run(s) per "
                 f"prompt and side, interleaved; the median run is shown")
    rows: List[list] = []
    for c in cases:
        for k, s in enumerate(sides):
            ratios = ((MATCHES[c["match"]], c["time_ratio"], c["ratio"], c["decode_ratio"])
                      if s == "refusion" and "ar" in sides else (None,) * 4)
            first = k == 0
            rows.append(_row(c["index"] if first else "", c["family"] if first else "",
                             c["prompt"][:26] if first else "", s, c[s], ratios))
    rows.append([])
    for k, s in enumerate(sides):
        ratios = ((f"{len(head['matched_prompts'])}/{len(cases)}", head["time_to_answer_ratio"], total["ratio"],
                   total["decode_ratio"]) if s == "refusion" and head else (None,) * 4)
        rows.append(_row("all" if k == 0 else "", "", "", s, total[s], ratios))
    headers = COLUMNS
    if "ar" not in sides:
        keep = [i for i, h in enumerate(COLUMNS) if h not in AR_COLUMNS]
        headers, rows = [COLUMNS[i] for i in keep], [[r[i] for i in keep] if r else r for r in rows]
    lines += ["", format_table(headers, rows, left=[0, 1, 2, 3]), ""]
    if head:
        lines += headline_lines(head, total, len(cases))
    legend = ("tokens: answer up to and including EOS | end: eos (ended at EOS) or LEN (cut at the budget) | "
              "fwd: model forwards | tok/s: tokens / wall | "
              "dec tok/s: tokens after the prefill pass / (wall - prefill) | times in ms: prefill = ReFusion's first "
              "pass (prompt + first block's masks)")
    if "ar" not in sides:
        lines.append(legend + "; plan/verify/inf-*: ReFusion phases; other: wall time outside its phases | "
                     "peak MB: peak MLX memory, weights included")
        return "\n".join(lines)
    lines.append(legend + " or AR's time to first token; plan/verify/inf-*: "
                 "ReFusion phases; AR steps: AR's token steps after the first; other: ReFusion wall "
                 "time outside its phases | peak MB: peak MLX memory, weights included | match: same (identical "
                 "answers), ~len (both ended at EOS, lengths within "
                 f"{LENGTH_TOLERANCE:.0%}) or no | x time: AR wall / ReFusion wall "
                 "(time to answer) | x e2e, x dec: ReFusion's tokens/s over AR's")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# CLI


def write_json(path: Optional[str], result: dict) -> None:
    if not path:
        return
    if path == "-":
        sys.stdout.write(json.dumps(result, indent=1) + "\n")
        sys.stdout.flush()
        return
    try:
        write_text(path, json.dumps(result, indent=1) + "\n")
    except OSError as e:
        raise BenchError(f"cannot write {path}: {e.strerror or e}") from None
    print(f"wrote {path}")
