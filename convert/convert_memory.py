"""Peak resident memory of ``python -m refusion_mlx.convert`` against checkpoint size.

    python -m convert.convert_memory --shape 1.7b --format sharded-safetensors
    python -m convert.convert_memory --hf-path SRC --run "-q --q-bits 4"

Generates a random checkpoint (or takes ``--hf-path``), converts it once per
``--run`` in a fresh process, which reports its own peak RSS as it exits
(Linux: ``VmHWM`` of ``/proc/self/status``; ``ru_maxrss`` is no good here, as
it keeps the high-water mark of the parent it was forked from). The ratio peak / checkpoint size is the
figure the converter is designed to keep low (target at most 0.6).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

from refusion_mlx.cli import OneLineParser, positive_int

DEFAULT_RUNS = ["--dtype bfloat16", "-q --q-bits 8", "-q --q-bits 4", "-q --quant-predicate embed_8"]


def weights_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".safetensors", ".bin"))


# Runs a module's main() in this fresh process, then prints the process's own peak RSS.
WRAPPER = """
import sys, runpy
code, module = 0, sys.argv[1]
sys.argv = [module] + sys.argv[2:]
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code or 0
try:
    with open("/proc/self/status") as f:
        peak = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
except OSError:  # not Linux: ru_maxrss (bytes on macOS) is this process's own here
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(f"PEAK_RSS {peak}", file=sys.stderr)
sys.exit(code)
"""


def peak_rss(module: str, args: List[str]) -> tuple:
    """(peak RSS in bytes, seconds) of ``python -m module args`` in a fresh process."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", WRAPPER, module, *args],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    lines = proc.stderr.strip().splitlines()
    peaks = [int(l.split()[1]) for l in lines if l.startswith("PEAK_RSS ")]
    if proc.returncode != 0 or not peaks:
        errors = [l for l in lines if not l.startswith("PEAK_RSS ")]
        raise SystemExit(f"{module} failed ({proc.returncode}): {errors[-1] if errors else ''}")
    return peaks[0], seconds


def main(argv: Optional[List[str]] = None) -> int:
    parser = OneLineParser(prog="python -m convert.convert_memory",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-path", type=Path, help="an existing checkpoint (default: generate one)")
    parser.add_argument("--shape", "--layout", dest="shape", default="1.7b",
                        help="shape of the generated checkpoint (--layout: its old name)")
    parser.add_argument("--format", dest="fmt", default="sharded-safetensors")
    parser.add_argument("--layers", type=positive_int, help="override the layer count")
    parser.add_argument("--untied", action="store_true", help="an lm_head of its own (0.6B: 1.5 GB instead of 1.2)")
    parser.add_argument("--workdir", type=Path, help="where to write (default: a temporary folder, removed)")
    parser.add_argument("--run", action="append", help=f"converter flags, repeatable (default: {DEFAULT_RUNS})")
    args = parser.parse_args(argv)
    if args.hf_path is None:  # generated: needs torch, as make_checkpoint does
        from .make_checkpoint import FORMATS, SHAPES

        for flag, value, known in (("--shape", args.shape, SHAPES), ("--format", args.fmt, FORMATS)):
            if value not in known:
                parser.error(f"{flag} must be one of {', '.join(known)}, got {value!r}")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="refusion-mem-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        src = args.hf_path
        if src is None:
            from .make_checkpoint import make_checkpoint

            overrides = {"num_hidden_layers": args.layers} if args.layers is not None else {}
            if args.untied:
                overrides["tie_word_embeddings"] = False
            t = time.perf_counter()
            src = make_checkpoint(work / f"{args.shape}-{args.fmt}", args.shape, args.fmt, **overrides)
            print(f"generated {src} in {time.perf_counter() - t:.0f}s")
        size = weights_size(src)
        from refusion_mlx.models.loading import DEMO_MODEL

        base, _ = peak_rss("refusion_mlx.convert", ["--hf-path", str(DEMO_MODEL), "--mlx-path",
                                                    str(work / "demo-out"), "--force"])
        shutil.rmtree(work / "demo-out")
        print(f"checkpoint: {size / 1e9:.3f} GB of weights; fixed cost (converting the 7 MB demo model): {base / 1e9:.3f} GB")
        print("| flags | peak RSS (GB) | peak / checkpoint | output (GB) | time (s) |")
        print("|---|---|---|---|---|")
        for run in args.run or DEFAULT_RUNS:
            dst = work / "out"
            peak, seconds = peak_rss("refusion_mlx.convert", ["--hf-path", str(src), "--mlx-path", str(dst),
                                                             "--force", *shlex.split(run)])
            print(f"| `{run}` | {peak / 1e9:.3f} | {peak / size:.3f} | {weights_size(dst) / 1e9:.3f} "
                  f"| {seconds:.0f} |", flush=True)
            shutil.rmtree(dst)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
