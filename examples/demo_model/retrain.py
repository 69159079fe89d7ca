"""Retrain the bundled demo model to hold a conversation, with refusion_mlx.train.

Three stages of full fine-tuning from the weights the demo shipped with (kept as
tests/fixtures/tiny-refusion; recipe: retrain.yaml):

1. 500 steps on the shared task mix + 3000 counting rows + 12000 multi-turn
   conversations built from the mix (``build_data.py --seed 0``);
2. 1400 more steps, resumed from stage 1, on the mix + 30000 conversations
   (``build_data.py --seed 1 --conversations 30000``);
3. 800 steps at half the learning rate (5e-5), resumed from stage 2, on the
   mix + 12000 conversations + 4000 conversations that end in a times-table
   question (``build_data.py --seed 2 --focus "Show the" "Write the"
   --focus-conversations 4000``): stage 2 had cost the times tables
   (92% -> 52% asked alone); stage 3 brings them back to 67%.

Then the trained weights are fused into a standalone bfloat16 folder (the
demo's storage dtype) and, with ``--install``, its ``model.safetensors``
replaces the bundled one. The golden tests keep the old weights as their
fixture (``tests/fixtures/tiny-refusion``).

    python examples/demo_model/retrain.py --tasks ../shared/fixtures/tiny-refusion-tasks --work /tmp/demo-retrain --install

About an hour on a 2-core CPU (OpenBLAS, float32 training).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import refusion_mlx  # noqa: E402  (before mlx.core: optimized BLAS on Linux)
from build_data import build  # noqa: E402
from refusion_mlx.fuse import fuse  # noqa: E402
from refusion_mlx.models.loading import DEMO_MODEL  # noqa: E402
from refusion_mlx.train.run import fine_tune  # noqa: E402

RECIPE = HERE / "retrain.yaml"
# The weights the demo shipped with before it was retrained (the golden tests'
# fixture). Training starts from them, not from the installed demo, so that a
# second run reproduces the first instead of fine-tuning its result again.
ORIGINAL = HERE.parent.parent / "tests" / "fixtures" / "tiny-refusion"
TIMES_TABLES = ("Show the", "Write the")  # the times tables' family keys in build_data
STAGES = [  # (build_data seed, conversations, focused conversations, steps, learning rate)
    (0, 12000, 0, 500, 1e-4),
    (1, 30000, 0, 1400, 1e-4),
    (2, 12000, 4000, 800, 5e-5),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", required=True, help="the shared task mix (train.jsonl, valid.jsonl)")
    ap.add_argument("--work", default="demo-retrain", help="folder for data, checkpoints and the fused model")
    ap.add_argument("--install", action="store_true", help="replace the bundled demo's model.safetensors")
    args = ap.parse_args()
    work = Path(args.work)
    resume = None
    for i, (seed, conversations, focused, steps, lr) in enumerate(STAGES, 1):
        data = work / f"data{i}"
        print(build(Path(args.tasks), data, seed=seed, n_conversations=conversations,
                    focus=TIMES_TABLES, n_focus=focused))
        adapters = work / f"stage{i}"
        fine_tune(config=str(RECIPE), model=str(ORIGINAL), data=str(data), adapter_path=str(adapters),
                  iters=steps, seed=seed, learning_rate=lr, resume_adapter_file=resume)
        resume = str(adapters / "adapters.safetensors")
    fused = fuse(ORIGINAL, work / f"stage{len(STAGES)}", work / "fused", dtype="bfloat16", force=True)
    print(f"fused model: {fused}")
    if args.install:  # one bfloat16 file, as the demo has always been stored
        import mlx.core as mx

        weights = mx.load(str(fused / "model.safetensors"))
        mx.save_safetensors(str(DEMO_MODEL / "model.safetensors"),
                            {k: v.astype(mx.bfloat16) for k, v in weights.items()}, metadata={"format": "pt"})
        print(f"installed into {DEMO_MODEL}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
