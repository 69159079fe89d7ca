"""Teach the fixture model a task family it has never seen, without erasing the ones it knows.

1. ``make_data.py``: the new family (train / valid / unseen test prompts); the
   old task mix's replay sample (``data/replay.jsonl``) is mixed in by the
   trainer (``--replay-data``, one old row per new row);
2. measure the model before (``--model``, default the test fixture: the
   demo's original weights, trained on the shared task mix): the new family's test prompts and the old
   families' 500 validation rows (``refusion_mlx.train.accuracy``);
3. fine-tune with ``refusion_mlx.train`` (``recipe.yaml``: a full fine-tune
   with the embeddings, 1500 steps; any trainer option as a flag after ``--``);
4. measure again with the adapters, fuse them (``refusion_mlx.fuse``) and
   check the fused folder answers the same;
5. print the before/after table, the targets (new family >= 85% exact, old
   families at least 95% of their accuracy before) and the wall time.

    python examples/new_family/run.py                                   # recipe.yaml next to this file
    python examples/new_family/run.py --config none                     # the trainer's own defaults
    python examples/new_family/run.py --family doubling -- --iters 3000  # trainer flags after --
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import refusion_mlx  # noqa: E402,F401  (before mlx: an optimized BLAS)
from refusion_mlx.models.loading import load  # noqa: E402
from refusion_mlx.train import fine_tune  # noqa: E402
from refusion_mlx.train.accuracy import exact_match, format_table, read_rows  # noqa: E402

import make_data  # noqa: E402

NEW_TARGET = 0.85
OLD_KEEP = 0.95


def trainer_options(extra):
    """``--name value`` / ``--flag`` pairs after ``--`` as fine_tune keywords."""
    from refusion_mlx.train.__main__ import build_parser

    return {k: v for k, v in vars(build_parser().parse_args(["--data", "x"] + list(extra))).items()
            if v is not None and k != "data"}


def measure(model, tokenizer, new_rows, old_rows):
    return {"new": exact_match(model, tokenizer, new_rows), "old": exact_match(model, tokenizer, old_rows)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="new_family_run", help="working folder (data, adapters, fused model)")
    ap.add_argument("--model", default=str(HERE.parents[1] / "tests" / "fixtures" / "tiny-refusion"),
                    help="the model to teach (default: the test fixture, trained on the task mix)")
    ap.add_argument("--family", default="parity", choices=sorted(make_data.GENERATORS))
    ap.add_argument("--config", default=str(HERE / "recipe.yaml"),
                    help="trainer YAML recipe ('none': the trainer's defaults)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-test", type=int, default=200)
    ap.add_argument("--no-fuse", action="store_true", help="skip fusing the adapters")
    ap.add_argument("--json", help="write every number as JSON here")
    ap.add_argument("trainer_args", nargs=argparse.REMAINDER, help="-- then refusion_mlx.train flags")
    args = ap.parse_args()
    extra = args.trainer_args[1:] if args.trainer_args[:1] == ["--"] else args.trainer_args
    start = time.perf_counter()
    out = Path(args.out)
    data = out / "data"
    print("data:", make_data.make(data, seed=args.seed, n_test=args.n_test, family=args.family, replay=0.0))
    new_rows, old_rows = read_rows(data / "test.jsonl"), read_rows(data / "old_valid.jsonl")

    model, tokenizer = load(args.model, dtype="float32")
    before = measure(model, tokenizer, new_rows, old_rows)
    del model
    print(f"before: {time.perf_counter() - start:.0f} s")

    options = {"model": args.model, "replay_data": str(make_data.SAMPLE / "replay.jsonl"), **trainer_options(extra)}
    if args.config != "none":
        options["config"] = args.config
    t0 = time.perf_counter()
    _, _, result = fine_tune(data=str(data), adapter_path=str(out / "adapters"), progress=False,
                       report=lambda s: print(s, flush=True), **options)
    train_s = time.perf_counter() - t0

    model, tokenizer = load(args.model, dtype="float32", adapter_path=out / "adapters")
    after = measure(model, tokenizer, new_rows, old_rows)
    fused_same = None
    if not args.no_fuse:
        from refusion_mlx.convert.fusion import fuse

        fused_dir = fuse(args.model, out / "adapters", out / "fused", force=True)
        fmodel, ftok = load(fused_dir, dtype="float32")
        fused = exact_match(fmodel, ftok, new_rows[:50])
        fused_same = fused["correct"], fused["total"]
    wall = time.perf_counter() - start

    new_acc, old_before, old_after = after["new"]["accuracy"], before["old"]["accuracy"], after["old"]["accuracy"]
    print()
    print(f"new family ({args.family}), {len(new_rows)} unseen prompts:")
    print(format_table(after["new"], before["new"]))
    print(f"\nold families, {len(old_rows)} validation rows:")
    print(format_table(after["old"], before["old"]))
    print()
    print(f"training: {result.iterations if result else 0} iterations in {train_s:.0f} s")
    if fused_same:
        (correct, total), first = fused_same, "first " if fused_same[1] < len(new_rows) else ""
        print(f"fused model (bf16 weights), {first}{total} unseen prompts: {correct}/{total} exact")
    ok_new = new_acc >= NEW_TARGET
    ok_old = old_after >= OLD_KEEP * old_before
    print(f"new family: {100 * new_acc:.1f}% (target >= {100 * NEW_TARGET:.0f}%): {'ok' if ok_new else 'MISSED'}")
    print(f"old families: {100 * old_before:.1f}% -> {100 * old_after:.1f}% "
          f"(target >= {100 * OLD_KEEP * old_before:.1f}%): {'ok' if ok_old else 'MISSED'}")
    print(f"wall time: {wall:.0f} s (target < 600 s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"before": before, "after": after, "train_seconds": train_s,
                                               "wall_seconds": wall, "fused": fused_same,
                                               "options": options, "family": args.family}, indent=1))
    return 0 if ok_new and ok_old and wall < 600 else 1


if __name__ == "__main__":
    sys.exit(main())
