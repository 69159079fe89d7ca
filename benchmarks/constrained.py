"""Constrained decoding against unconstrained decoding on the same prompts.

For each case (a prompt and a constraint) the prompt is decoded twice with the
same settings -- unconstrained, then under the constraint -- and the table gives
tokens per forward, tokens/s, the host's grammar-mask time per committed token
(computed while the device runs each pass: ``DecodeStats.mask_seconds``) and
whether the constrained answer is valid (JSON parsed and validated by
jsonschema for a schema; "length" when the budget ended first). The ratio row
compares constrained with unconstrained tokens per forward (target: >= 0.80).

    python -m benchmarks.constrained                       # the bundled demo model
    python -m benchmarks.constrained --model PATH --max-tokens 256 --json out.json
    python -m benchmarks.constrained --variant no-forced   # what each part of the mode gives

``--variant`` takes a part of the constrained mode out, to measure it:
``no-forced`` (tokens the grammar forces are not filled ahead: each costs
its own verification), ``no-drafts`` (no planned drafts verified: one
token per pass plus forced ones, a left-to-right decoder that infills
forced tokens), ``no-slot-rule`` (the bonus token always from the row
before it, across slot boundaries too, against the model's convention that a
slot's first token comes from the mask row at it).

The cases: a permissive grammar (any text without angle brackets: the mode's
own cost, the model's own text allowed), JSON Schemas (flat, nested, enums
and arrays) and any JSON object. How fast a JSON answer goes depends on the
model knowing JSON: the demo model knows its people's facts as JSON (under
that family's schema), not the other schemas' values.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import List, Optional

from refusion_mlx.bench.report import format_table
from refusion_mlx.cli import OneLineParser, run
from refusion_mlx.decode import constrain
from refusion_mlx.decode.batch import BatchGenerator
from refusion_mlx.decode.grammar import Constraint
from refusion_mlx.decode.params import make_params
from refusion_mlx.decode.stream import chat_prompt
from refusion_mlx.models.loading import load

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "city": {"type": "string", "maxLength": 12},
    "job": {"type": "string", "maxLength": 12}, "pet": {"type": "string", "maxLength": 12}},
    "required": ["name", "city", "job", "pet"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"enum": ["baker", "pilot", "teacher", "cat", "dog"]}, "maxItems": 3}},
    "required": ["person", "tags"], "additionalProperties": False}
CASES = [
    ("free text (/[^<>]*/)", "lark", 'start: /[^<>]*/'),
    ("person schema", "json_schema", PERSON),
    ("nested + enum array", "json_schema", NESTED),
    ("any JSON object", "json_object", None),
]
PROMPTS = ["Who is Sven?", "Tell me about Quinn.", "What does Dara have?", "Describe Sven as JSON."]


def constraint(kind: str, source) -> Constraint:
    if kind == "lark":
        return Constraint.lark(source)
    if kind == "json_schema":
        return Constraint.json_schema(source)
    return Constraint.json_object()


def decode(model, tokenizer, ids, params, c: Optional[Constraint]):
    gen = BatchGenerator(model, tokenizer, max_batch=1)
    gen.insert(ids, params, constraint=c)
    text, last, t0 = "", None, time.perf_counter()
    while gen.has_work:
        for r in gen.step():
            text += r.text
            last = r
    return text, last, time.perf_counter() - t0


def valid(kind: str, source, text: str, finish: str) -> str:
    if finish != "stop":
        return finish
    if kind == "lark":
        return "yes"
    import jsonschema

    try:
        value = json.loads(text)
        jsonschema.validate(value, source if kind == "json_schema" else {"type": "object"})
        return "yes"
    except Exception as e:  # counted as a failure of the guarantee
        return f"NO ({type(e).__name__})"


def per_case(rows: List[dict]) -> List[list]:
    """Each case over its prompts: tokens per forward and tokens/s, free and
    constrained, the constrained mask time per token and the valid answers."""
    out = []
    for name, _, _ in CASES:
        sums = {}
        for mode in ("free", "constrained"):
            mine = [r for r in rows if r["case"] == name and r["mode"] == mode]
            tokens = sum(r["tokens"] for r in mine)
            sums[mode] = (tokens / max(sum(r["forwards"] for r in mine), 1),
                          tokens / max(sum(r["tokens"] / r["tokens_per_second"] for r in mine), 1e-9), mine)
        mine = sums["constrained"][2]
        mask = sum(r["mask_us_per_token"] * r["tokens"] for r in mine) / max(sum(r["tokens"] for r in mine), 1)
        out.append([name, f"{sums['free'][0]:.2f}", f"{sums['constrained'][0]:.2f}",
                    f"{sums['constrained'][0] / sums['free'][0]:.2f}", f"{sums['free'][1]:.0f}",
                    f"{sums['constrained'][1]:.0f}", f"{mask:.0f}",
                    f"{sum(r['valid'] == 'yes' for r in mine)}/{len(mine)}"])
    return out


def apply_variant(variant: str) -> None:
    """Take a part of the constrained mode out (for measuring it only)."""
    if variant == "no-forced":
        class NoForcing:
            def __init__(self, matcher):
                self.matcher = matcher

            def __getattr__(self, name):
                return getattr(self.matcher, name)

            def forced(self):
                return []

        real_after = constrain.after

        def after(state, decided, first, end):
            real, state.matcher = state.matcher, NoForcing(state.matcher)
            try:
                return real_after(state, decided, first, end)
            finally:
                state.matcher = real
        constrain.after = after
    elif variant == "no-drafts":
        constrain.select = lambda *args, **kwargs: []
    elif variant == "no-slot-rule":
        constrain.slot_start = lambda q, response_start, S: False


def main(argv: Optional[List[str]] = None) -> None:
    parser = OneLineParser(prog="python -m benchmarks.constrained", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a model folder (default: the bundled demo model)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--json", metavar="OUT", help="write the rows to this JSON file")
    parser.add_argument("--variant", choices=["full", "no-forced", "no-drafts", "no-slot-rule"], default="full",
                        help="take a part of the constrained mode out, to measure it (default: the mode as is)")
    args = parser.parse_args(argv)
    apply_variant(args.variant)

    def body():
        model, tokenizer = load(args.model)
        params = make_params(max_tokens=args.max_tokens)
        rows, out = [], []
        decode(model, tokenizer, chat_prompt(tokenizer, "warm up"), params, None)  # compile, caches
        totals = {"free": [0, 0, 0.0], "constrained": [0, 0, 0.0]}
        mask = [0.0, 0]
        for name, kind, source in CASES:
            for prompt in PROMPTS:
                ids = chat_prompt(tokenizer, prompt)
                c = constraint(kind, source)
                for label, given in (("free", None), ("constrained", c)):
                    text, last, seconds = decode(model, tokenizer, ids, params, given)
                    s = last.stats
                    t = totals[label]
                    t[0] += s.generated_tokens
                    t[1] += s.forwards
                    t[2] += seconds
                    row = {"case": name, "prompt": prompt, "mode": label, "tokens": s.generated_tokens,
                           "forwards": s.forwards, "tokens_per_forward": round(s.tokens_per_forward, 2),
                           "tokens_per_second": round(s.generated_tokens / seconds, 1),
                           "finish": last.finish_reason}
                    if given is not None:
                        mask[0] += s.mask_seconds
                        mask[1] += s.generated_tokens
                        row["mask_us_per_token"] = round(1e6 * s.mask_seconds / max(s.generated_tokens, 1), 1)
                        row["valid"] = valid(kind, source, text, last.finish_reason)
                    out.append(row)
                    rows.append([name, prompt, label, row["tokens"], row["forwards"], row["tokens_per_forward"],
                                 row["tokens_per_second"], row.get("mask_us_per_token", ""), row["finish"],
                                 row.get("valid", "")])
        print(format_table(["case", "prompt", "mode", "tokens", "forwards", "tok/fwd", "tok/s", "mask us/tok",
                            "finish", "valid"], rows))
        print()
        print(format_table(["case", "tok/fwd free", "tok/fwd constrained", "ratio", "tok/s free",
                            "tok/s constrained", "mask us/tok", "valid"], per_case(out)))
        tpf = {k: v[0] / max(v[1], 1) for k, v in totals.items()}
        summary = {"variant": args.variant, "tokens_per_forward": {k: round(v, 3) for k, v in tpf.items()},
                   "tokens_per_second": {k: round(v[0] / v[2], 1) for k, v in totals.items()},
                   "constrained_over_free_tokens_per_forward": round(tpf["constrained"] / tpf["free"], 3),
                   "mask_us_per_token": round(1e6 * mask[0] / max(mask[1], 1), 1),
                   "valid": sum(r.get("valid") == "yes" for r in out),
                   "constrained_answers": sum(r["mode"] == "constrained" for r in out)}
        print()
        print(json.dumps(summary))
        if args.json:
            Path(args.json).write_text(json.dumps({"summary": summary, "rows": out}, indent=1))
            print(f"wrote {args.json}")
        return 0

    sys.exit(run(body))


if __name__ == "__main__":
    main()
