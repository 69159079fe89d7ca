"""What the speed scripts share: decoding modes, random prompts, timed
decoder runs, host-sync counting, the model header and JSON output.

The scripts: ``python -m benchmarks.overhead``, ``.scaling`` and
``.profile_decoder`` (docs/benchmarks.md), on the bundled demo model or any
converted folder (``--model``).
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from refusion_mlx.bench.report import environment, header_lines
from refusion_mlx.cli import OneLineParser, add_kv_args, check_writable
from refusion_mlx.decode.cache import CommittedCache
from refusion_mlx.decode.decoder import RefusionDecoder
from refusion_mlx.decode.params import RefusionParams, seed_bits
from refusion_mlx.errors import DecodeError, RefusionError

# Threshold settings that fix the decoder's path whatever the weights say
# (a random model is never confident, so the reference thresholds always take
# the one-slot infill path on it).
MODES: Dict[str, dict] = {
    "reference": dict(slot_threshold=0.6, token_threshold=0.3),  # as the paper; on random weights: 1 slot, infill
    "parallel": dict(slot_threshold=0.0, token_threshold=0.0),  # every slot drafted and accepted: plan + verify per block
    "infill": dict(slot_threshold=0.0, token_threshold=1.0),  # every slot infilled in parallel, S-1 rounds
}


def seed(text: str) -> int:
    """argparse type: a seed as the runtime takes it, as the unsigned 64-bit number its random keys are made
    of (``seed_bits``: -1 is 2**64 - 1), which numpy's generators take too (a negative one they refuse)."""
    try:
        return seed_bits(int(text))
    except (ValueError, DecodeError):
        raise argparse.ArgumentTypeError(f"expected an integer in [-2**63, 2**64), got {text!r}") from None


def base_parser(prog: str, description: str, decodes: bool = True, random_prompts: bool = True) -> OneLineParser:
    """The flags the speed scripts share. ``decodes``: the script runs the
    decoder (--slot-size, --ignore-eos); ``random_prompts``: it makes random
    prompts (--seed). A script leaves out what it does not honour, so such a
    flag is refused in one line rather than silently ignored."""
    parser = OneLineParser(prog=prog, description=description)
    parser.add_argument("--model", help="model folder (default: the bundled demo model); "
                        "make a real-shape one with python -m convert.make_checkpoint")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    if decodes:
        parser.add_argument("--slot-size", type=int, default=4)
    if random_prompts:
        parser.add_argument("--seed", type=seed, default=0, help="seed of the random prompts (an integer in "
                            "[-2**63, 2**64), as the runtime takes it)")
    parser.add_argument("--json", metavar="OUT", help="write the results to this JSON file")
    if decodes:
        parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=False,
                            help="decode the whole budget: the model's end-of-text does not stop a run (a random "
                                 "prompt often ends the answer at once); --no-ignore-eos: it does")
    add_kv_args(parser)
    return parser


def load_model(path: Optional[str], dtype: str):
    """Load a model and print the environment header."""
    from refusion_mlx.models.loading import load

    model, tokenizer = load(path, dtype=dtype)
    env = environment(model, path or "bundled demo model")
    for line in header_lines(env):
        print(line)
    return model, tokenizer, env


def random_prompt(tokenizer, model, n: int, seed: int = 0) -> List[int]:
    """n ordinary token ids (no special tokens), reproducible."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    limit = min(len(tokenizer), model.args.vocab_size)
    rng = np.random.default_rng(seed)
    ids: List[int] = []
    while len(ids) < n:
        ids += [int(t) for t in rng.integers(0, limit, n) if int(t) not in special]
    return ids[:n]


def make_params(gen_length: int, slot_size: int, block_length: int, mode: str) -> RefusionParams:
    return RefusionParams(gen_length=gen_length, slot_size=slot_size, block_length=block_length,
                          **MODES[mode])


def decode(model, tokenizer, prompt: Sequence[int], params: RefusionParams,
           cache: Optional[CommittedCache] = None, storage=None, ignore_eos: bool = False) -> tuple:
    """One full decoder run; (wall seconds, decoder) with its stats.
    ``storage``: how a new cache keeps keys and values (--kv-bits);
    ``ignore_eos``: the whole budget is decoded."""
    mx.synchronize()
    t0 = time.perf_counter()
    if cache is None:
        cache = CommittedCache.for_model(model, storage=storage)
    decoder = RefusionDecoder(model, prompt, params, mask_id=model.args.mask_token_id,
                              eos_id=None if ignore_eos else tokenizer.eos_token_id, cache=cache)
    for _ in decoder.steps():
        pass
    wall = time.perf_counter() - t0
    return wall, decoder


@contextmanager
def counting_evals():
    """Count every mx.eval call made inside (the decoder's host stalls,
    counted or not by its stats)."""
    real = mx.eval
    counter = {"evals": 0}

    def counted(*args, **kwargs):
        counter["evals"] += 1
        return real(*args, **kwargs)

    mx.eval = counted
    try:
        yield counter
    finally:
        mx.eval = real


def gather_bytes(write, kv_heads: int, head_dim: int, itemsize: int, layers: int) -> int:
    """Bytes of keys and values a batched forward's attention copies (a
    ``decode.packed.PackedWrite`` the batched way: every request's view
    padded to the widest, per layer; docs/benchmarks.md, attention for a batch)."""
    rows = len(write.segments) * max(w.visible for w, _, _ in write.segments)
    return 2 * rows * kv_heads * head_dim * itemsize * layers


def median(values: Sequence[float]) -> float:
    return float(np.median(np.asarray(values, dtype=np.float64)))


def shape_arg(text: str) -> str:
    """argparse type of ``--shape``: a shape ``bench.shapes`` builds (the tests' hidden one too); the error
    names the listed ones only, as ``bench --shape`` does."""
    from refusion_mlx.bench.shapes import check_shape, shape_names

    try:
        check_shape(text)
    except RefusionError:
        raise argparse.ArgumentTypeError(f"unknown shape {text!r}; known: {', '.join(shape_names())}") from None
    return text


def shape_flags(parser: argparse.ArgumentParser, dtype: str, shape: str = "qwen3-0.6b") -> None:
    """``--shape`` (a listed shape, random weights) and ``--dtype``, with these defaults."""
    from refusion_mlx.bench.shapes import SHAPES

    parser.add_argument("--shape", type=shape_arg, metavar="NAME", default=shape,
                        help=f"model shape, random weights: {', '.join(SHAPES)} (default {shape})")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=dtype,
                        help=f"the weights' dtype (default {dtype})")


def write_json(path: Optional[str], payload: dict) -> None:
    """``payload`` to ``path`` (``-``: standard output), as ``bench --json`` writes it."""
    from refusion_mlx.bench.compare import write_json as write

    write(path, payload)


def check_json_path(path: Optional[str], stdout: bool = False) -> None:
    """One line unless ``--json path`` can be written, before any work: a
    folder, a missing folder, a place no file can be made (``/proc``). ``-``
    (standard output) only where the script then prints its report on
    standard error (``stdout``)."""
    if not path:
        return
    if path == "-":
        if not stdout:
            raise RefusionError("--json -: this script prints its report on standard output; give the JSON a file")
        return
    try:
        check_writable(path)
    except OSError as e:
        raise RefusionError(f"cannot write {path}: {e.strerror or e}") from None
