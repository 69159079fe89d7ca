"""Why the demo model counts past the end: measure it, and test whether training fixes it.

Stopping a count (``Count from 64 to 84.`` -> ``64, 65, ..., 84.``) needs one
decision: after the digits of a number, write ``.`` if that number is the one
the prompt ends with, else a separator. Numbers are single-digit tokens, so
the model has to match the two digits it just wrote against the two after
"to" in the prompt. This script measures that decision teacher-forced, with
no decoding settings in the way:

* ``P(. | end)``: the probability of ``.`` right after the asked end number;
* ``P(. | other)``: the same after every other number of the count;

each read two ways: from the next-token logits of the number's last digit
(``next``), and from one mask placed right after the number (``mask``), which
is how decoding drafts every token (next-token logits only verify).

``--decode N`` also decodes N ranges with the CLI's settings and counts the
answers whose last number is the asked one (and within one of it);
``--context FILE`` (a chat JSONL such as the mix's ``valid.jsonl``) decodes
the same ranges again as the third turn of a conversation, after two rows of
FILE that are not counts (question and reference answer).

A model that compares has the first near 1 and the second near 0; one that
stops by length has them close. ``--train`` fine-tunes on counting rows only
(``build_data.counting_row``) and probes every ``--probe-every`` steps, with
either ReFusion's hybrid objective (``refusion``, what ``refusion_mlx.train``
optimizes) or plain left-to-right next-token prediction over the response
(``ar``, a diagnostic only: ReFusion needs the hybrid objective to plan and
infill). ``--save DIR`` writes the fine-tuned weights as a full fine-tune's
adapter folder, which ``--adapter-path``, ``refusion_mlx.train
--resume-adapter-file`` and ``refusion_mlx.fuse`` read.

    python examples/demo_model/counting_probe.py
    python examples/demo_model/counting_probe.py --train ar --steps 900
    python examples/demo_model/counting_probe.py --adapter-path ADAPTERS --decode 60
    python examples/demo_model/counting_probe.py --decode 60 --context examples/demo_model/tasks/valid.jsonl
    python examples/demo_model/counting_probe.py --train ar --steps 900 --save ar-counting
    python examples/demo_model/counting_probe.py --train refusion --slot-sizes 1,2,4 --steps 600
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import refusion_mlx  # noqa: F401  (loads an optimized BLAS before mlx.core)
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from refusion_mlx.decode.batch import batch_generate
from refusion_mlx.decode.stream import chat_prompt
from refusion_mlx.errors import RefusionError
from refusion_mlx.models.loading import load
from refusion_mlx.train.batches import collate
from refusion_mlx.train.examples import IGNORE, SLOT_SIZES, Example, build_example
from refusion_mlx.train.objective import loss_from_logits
from refusion_mlx.models.adapter_files import save_adapters, write_adapter_config
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_data import counting_row, read_jsonl  # noqa: E402

DEMO = Path(__file__).resolve().parents[2] / "refusion_mlx" / "demo" / "tiny-refusion"


def count_case(tokenizer, a: int, b: int, sep: str) -> Tuple[List[int], List[int], List[int]]:
    """(ids, end positions, other positions) of ``Count from a to b.`` answered up to b.

    A position is the index of a number's last digit, whose logits predict
    the token after the number.
    """
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"Count from {a} to {b}."}],
                                           add_generation_prompt=True)
    ids, ends, others = list(prompt), [], []
    for n in range(a, b + 1):
        ids += tokenizer.encode(str(n), add_special_tokens=False)
        (ends if n == b else others).append(len(ids) - 1)
        if n < b:
            ids += tokenizer.encode(sep, add_special_tokens=False)
    return ids, ends, others


def stop_probabilities(model, tokenizer, cases: Sequence[Tuple[int, int, str]]) -> Dict[str, float]:
    """Mean P(.) after the end number and after the other numbers, teacher-forced."""
    dot = tokenizer.encode(".", add_special_tokens=False)
    if len(dot) != 1:
        raise RefusionError("this tokenizer does not write '.' as one token")
    end, other = [], []
    for a, b, sep in cases:
        ids, ends, others = count_case(tokenizer, a, b, sep)
        logits = model(mx.array([ids]), mx.array([list(range(len(ids)))]))[0]
        p = np.array(mx.softmax(logits.astype(mx.float32), axis=-1)[:, dot[0]])
        end += [p[i] for i in ends]
        other += [p[i] for i in others]
    end_a, other_a = np.array(end), np.array(other)
    return {"end": float(end_a.mean()), "other": float(other_a.mean()),
            "end_over_half": float((end_a > 0.5).mean()), "other_over_half": float((other_a > 0.5).mean())}


def mask_stop_probabilities(model, tokenizer, cases: Sequence[Tuple[int, int, str]]) -> Dict[str, float]:
    """The same decision as decoding drafts it: P(.) at a mask right after each number.

    Decoding never takes a token from the next-token logits; it drafts every
    token from the logits of a mask at that token's position (planning, and
    infill after the accepted prefix of a slot). So one row per number: the
    answer written up to that number, then one mask.
    """
    dot = tokenizer.encode(".", add_special_tokens=False)[0]
    mask_id = model.args.mask_token_id
    end, other = [], []
    for a, b, sep in cases:
        ids, ends, others = count_case(tokenizer, a, b, sep)
        cuts = others + ends
        rows = [ids[:i + 1] + [mask_id] for i in cuts]
        width = max(len(r) for r in rows)
        padded = [r + [mask_id] * (width - len(r)) for r in rows]  # after the mask: causal, never seen
        logits = model(mx.array(padded), mx.array([list(range(width))] * len(rows)))
        at = mx.array([i + 1 for i in cuts])
        p = np.array(mx.softmax(logits[mx.arange(len(rows)), at].astype(mx.float32), axis=-1)[:, dot])
        other += list(p[:len(others)])
        end += list(p[len(others):])
    end_a, other_a = np.array(end), np.array(other)
    return {"end": float(end_a.mean()), "other": float(other_a.mean()),
            "end_over_half": float((end_a > 0.5).mean()), "other_over_half": float((other_a > 0.5).mean())}


def probe_cases(n: int, seed: int = 7) -> List[Tuple[int, int, str]]:
    """``n`` ranges in the task mix's shape: start 0-80, 3-25 steps, either separator."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a = rng.randint(0, 80)
        out.append((a, a + rng.randint(3, 25), rng.choice([", ", " "])))
    return out


def earlier_turns(path: Path, n: int, seed: int = 3) -> List[List[dict]]:
    """``n`` contexts of two turns (question, reference answer) drawn from the
    chat JSONL ``path``, leaving out counting rows (a count before a count
    would hint the format)."""
    try:
        rows = [r["messages"][:2] for r in read_jsonl(path) if "messages" in r]
        rows = [r for r in rows if len(r) == 2 and "count" not in r[0]["content"].lower()]
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise RefusionError(f"--context {path}: cannot read it as chat JSONL ({type(e).__name__}: {e})") from None
    if len(rows) < 2:
        raise RefusionError(f"--context {path}: needs at least two chat rows that are not counts")
    rng = random.Random(seed)
    return [[m for row in rng.sample(rows, 2) for m in row] for _ in range(n)]


def last_number_offsets(model, tokenizer, cases: Sequence[Tuple[int, int, str]],
                        contexts: Optional[Sequence[List[dict]]] = None) -> List[Optional[int]]:
    """Decode ``Count from a to b.`` for every case (CLI settings, greedy): the
    last number written minus b, or None when the answer has no number.
    ``contexts``: earlier turns to ask each count after (one per case)."""
    questions = [f"Count from {a} to {b}." for a, b, _ in cases]
    if contexts is None:
        prompts = [chat_prompt(tokenizer, q) for q in questions]
    else:
        prompts = [tokenizer.apply_chat_template(list(c) + [{"role": "user", "content": q}], add_generation_prompt=True)
                   for c, q in zip(contexts, questions)]
    offsets = []
    for (a, b, _), result in zip(cases, batch_generate(model, tokenizer, prompts)):
        numbers = re.findall(r"\d+", result.text)
        offsets.append(int(numbers[-1]) - b if numbers else None)
    return offsets


def left_to_right_example(prompt: List[int], response: List[int]) -> Example:
    """The response in order, every token labelled with the next one (plain AR)."""
    ids = np.array(prompt + response, np.int32)
    labels = np.full(ids.size, IGNORE, np.int32)
    labels[len(prompt) - 1:-1] = response
    return Example(ids, np.arange(ids.size, dtype=np.int32), labels, np.zeros(ids.size, bool), 1.0, len(response), 0)


def counting_batch(tokenizer, rng: random.Random, nrng: np.random.Generator, size: int, objective: str,
                   mask_id: int, slot_sizes: Sequence[int] = SLOT_SIZES) -> Dict[str, mx.array]:
    """One batch of fresh counting rows under ``objective`` (``refusion`` or ``ar``)."""
    examples = []
    for _ in range(size):
        messages = counting_row(rng)["messages"]
        prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True)
        response = tokenizer.encode(messages[1]["content"], add_special_tokens=False) + [tokenizer.eos_token_id]
        examples.append(left_to_right_example(prompt, response) if objective == "ar"
                        else build_example(prompt, response, mask_id, nrng, slot_sizes))
    return {k: mx.array(v) for k, v in collate(examples).items()}


def train_and_probe(model, tokenizer, args, cases) -> List[dict]:
    """Fine-tune every weight on counting rows, probing as it goes; the probe rows."""
    rng, nrng = random.Random(args.seed), np.random.default_rng(args.seed)
    optimizer = optim.Adam(learning_rate=args.learning_rate)
    weight = getattr(args, "ar_weight", 1.0)
    loss_and_grad = nn.value_and_grad(
        model, lambda m, b: loss_from_logits(m(b["input_ids"], b["position_ids"]), b, ar_weight=weight))
    rows, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = counting_batch(tokenizer, rng, nrng, args.batch_size, args.train, model.args.mask_token_id,
                               getattr(args, "slot_sizes", SLOT_SIZES))
        loss, grads = loss_and_grad(model, batch)
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state, loss)
        if step % args.probe_every == 0 or step == args.steps:
            rows.append(report(step, probe(model, tokenizer, cases), time.perf_counter() - start))
    return rows


def save_full(model, folder: Path, args) -> None:
    """Every weight, as ``refusion_mlx.train --fine-tune-type full`` saves them."""
    write_adapter_config({"fine_tune_type": "full", "num_layers": -1, "train_embeddings": True,
                          "model": args.model, "objective": {"name": args.train},
                          "iters": args.steps, "learning_rate": args.learning_rate,
                          "batch_size": args.batch_size, "seed": args.seed}, folder)
    save_adapters(dict(tree_flatten(model.parameters())), folder)
    print(f"saved to {folder}")


def probe(model, tokenizer, cases) -> Dict[str, Dict[str, float]]:
    """Both readings of the stop: next-token logits and the mask that drafts it."""
    return {"next": stop_probabilities(model, tokenizer, cases), "mask": mask_stop_probabilities(model, tokenizer, cases)}


HEADER = (f"{'step':>6} {'next: P(.|end)':>15} {'P(.|other)':>11} {'end>0.5':>8} "
          f"{'mask: P(.|end)':>15} {'P(.|other)':>11} {'end>0.5':>8} {'seconds':>8}")


def report(step: int, probs: Dict[str, Dict[str, float]], seconds: float) -> dict:
    cells = " ".join(f"{probs[k]['end']:>15.3f} {probs[k]['other']:>11.3f} {probs[k]['end_over_half']:>8.2f}"
                     for k in ("next", "mask"))
    print(f"{step:>6} {cells} {seconds:>8.0f}", flush=True)
    return {"step": step, "seconds": seconds, **probs}


def parse_sizes(text: str) -> Tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return sizes


def print_stops(what: str, offsets: List[Optional[int]]) -> None:
    exact = sum(o == 0 for o in offsets)
    near = sum(o is not None and abs(o) <= 1 for o in offsets)
    print(f"{what} {len(offsets)} ranges: {exact} end at the asked number, {near} within one of it")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEMO))
    ap.add_argument("--adapter-path", help="adapters of refusion_mlx.train to apply")
    ap.add_argument("--decode", type=int, default=0, metavar="N", help="also decode N ranges and count the stops")
    ap.add_argument("--context", type=Path, metavar="FILE",
                    help="with --decode: decode the ranges again as the third turn after two rows of this chat JSONL")
    ap.add_argument("--cases", type=int, default=30, help="counting ranges to probe")
    ap.add_argument("--train", choices=["refusion", "ar"], help="fine-tune on counting rows with this objective")
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--learning-rate", type=float, default=3e-4)
    ap.add_argument("--probe-every", type=int, default=300)
    ap.add_argument("--slot-sizes", type=parse_sizes, default=SLOT_SIZES, metavar="4,8,16,32",
                    help="slot sizes of the hybrid objective (default: the paper's)")
    ap.add_argument("--ar-weight", type=float, default=1.0,
                    help="multiplies the loss's AR term (1: the authors' loss; 1/batch-size: the loss this "
                         "project trained with before the AR term was fixed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", type=Path, metavar="DIR", help="write the fine-tuned weights (with --train)")
    args = ap.parse_args(argv)
    for name in ("cases", "steps", "batch_size", "probe_every"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.decode < 0:
        ap.error("--decode must be 0 or more")
    if not args.ar_weight > 0:
        ap.error("--ar-weight must be positive")
    if args.save and not args.train:
        ap.error("--save needs --train")
    if args.context and not args.decode:
        ap.error("--context needs --decode")
    try:
        model, tokenizer = load(args.model, dtype="float32", join_projections=False, adapter_path=args.adapter_path)
        cases = probe_cases(args.cases)
        print(HEADER)
        report(0, probe(model, tokenizer, cases), 0.0)
        if args.train:
            train_and_probe(model, tokenizer, args, cases)
            if args.save:
                save_full(model, args.save, args)
        if args.decode > 0:
            ranges = probe_cases(args.decode, seed=1)
            print_stops("decoded", last_number_offsets(model, tokenizer, ranges))
            if args.context:
                contexts = earlier_turns(args.context, len(ranges))
                print_stops("as a third turn", last_number_offsets(model, tokenizer, ranges, contexts))
    except RefusionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
