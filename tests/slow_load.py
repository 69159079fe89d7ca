"""``python -m tests.slow_load SECONDS MODULE ARGS...``: ``python -m MODULE ARGS`` with rank 0's loading
SECONDS slower twice over -- before its model folder is found (a download) and before its weights are read
(a slow disk) -- while the other ranks wait for it (``tests/test_distributed_start.py``)."""

import os
import runpy
import sys
import time

sys.modules.setdefault("torch", None)  # kept out, as the command it stands in for does (refusion_mlx._startup)

from refusion_mlx.models import loading  # noqa: E402


def _slowed(f, seconds: float):
    def slow(*args, **kwargs):
        print("slow_load: rank 0 loads slowly", file=sys.stderr, flush=True)
        time.sleep(seconds)
        return f(*args, **kwargs)
    return slow


if __name__ == "__main__":
    seconds, module = float(sys.argv[1]), sys.argv[2]
    if os.environ.get("MLX_RANK") == "0":
        loading.resolve_model_path = _slowed(loading.resolve_model_path, seconds)
        loading._load_split = _slowed(loading._load_split, seconds)
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
