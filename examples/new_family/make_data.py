"""Data of the new-family experiment: a task the demo model has never seen,
mixed with a replay sample of the tasks it knows.

The new family (``--family``), by default "capitals": ``Write in capital
letters: planet stone banana`` -> ``PLANET STONE BANANA`` (2 to 5 of the 22
words the model knows from its reversing and spelling tasks; capital letters
are bytes it has hardly ever produced). "doubling" (``Double each number: 4,
9, 13`` -> ``8, 18, 26``) is the harder alternative: digit arithmetic, which
the demo model never learned (0% on its own addition prompts). Test prompts
are disjoint from the training and validation prompts. Everything is drawn from ``--seed``, so the files are
reproducible; the replay rows and the old families' validation set are the
committed sample in ``data/`` (taken from the shared fixture task mix with
``--refresh-sample``; nothing else reads outside the repository).

    python examples/new_family/make_data.py --out /tmp/new_family_data
    # -> train.jsonl valid.jsonl (the trainer's), test.jsonl (new family only),
    #    old_valid.jsonl (the old families' 500 validation rows)
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SAMPLE = HERE / "data"
WORDS = ("apple", "banana", "candle", "cloud", "coffee", "forest", "garden", "green", "light", "orange", "paper",
         "planet", "river", "rocket", "silver", "stone", "sugar", "summer", "table", "window", "winter", "yellow")


def row(prompt: str, answer: str, family: str) -> dict:
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}],
            "family": family}


def capitals_row(rng: random.Random) -> dict:
    words = [rng.choice(WORDS) for _ in range(rng.randint(2, 5))]
    return row("Write in capital letters: " + " ".join(words), " ".join(words).upper(), "capitals")


def doubling_row(rng: random.Random) -> dict:
    numbers = [rng.randint(1, 30) for _ in range(rng.randint(3, 6))]
    return row("Double each number: " + ", ".join(map(str, numbers)), ", ".join(str(2 * n) for n in numbers),
               "doubling")


def dashes_row(rng: random.Random) -> dict:
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 7))]
    return row("Join the words with dashes: " + " ".join(words), "-".join(words), "dashes")


def commas_row(rng: random.Random) -> dict:
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 7))]
    return row("Put commas between the words: " + " ".join(words), ", ".join(words), "commas")


def parity_row(rng: random.Random) -> dict:
    n = rng.randint(0, 9999)
    return row(f"Is {n} even or odd?", f"{n} is {'odd' if n % 2 else 'even'}.", "parity")


GENERATORS = {"capitals": capitals_row, "commas": commas_row, "dashes": dashes_row, "doubling": doubling_row,
              "parity": parity_row}


def new_family(rng: random.Random, n: int, taken: set, family: str = "capitals") -> list:
    rows, tries = [], 0
    while len(rows) < n:
        tries += 1
        if tries > 100 * n + 10000:
            raise SystemExit(f"{family}: not enough distinct prompts for {n} more rows")
        r = GENERATORS[family](rng)
        prompt = r["messages"][0]["content"]
        if prompt not in taken:
            taken.add(prompt)
            rows.append(r)
    return rows


def read_jsonl(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def refresh_sample(tasks: Path, n_replay: int, seed: int) -> None:
    """Copy a seeded replay sample of the old task mix and its validation set into data/."""
    rng = random.Random(seed)
    train = read_jsonl(tasks / "train.jsonl")
    SAMPLE.mkdir(exist_ok=True)
    write_jsonl(SAMPLE / "replay.jsonl", rng.sample(train, n_replay))
    write_jsonl(SAMPLE / "old_valid.jsonl", read_jsonl(tasks / "valid.jsonl"))


def make(out: Path, seed: int = 0, n_train: int = 1500, n_valid: int = 60, n_test: int = 200,
         replay: float = 1.0, family: str = "capitals") -> dict:
    """Write the experiment's data folder; ``replay``: old-task rows per new-family training row."""
    rng = random.Random(seed)
    taken: set = set()
    test = new_family(rng, n_test, taken, family)   # drawn first: train and valid never repeat them
    train_new = new_family(rng, n_train, taken, family)
    valid_new = new_family(rng, n_valid, taken, family)
    old = read_jsonl(SAMPLE / "replay.jsonl")
    rng.shuffle(old)
    old_valid, pool = old[-40:], old[:-40]   # 40 replay rows for the trainer's validation loss
    k = int(round(replay * n_train))
    replayed = pool[:k] + [rng.choice(pool) for _ in range(k - len(pool))]  # repeats once the pool is used
    train = train_new + replayed
    rng.shuffle(train)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "valid.jsonl", valid_new + old_valid)
    write_jsonl(out / "test.jsonl", test)
    write_jsonl(out / "old_valid.jsonl", read_jsonl(SAMPLE / "old_valid.jsonl"))
    return {"train": len(train), "train_new": len(train_new), "replay": k, "test": len(test)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="new_family_data", help="output folder")
    ap.add_argument("--family", choices=sorted(GENERATORS), default="capitals")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-train", type=int, default=1500, help="new-family training rows")
    ap.add_argument("--n-test", type=int, default=200, help="new-family test rows (unseen prompts)")
    ap.add_argument("--replay", type=float, default=1.0, help="old-task rows per new-family training row")
    ap.add_argument("--refresh-sample", metavar="TASKS_DIR",
                    help="re-copy data/ from the shared task mix (train.jsonl, valid.jsonl) first")
    ap.add_argument("--n-replay-sample", type=int, default=1500)
    args = ap.parse_args()
    if args.refresh_sample:
        refresh_sample(Path(args.refresh_sample), args.n_replay_sample, args.seed)
    print(make(Path(args.out), args.seed, args.n_train, n_test=args.n_test, replay=args.replay, family=args.family))


if __name__ == "__main__":
    main()
