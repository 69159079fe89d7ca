"""Exact-match evaluation over a chat JSONL file: ``python -m refusion_mlx.train.accuracy``.

Each row is ``{"messages": [...]}`` (mlx-lm's chat format, optionally with
``"tools"``; a content may be OpenAI's text parts, read as train reads them)
whose last message is the assistant's reference answer. The model decodes
the conversation before it (system, tools and earlier turns included,
through the chat template), greedily, and the row counts as
correct when the answer's text equals the reference exactly: its content,
or for a reference that calls tools (``tool_calls``), the text the chat
template renders for the calls. Rows are grouped into task families: a row's ``"family"``
field when it has one, else a regex on its last user message (the demo
model's task templates; anything else is ``other``).

Budget: the CLI's default layout (blocks of 16 tokens, as 512 tokens in 32
blocks) with a response budget of twice the reference's token count, rounded
up to whole blocks (at most 512), so an answer that stops where it should is
decoded exactly as ``python -m refusion_mlx.generate`` would decode it;
``--max-tokens`` fixes one budget for every row instead.

```bash
python -m refusion_mlx.train.accuracy --data valid.jsonl
python -m refusion_mlx.train.accuracy --model M --adapter-path adapters --data test.jsonl --json out.json
```
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence

from ..decode.params import RefusionParams, default_block_length
from .._json import lines
from ..errors import RefusionError

# The demo model's task templates (refusion_mlx/demo/tiny-refusion), first match wins.
FAMILIES = (
    ("counting", r"^(please )?count from -?\d+ (up )?to -?\d+|^list the numbers from"),
    ("times_table", r"^write the multiplication table of|^show the times table for"),
    ("addition", r"^(what is|compute) -?\d+ \+ -?\d+|^please add -?\d+ and"),
    ("subtraction", r"^(what is|compute) -?\d+ - -?\d+|^please subtract -?\d+ and"),
    ("multiplication", r"^(what is|compute) -?\d+ \* -?\d+|^please multiply -?\d+ and"),
    ("people", r"^who is [a-z]+\?$|^tell me about |^describe [a-z]+\.$|^what pet does |^what is the job of "
               r"|^where does [a-z]+ live\?"),
    ("python", r"^write a python function"),
    ("reversing", r"^reverse the words:"),
    ("spelling", r"^spell the word"),
    ("repeating", r"^repeat the word"),
    ("sorting", r"^sort these numbers:"),
)
_COMPILED = [(name, re.compile(rx, re.IGNORECASE)) for name, rx in FAMILIES]
OTHER = "other"
BATCH = 16  # requests decoded together
MAX_BUDGET = 512


def family_of_prompt(prompt: str) -> str:
    """The task family of a user prompt (``other`` when no template matches)."""
    text = prompt.strip()
    for name, rx in _COMPILED:
        if rx.search(text):
            return name
    return OTHER


def row_family(row: dict) -> str:
    """A row's ``family`` field, else the family of its last user message."""
    if isinstance(row.get("family"), str) and row["family"]:
        return row["family"]
    return family_of_prompt(last_question(row["messages"]))


def last_question(messages: Sequence[dict]) -> str:
    """The text of the last user message (empty when there is none)."""
    users = [m.get("content") or "" for m in messages if m.get("role") == "user"]
    return users[-1] if users else ""


def read_rows(path, limit: Optional[int] = None) -> List[dict]:
    """Chat rows of a JSONL file, checked: messages ending with an assistant answer."""
    from .dataset import text_messages

    rows = []
    p = Path(path).expanduser()
    if not p.is_file():
        raise RefusionError(f"--data {path}: no such file")
    try:
        text = p.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise RefusionError(f"--data {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    for n, line in enumerate(lines(text), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise RefusionError(f"{path}:{n}: not valid JSON: {e}") from None
        messages = text_messages(row.get("messages"), f"{path}:{n}") if isinstance(row, dict) else None
        if (not isinstance(messages, list) or len(messages) < 2
                or not all(isinstance(m, dict) and (isinstance(m.get("content"), str) or m.get("tool_calls"))
                           for m in messages)
                or messages[-1].get("role") != "assistant" or messages[-2].get("role") not in ("user", "tool")):
            raise RefusionError(f"{path}:{n}: a row needs \"messages\" ending with a user turn (or a tool's "
                                "result) and the assistant's reference answer")
        rows.append({**row, "messages": messages})
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise RefusionError(f"--data {path}: no rows (a JSON object with \"messages\" a line)")
    return rows


def answer_budget(tokenizer, reference: str, block_length: Optional[int] = None, cap: int = MAX_BUDGET) -> int:
    """Twice the reference's tokens (EOS included), rounded up to whole blocks, at most ``cap``."""
    block_length = block_length or default_block_length(RefusionParams.slot_size)
    need = 2 * (len(tokenizer.encode(reference)) + 1)
    return max(block_length, min(cap, -(-need // block_length) * block_length))


def default_params() -> RefusionParams:
    return RefusionParams()


def decode(model, tokenizer, conversations: Sequence[Sequence[dict]], params: Sequence,
           tools: Optional[Sequence] = None, kv: Optional[dict] = None,
           constraints: Optional[Sequence] = None) -> List[str]:
    """The model's greedy answers to many conversations (the one place that
    decodes): decoded together, each exactly as it would be alone.
    ``tools``: each conversation's tools (None: none); ``kv``: ``kv_bits``
    and ``kv_group_size`` of their caches; ``constraints``: each answer's
    :class:`~refusion_mlx.decode.grammar.Constraint` (None: unconstrained)."""
    from ..decode.batch import batch_generate
    from .dataset import prompt_ids

    tools = tools or [None] * len(conversations)
    prompts = [prompt_ids(tokenizer, list(m), t) for m, t in zip(conversations, tools)]
    return [r.text for r in batch_generate(model, tokenizer, prompts, list(params), max_batch=BATCH,
                                           constraints=constraints, **(kv or {}))]


def reference(tokenizer, row: dict) -> str:
    """A row's reference answer as text (a call as the chat template renders it)."""
    from .dataset import response_text

    return response_text(tokenizer, row["messages"], row.get("tools"))


def exact_match(model, tokenizer, rows: Iterable[dict], params=None,
                family_of: Optional[Callable[[dict], str]] = None, max_tokens: Optional[int] = None,
                progress: Optional[Callable[[int, int], None]] = None, keep_failures: int = 3,
                kv: Optional[dict] = None) -> dict:
    """Exact-match accuracy of ``model`` over chat ``rows``, per family.

    ``params``: RefusionParams (default: the CLI's, blocks of 16 tokens); its
    ``gen_length`` is replaced per row by ``answer_budget`` unless
    ``max_tokens`` is given. ``family_of(row)`` names a row's family (default:
    ``row_family``). Returns ``{"families": {name: {"correct", "total",
    "accuracy"}}, "correct", "total", "accuracy", "seconds", "failures":
    {name: [{"prompt", "expected", "got"}, ...]}}`` (up to ``keep_failures``
    failures kept per family). ``kv``: ``kv_bits`` / ``kv_group_size`` (a quantized KV cache).
    """
    params = params or default_params()
    family_of = family_of or row_family
    rows = list(rows)
    counts: Dict[str, List[int]] = {}
    failures: Dict[str, List[dict]] = {}
    start = time.perf_counter()
    settings = []
    block = params.block_length or default_block_length(params.slot_size)
    references = [reference(tokenizer, row) for row in rows]
    for ref in references:
        budget = max_tokens
        if budget is None:
            budget = answer_budget(tokenizer, ref, block)
        settings.append(dataclasses.replace(params, gen_length=budget))
    texts: List[str] = []
    for i in range(0, len(rows), 4 * BATCH):  # in chunks, so progress can be shown
        chunk = rows[i:i + 4 * BATCH]
        texts += decode(model, tokenizer, [r["messages"][:-1] for r in chunk], settings[i:i + len(chunk)],
                        [r.get("tools") for r in chunk], kv)
        if progress is not None:
            progress(len(texts), len(rows))
    for row, text, ref in zip(rows, texts, references):
        fam = family_of(row)
        c = counts.setdefault(fam, [0, 0])
        c[1] += 1
        if text == ref:
            c[0] += 1
        elif len(failures.setdefault(fam, [])) < keep_failures:
            failures[fam].append({"prompt": last_question(row["messages"]), "expected": ref, "got": text})
    correct = sum(c for c, _ in counts.values())
    total = sum(n for _, n in counts.values())
    return {
        "families": {f: {"correct": c, "total": n, "accuracy": c / n} for f, (c, n) in sorted(counts.items())},
        "correct": correct, "total": total, "accuracy": correct / total if total else 0.0,
        "seconds": time.perf_counter() - start, "failures": failures,
    }


def format_table(result: dict, before: Optional[dict] = None) -> str:
    """A text table of ``exact_match``'s result (with a ``before`` column when given)."""
    lines = [f"{'family':<16} {'before':>14} {'after':>14}" if before else f"{'family':<16} {'correct':>14}"]

    def cell(r, fam=None):
        if r is None:
            return ""
        c, n = ((r["families"][fam]["correct"], r["families"][fam]["total"]) if fam
                else (r["correct"], r["total"])) if (fam is None or fam in r["families"]) else (0, 0)
        return f"{c}/{n} {100 * c / n:5.1f}%" if n else "-"

    fams = sorted(set(result["families"]) | set(before["families"] if before else ()))
    for fam in fams:
        lines.append(f"{fam:<16} {cell(before, fam):>14} {cell(result, fam):>14}" if before
                     else f"{fam:<16} {cell(result, fam):>14}")
    lines.append(f"{'all':<16} {cell(before):>14} {cell(result):>14}" if before
                 else f"{'all':<16} {cell(result):>14}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from ..cli import OneLineParser, add_decoding_args, add_kv_args, add_model_args, count, output_file, positive_int

    parser = OneLineParser(prog="python -m refusion_mlx.train.accuracy",
                           description="Exact-match accuracy of a model's answers to the last user turn of "
                                       "each row of a chat JSONL file, per task family.")
    add_model_args(parser)  # --model, --adapter-path, --dtype
    parser.add_argument("--data", required=True, help="chat JSONL file (rows ending with the reference answer)")
    parser.add_argument("--limit", type=positive_int, help="evaluate the first N rows only")
    parser.add_argument("--json", dest="json_out", type=output_file, help="write the result as JSON to this file")
    parser.add_argument("--show-failures", type=count, default=0, metavar="N",
                        help="print up to N wrong answers per family")
    add_decoding_args(parser)
    add_kv_args(parser)
    parser.set_defaults(block_length=None)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    from ..cli import run

    parser = build_parser()
    args = parser.parse_args(argv)
    from ..decode.params import PARAM_NAMES, make_params

    values = {name: getattr(args, name) for name in PARAM_NAMES if name != "gen_length"}
    try:  # a preset's blocks are a block length (decode/presets.py): its own whatever the budget
        params = make_params(preset=args.preset, **values)
        dataclasses.replace(params, gen_length=args.gen_length or MAX_BUDGET).layout()
    except RefusionError as e:
        parser.error(str(e))

    def body() -> int:
        from ..cli import check_writable, storage_from_args, write_text
        from ..models.loading import load

        storage_from_args(args)  # a bad --kv-bits / --kv-group-size pair fails before anything loads
        if args.json_out:
            try:
                check_writable(args.json_out)  # before the evaluation, not after it
            except OSError as e:
                raise RefusionError(f"cannot write {args.json_out}: {e.strerror or e}") from None
        rows = read_rows(args.data, args.limit)
        model, tokenizer = load(args.model, dtype=args.dtype, adapter_path=args.adapter_path)
        kv = {"kv_bits": args.kv_bits, "kv_group_size": args.kv_group_size}
        storage_from_args(args, model)
        tty = sys.stderr.isatty()

        def progress(i, n):
            if tty:
                print(f"\r{i}/{n}", end="" if i < n else "\n", file=sys.stderr, flush=True)

        result = exact_match(model, tokenizer, rows, params, max_tokens=args.gen_length, progress=progress, kv=kv)
        print(format_table(result))
        print(f"{result['total']} rows in {result['seconds']:.1f} s")
        for fam, items in result["failures"].items():
            for item in items[: args.show_failures]:
                print(f"[{fam}] {item['prompt']!r}\n  expected {item['expected']!r}\n  got      {item['got']!r}")
        if args.json_out:
            try:
                write_text(args.json_out, json.dumps(result, indent=1) + "\n")
            except OSError as e:
                raise RefusionError(f"cannot write {args.json_out}: {e.strerror or e}") from None
        return 0

    return run(body)


if __name__ == "__main__":
    sys.exit(main())
