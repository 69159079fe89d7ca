"""``python -m refusion_mlx.bench --layouts ...``: how the response's block
layout moves tokens per forward, tokens per second and exact-match accuracy.

Every row of a chat JSONL (``--data``; the last message is the reference
answer) is decoded alone, greedily, at each budget (``--budgets``), slot size
(``--slot-sizes``) and layout (``--layouts``), with the other decoding
settings as the suite, ``--preset`` and the flags resolve them for each
prompt (``--data``'s rows: the suite's defaults). A layout is

* ``default``: what a request without a layout gets (``RefusionParams``);
* ``count``: the reference's count rule, 32 blocks when they cut the budget
  into whole slots (this project's default before blocks had a fixed length);
* ``N``: blocks of N tokens (rounded up to whole slots);
* ``Ns``: blocks of N slots.

Without ``--data`` the bundled suite's prompts are decoded and accuracy is
not measured. The table and JSON give, per setting, the layout it resolved to
(block length, blocks, slots per block), tokens per forward (answer tokens
over forwards, summed over rows), tokens per second (answer tokens over
decoding seconds, prefill excluded) and exact matches.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Callable, List, Optional, Sequence

from ..cli import positive_int, positive_ints
from ..decode.params import RefusionParams, default_block_length
from ..decode.stream import chat_prompt, stream_generate
from ..train.accuracy import read_rows
from .report import format_table
from .suite import BenchError

LAYOUTS_HELP = ("instead of the AR comparison: decode at every budget, slot size and block layout and "
                "compare tokens per forward, tokens/s and exact matches; layouts: default, count (the "
                "reference's 32 blocks), N (blocks of N tokens) or Ns (N slots), e.g. default,count,16,32")


def layouts_arg(text: str) -> List[str]:
    """--layouts: comma-separated layout names (see the module docstring)."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    for item in items:
        digits = item[:-1] if item.endswith("s") else item
        if item not in ("default", "count") and not (digits.isdigit() and int(digits) > 0):
            raise argparse.ArgumentTypeError(
                f"a layout is default, count, N (tokens per block) or Ns (slots per block), got {item!r}")
    if not items:
        raise argparse.ArgumentTypeError("give at least one layout")
    return items


def add_layout_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layouts", type=layouts_arg, metavar="L,L,...", help=LAYOUTS_HELP)
    parser.add_argument("--budgets", type=positive_ints, metavar="N,N,...",
                        help="with --layouts: response budgets (default 64,128,256,512)")
    parser.add_argument("--slot-sizes", type=positive_ints, metavar="S,S,...",
                        help="with --layouts: slot sizes (default 4,8)")
    parser.add_argument("--data", help="with --layouts: chat JSONL whose last message is the reference answer "
                                       "(exact-match accuracy); default: the suite's prompts, no accuracy")
    parser.add_argument("--limit", type=positive_int, help="with --layouts --data: rows used (default 60)")


def reference_block_count(gen_length: int, slot_size: int, most: int = 32) -> int:
    """The ``count`` layout: the reference's count rule (this project's default
    before blocks had a fixed length), 32 blocks when they cut the budget into
    whole slots, else the largest count below that does."""
    gen = -(-gen_length // slot_size) * slot_size
    return next(c for c in range(most, 0, -1) if gen % c == 0 and (gen // c) % slot_size == 0)


def layout_params(base: RefusionParams, layout: str, budget: int, slot_size: int) -> RefusionParams:
    """``base`` with the budget, slot size and layout of one setting."""
    p = dataclasses.replace(base, gen_length=budget, slot_size=slot_size, block_length=None,
                            serial_num_blocks=None)
    if layout == "count":
        p = dataclasses.replace(p, serial_num_blocks=reference_block_count(budget, slot_size))
    elif layout.endswith("s"):
        p = dataclasses.replace(p, block_length=int(layout[:-1]) * slot_size)
    elif layout != "default":
        p = dataclasses.replace(p, block_length=default_block_length(slot_size, int(layout)))
    return p


@dataclasses.dataclass
class Setting:
    budget: int
    slot_size: int
    layout: str
    resolved: dict
    rows: int = 0
    tokens: int = 0
    forwards: int = 0
    seconds: float = 0.0
    correct: Optional[int] = None

    def as_dict(self) -> dict:
        return {"budget": self.budget, "slot_size": self.slot_size, "layout": self.layout, **self.resolved,
                "rows": self.rows, "tokens": self.tokens, "forwards": self.forwards,
                "tokens_per_forward": round(self.tokens / max(self.forwards, 1), 4),
                "tokens_per_second": round(self.tokens / self.seconds, 2) if self.seconds > 0 else 0.0,
                "correct": self.correct,
                "accuracy": None if self.correct is None else round(self.correct / max(self.rows, 1), 4)}


def sweep(model, tokenizer, conversations: Sequence[Sequence[dict]], answers: Optional[Sequence[str]],
          budgets: Sequence[int], slot_sizes: Sequence[int], layouts: Sequence[str],
          bases: Sequence[RefusionParams] = (), log: Optional[Callable[[str], None]] = None) -> List[Setting]:
    """Decode every conversation alone at every setting; one Setting each.
    ``bases``: each conversation's other settings (thresholds, temperature;
    one for all, or none: the defaults)."""
    prompts = [chat_prompt(tokenizer, list(c)) for c in conversations]
    bases = list(bases) or [RefusionParams()]
    if len(bases) == 1:
        bases *= len(prompts)
    results = []
    for S in slot_sizes:
        for budget in budgets:
            for layout in layouts:
                setting = Setting(budget, S, layout, layout_params(bases[0], layout, budget, S).layout().describe(),
                                  correct=None if answers is None else 0)
                for i, ids in enumerate(prompts):
                    text, last = "", None
                    p = layout_params(bases[i], layout, budget, S)
                    for last in stream_generate(model, tokenizer, ids, params=p):
                        text += last.text
                    stats = last.stats
                    setting.rows += 1
                    setting.tokens += stats.generated_tokens
                    setting.forwards += stats.forwards
                    setting.seconds += stats.total_seconds - stats.seconds["prefill"]
                    if answers is not None and text == answers[i]:
                        setting.correct += 1
                if log:
                    d = setting.as_dict()
                    log(f"S={S} budget={budget} {layout}: {d['tokens_per_forward']} tok/forward, "
                        f"{d['tokens_per_second']} tok/s, correct {setting.correct}")
                results.append(setting)
    return results


def format_layouts(results: Sequence[Setting]) -> str:
    rows = []
    for r in results:
        d = r.as_dict()
        rows.append([d["slot_size"], d["budget"], d["layout"], d["block_length"], d["blocks"],
                     d["slots_per_block"], f"{d['tokens_per_forward']:.2f}", f"{d['tokens_per_second']:.1f}",
                     "-" if d["correct"] is None else f"{d['correct']}/{d['rows']}"])
    return format_table(["slot", "budget", "layout", "block tokens", "blocks", "slots/block", "tok/forward",
                         "tok/s", "exact"], rows)


def run_layouts(args, model, tokenizer, suite, bases: Sequence[RefusionParams], log) -> dict:
    """The --layouts report: the table, and every setting as a dict. ``bases``: the settings of each of the
    suite's prompts, or the one of --data's rows."""
    if args.data:
        rows = read_rows(args.data, args.limit)
        conversations = [r["messages"][:-1] for r in rows]
        answers = [r["messages"][-1]["content"] for r in rows]
    else:
        conversations = [([{"role": "system", "content": c.system}] if c.system else [])
                         + [{"role": "user", "content": c.prompt}] for c in suite.cases]
        answers = None
    for S in args.slot_sizes:
        for layout in args.layouts:
            try:
                layout_params(bases[0], layout, args.budgets[0], S).layout()
            except Exception as e:  # DecodeError: a layout that cannot cut these slots
                raise BenchError(f"layout {layout} with slot size {S}: {e}") from None
    results = sweep(model, tokenizer, conversations, answers, args.budgets, args.slot_sizes, args.layouts,
                    bases, log)
    return {"layouts": [r.as_dict() for r in results], "data": args.data or "suite prompts",
            "rows": len(conversations), "table": format_layouts(results)}
