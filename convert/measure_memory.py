"""Peak resident memory of ``python -m refusion_mlx.convert`` against checkpoint size.

    python -m convert.measure_memory --layout 1.7b --format sharded-safetensors
    python -m convert.measure_memory --hf-path SRC --run "-q --q-bits 4"

Generates a random checkpoint (or takes ``--hf-path``), converts it once per
``--run`` in a fresh process, and reads that process's peak RSS from the
kernel (``wait4``'s ``ru_maxrss``). The ratio peak / checkpoint size is the
figure the converter is designed to keep low (target at most 0.6).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

DEFAULT_RUNS = ["--dtype bfloat16", "-q --q-bits 8", "-q --q-bits 4", "-q --quant-predicate embed_8"]


def weights_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".safetensors", ".bin"))


def peak_rss(cmd: List[str]) -> tuple:
    """(exit status, peak RSS in bytes, seconds) of one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode(errors="replace").strip().splitlines()
    if proc.returncode != 0:
        raise SystemExit(f"conversion failed ({proc.returncode}): {err[-1] if err else ''}")
    return proc.returncode, usage.ru_maxrss * 1024, time.perf_counter() - start


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m convert.measure_memory",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-path", type=Path, help="an existing checkpoint (default: generate one)")
    parser.add_argument("--layout", default="1.7b", help="layout of the generated checkpoint")
    parser.add_argument("--format", dest="fmt", default="sharded-safetensors")
    parser.add_argument("--layers", type=int, help="override the layer count")
    parser.add_argument("--workdir", type=Path, help="where to write (default: a temporary folder, removed)")
    parser.add_argument("--run", action="append", help=f"converter flags, repeatable (default: {DEFAULT_RUNS})")
    args = parser.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="refusion-mem-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        src = args.hf_path
        if src is None:
            from .make_checkpoint import make_checkpoint

            overrides = {"num_hidden_layers": args.layers} if args.layers else {}
            t = time.perf_counter()
            src = make_checkpoint(work / f"{args.layout}-{args.fmt}", args.layout, args.fmt, **overrides)
            print(f"generated {src} in {time.perf_counter() - t:.0f}s")
        size = weights_size(src)
        _, base, _ = peak_rss([sys.executable, "-c", "import refusion_mlx.convert, refusion_mlx.utils as u; "
                               "u.load_tokenizer(u.DEMO_MODEL)"])
        print(f"checkpoint: {size / 1e9:.3f} GB of weights; interpreter + imports alone: {base / 1e9:.3f} GB")
        print("| flags | peak RSS (GB) | peak / checkpoint | output (GB) | time (s) |")
        print("|---|---|---|---|---|")
        for run in args.run or DEFAULT_RUNS:
            dst = work / "out"
            cmd = [sys.executable, "-m", "refusion_mlx.convert", "--hf-path", str(src),
                   "--mlx-path", str(dst), "--force", *shlex.split(run)]
            _, peak, seconds = peak_rss(cmd)
            print(f"| `{run}` | {peak / 1e9:.3f} | {peak / size:.3f} | {weights_size(dst) / 1e9:.3f} "
                  f"| {seconds:.0f} |", flush=True)
            shutil.rmtree(dst)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
