"""Training data of the conversational demo model: the shared task mix, more
counting rows, and multi-turn conversations built from the same tasks.

* every row of the task mix's ``train.jsonl`` (single turns, as the demo was trained);
* extra counting rows in the mix's own three templates and two formats
  (``Count from 3 to 9.`` -> ``3, 4, 5, 6, 7, 8, 9.`` or ``3 4 5 6 7 8 9.``),
  short ranges included, so the model learns to stop where it is asked;
* conversations of 2 to 4 turns: the earlier turns are other rows of the mix
  (question and reference answer), the last user turn a row of the mix, and
  its answer the training target (the trainer learns the last assistant
  message; everything before it is prompt). Half of them repeat or vary a
  question of the same family, so the context looks like the target.

``valid.jsonl`` (for the trainer's validation loss) is built the same way
from the mix's ``valid.jsonl``; ``conversations.jsonl`` holds 3-turn
conversations over valid rows, for ``python -m refusion_mlx.train.accuracy
--data``, and ``alone.jsonl`` the same third questions asked alone: the two
files' scores compare a question in a conversation with itself asked alone.
Deterministic in ``--seed``.

    python examples/demo_model/build_data.py --tasks ../shared/fixtures/tiny-refusion-tasks --out demo_data
    python -m refusion_mlx.train.accuracy --data demo_data/conversations.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Optional, Sequence

COUNT_TEMPLATES = ("Count from {a} to {b}.", "Please count from {a} up to {b}.", "List the numbers from {a} to {b}.")


def read_jsonl(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_mix(tasks: Path) -> None:
    """One line, not a traceback, when ``tasks`` is not the whole task mix (this repository holds only
    its validation rows, ``examples/demo_model/tasks/valid.jsonl``)."""
    missing = [name for name in ("train.jsonl", "valid.jsonl") if not (tasks / name).is_file()]
    if missing:
        raise SystemExit(f"error: --tasks {tasks} has no {' or '.join(missing)}: the whole task mix is the "
                         "shared fixtures' tiny-refusion-tasks (this repository holds only its valid.jsonl)")


def write_jsonl(path: Path, rows: list) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def counting_row(rng: random.Random) -> dict:
    """One counting row in the mix's templates; ranges of 1 to 30 steps, from 0 to 99."""
    span = rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 9, 10] + list(range(3, 31)))
    a = rng.randint(0, 99 - span)
    b = a + span
    numbers = [str(n) for n in range(a, b + 1)]
    answer = (", " if rng.random() < 0.5 else " ").join(numbers) + "."
    prompt = rng.choice(COUNT_TEMPLATES).format(a=a, b=b)
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


def family_key(row: dict) -> str:
    """A crude family key: the prompt's first two words."""
    return " ".join(row["messages"][0]["content"].split()[:2])


def conversation(rng: random.Random, rows: list, by_family: dict, turns: int, last: Optional[dict] = None) -> dict:
    """``turns`` user/assistant pairs from ``rows``; the last answer (``last``'s, or a random row's) is the target."""
    last = last or rng.choice(rows)
    if rng.random() < 0.5:  # the context holds questions like the last one
        pool = by_family[family_key(last)]
        earlier = [rng.choice(pool) for _ in range(turns - 1)]
    else:
        earlier = [rng.choice(rows) for _ in range(turns - 1)]
    messages = []
    for row in earlier + [last]:
        messages += [dict(m) for m in row["messages"][:2]]
    return {"messages": messages}


def build(tasks: Path, out: Path, seed: int = 0, n_conversations: int = 12000, n_counting: int = 3000,
          n_valid_conversations: int = 200, n_eval_conversations: int = 100,
          focus: Sequence[str] = (), n_focus: int = 0, eval_focus: Sequence[str] = ()) -> dict:
    """Write train/valid/conversations JSONL into ``out``.

    ``focus`` (family keys, such as the times tables' "Show the" and "Write the"), ``n_focus``: that many more
    conversations whose last question is of that family, for a family the
    model answers alone but loses in a conversation. ``eval_focus``: family
    keys the evaluation conversations' third questions are drawn from (default: any row).
    """
    rng = random.Random(seed)
    check_mix(tasks)
    train = read_jsonl(tasks / "train.jsonl")
    valid = read_jsonl(tasks / "valid.jsonl")
    valid_prompts = {r["messages"][0]["content"] for r in valid}
    counting = []
    while len(counting) < n_counting:
        row = counting_row(rng)
        if row["messages"][0]["content"] not in valid_prompts:
            counting.append(row)
    single = train + counting
    by_family: dict = {}
    for row in single:
        by_family.setdefault(family_key(row), []).append(row)
    convs = [conversation(rng, single, by_family, rng.choice((2, 3, 4))) for _ in range(n_conversations)]
    pool = [row for key in focus for row in by_family[key]]
    focused = [conversation(rng, single, by_family, rng.choice((2, 3, 4)), last=rng.choice(pool))
               for _ in range(n_focus if pool else 0)]
    rows = single + convs + focused
    rng.shuffle(rows)

    v_by_family: dict = {}
    for row in valid:
        v_by_family.setdefault(family_key(row), []).append(row)
    v_convs = [conversation(rng, valid, v_by_family, rng.choice((2, 3, 4))) for _ in range(n_valid_conversations)]
    v_pool = [row for key in eval_focus for row in v_by_family.get(key, [])]
    if eval_focus and not v_pool:
        raise SystemExit(f"error: no validation row has a family key among {list(eval_focus)}")
    evals = [conversation(rng, valid, v_by_family, 3, last=rng.choice(v_pool) if v_pool else None)
             for _ in range(n_eval_conversations)]

    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "train.jsonl", rows)
    write_jsonl(out / "valid.jsonl", valid + v_convs)
    write_jsonl(out / "conversations.jsonl", evals)
    write_jsonl(out / "alone.jsonl", [{"messages": row["messages"][-2:]} for row in evals])
    return {"train": len(rows), "task_mix": len(train), "counting": len(counting), "conversations": len(convs) + len(focused),
            "valid": len(valid) + len(v_convs), "eval_conversations": len(evals)}


def build_counting(tasks: Path, out: Path, seed: int = 0, n_train: int = 11800, n_valid: int = 200) -> dict:
    """Counting rows only (``counting_row``), none with a prompt of the mix's validation rows."""
    rng = random.Random(seed)
    held_out = {r["messages"][0]["content"] for r in read_jsonl(tasks / "valid.jsonl")}
    rows = []
    while len(rows) < n_train + n_valid:
        row = counting_row(rng)
        if row["messages"][0]["content"] not in held_out:
            rows.append(row)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "train.jsonl", rows[:n_train])
    write_jsonl(out / "valid.jsonl", rows[n_train:])
    return {"train": n_train, "valid": n_valid}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="../shared/fixtures/tiny-refusion-tasks",
                    help="the shared task mix (train.jsonl, valid.jsonl)")
    ap.add_argument("--out", default="demo_data")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--conversations", type=int, default=12000)
    ap.add_argument("--counting", type=int, default=3000)
    ap.add_argument("--focus", nargs="*", default=(), metavar="KEY",
                    help="family keys (a prompt's first two words) to add conversations ending in")
    ap.add_argument("--focus-conversations", type=int, default=0)
    ap.add_argument("--eval-conversations", type=int, default=100, help="3-turn conversations to evaluate on")
    ap.add_argument("--eval-focus", nargs="*", default=(), metavar="KEY",
                    help="family keys the evaluation conversations end in (default: any)")
    args = ap.parse_args()
    print(build(Path(args.tasks), Path(args.out), args.seed, args.conversations, args.counting,
                n_eval_conversations=args.eval_conversations, focus=tuple(args.focus),
                n_focus=args.focus_conversations, eval_focus=tuple(args.eval_focus)))


if __name__ == "__main__":
    main()
