"""Tool calls and JSON of the demo model, on the held-out checks of tool_data.eval_files.

For every row the model decodes the conversation before the reference
(tools included, through the chat template), greedily with the CLI's
settings, as ``python -m refusion_mlx.train.accuracy`` does (budget: twice
the reference, in whole blocks). Then:

* a call (``tools_alone``, ``tools_later``): the answer's ``<tool_call>``
  blocks are parsed as the server's parser (mlx-lm's ``json_tools``) reads
  them; *parsed*: exactly one block, a JSON object with a ``name`` and an
  ``arguments`` object, nothing else in the answer; *name*: the right tool;
  *arguments*: equal to the reference's (as JSON values); *exact*: the text
  is the reference's;
* an answer after the tool's result (``tool_answers``; ``tool_other``: a
  result of another shape or another tool's) or with tools that do not serve
  the question (``tools_direct``): exact, and no call;
* ``tool_other_calls``: the other tools' calls, scored as the calls above;
* JSON (``json``): *valid*: the answer parses as a JSON object; *correct*:
  it equals the reference object; *exact*: the text is the reference's.

Calls and answers are also split by question kind: a known person (the
25), a person outside them (held-out names), arithmetic, another tool.

    python examples/demo_model/tool_data.py --eval --out tool_checks
    python examples/demo_model/tool_eval.py --data tool_checks [--model M] [--adapter-path A] [--json out.json]

``--constrained`` decodes as the server does for ``strict`` tools: rows
with tools under "text, then maybe calls whose arguments follow their
tool's schema" (``Constraint.tool_calls(..., optional=True)``), JSON rows
under the family's schema (``tool_data.FACTS_SCHEMA``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import refusion_mlx  # noqa: E402,F401  (before mlx.core: optimized BLAS on Linux)
from tool_data import FACTS_SCHEMA, HELD_OUT_NAMES, NEW_NAMES, read_jsonl  # noqa: E402

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
FILES = ("tools_alone", "tools_later", "tools_system", "tool_answers", "tools_direct", "json", "tool_other",
         "tool_other_calls")
CALL_FILES = ("tools_alone", "tools_later", "tools_system", "tool_other_calls")


def parse_calls(text: str) -> Optional[List[dict]]:
    """The calls of an answer, as the server reads them; None when a block does
    not parse or the answer holds anything but calls."""
    blocks = CALL.findall(text)
    if not blocks or CALL.sub("", text).strip():
        return None
    calls = []
    for block in blocks:
        try:
            call = json.loads(block.strip())
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) \
                or not isinstance(call.get("arguments"), dict):
            return None
        calls.append(call)
    return calls


def reference_call(row: dict) -> dict:
    fn = row["messages"][-1]["tool_calls"][0]["function"]
    args = fn["arguments"]
    return {"name": fn["name"], "arguments": json.loads(args) if isinstance(args, str) else args}


def kind(row: dict) -> str:
    """Known person, new person or arithmetic: from the turn's call."""
    calls = [m for m in row["messages"] if m.get("tool_calls")]
    call = reference_call({"messages": calls[-1:]}) if calls else None
    if call is None:
        return "direct"
    if call["name"] == "calculator":
        return "arithmetic"
    if call["name"] != "lookup_person":
        return "other tool"
    return "new person" if call["arguments"].get("name") in HELD_OUT_NAMES + NEW_NAMES else "known person"


def score_file(name: str, rows: List[dict], texts: List[str], references: List[str]) -> Dict[str, dict]:
    """Counts per question kind (and ``all``) for one file's rows and the decoded texts."""
    out: Dict[str, dict] = {}

    def add(group: str, **hits) -> None:
        c = out.setdefault(group, {"total": 0})
        c["total"] += 1
        for key, ok in hits.items():
            c[key] = c.get(key, 0) + int(bool(ok))

    for row, text, ref in zip(rows, texts, references):
        if name in CALL_FILES:
            calls, want = parse_calls(text), reference_call(row)
            one = calls is not None and len(calls) == 1
            hits = dict(parsed=one, name=one and calls[0]["name"] == want["name"],
                        arguments=one and calls[0] == want, exact=text == ref)
        elif name == "json":
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                value = None
            hits = dict(valid=isinstance(value, dict), correct=value == json.loads(ref), exact=text == ref)
        else:
            hits = dict(exact=text == ref, no_call="<tool_call>" not in text)
        add("all", **hits)
        if name != "json":
            add(kind(row), **hits)
    return out


def constraint_of(row: dict):
    """What ``--constrained`` decodes a row under: its tools' optional calls, or the family's schema."""
    from refusion_mlx.decode.grammar import Constraint

    if row.get("tools"):
        spec = [{"name": t["function"]["name"], "parameters": t["function"].get("parameters")} for t in row["tools"]]
        return Constraint.tool_calls(spec, "<tool_call>", "</tool_call>", optional=True)
    return Constraint.json_schema(FACTS_SCHEMA) if row.get("family") == "json" else None


def evaluate(model, tokenizer, folder: Path, files=FILES, keep: int = 3, constrained: bool = False) -> dict:
    from refusion_mlx.train.accuracy import answer_budget, decode, default_params, reference

    params = default_params()
    result = {}
    for name in files:
        rows = read_jsonl(folder / f"{name}.jsonl")
        references = [reference(tokenizer, row) for row in rows]
        settings = [dataclasses.replace(params, gen_length=answer_budget(tokenizer, ref)) for ref in references]
        constraints = [constraint_of(r) for r in rows] if constrained else None
        texts = decode(model, tokenizer, [r["messages"][:-1] for r in rows], settings, [r.get("tools") for r in rows],
                       constraints=constraints)
        result[name] = score_file(name, rows, texts, references)
        result[name]["failures"] = [{"expected": ref, "got": text} for text, ref in zip(texts, references)
                                    if text != ref][:keep]
    return result


def format_result(result: dict) -> str:
    lines = []
    for name, groups in result.items():
        for group, counts in groups.items():
            if group == "failures":
                continue
            n = counts["total"]
            cells = "  ".join(f"{k} {v}/{n}" for k, v in counts.items() if k != "total")
            lines.append(f"{name:<13} {group:<13} {cells}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="the folder tool_data.py --eval wrote")
    ap.add_argument("--model", help="model folder (default: the bundled demo)")
    ap.add_argument("--adapter-path", help="adapters to apply")
    ap.add_argument("--files", nargs="*", default=list(FILES), choices=FILES)
    ap.add_argument("--json", dest="json_out", help="write the result here")
    ap.add_argument("--show-failures", action="store_true")
    ap.add_argument("--constrained", action="store_true",
                    help="decode as for strict tools: calls follow their schemas, JSON the family's")
    args = ap.parse_args()
    from refusion_mlx.models.loading import load

    model, tokenizer = load(args.model, dtype="float32", adapter_path=args.adapter_path)
    result = evaluate(model, tokenizer, Path(args.data), args.files, constrained=args.constrained)
    print(format_result(result))
    if args.show_failures:
        for name, groups in result.items():
            for item in groups["failures"]:
                print(f"[{name}]\n  expected {item['expected']!r}\n  got      {item['got']!r}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
