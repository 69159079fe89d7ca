"""A linear layer's matmul by rows, in each product a layer can ask the device for.

    python -m benchmarks.matmul_rows                      # qwen3-0.6b's layers, float32, rows 1 to 32
    python -m benchmarks.matmul_rows --shape refusion-8b --dtype bfloat16 --rows 1,2,4,8,16 --json rows.json

The plain linear layers of every layer of the shape (q/k/v joined, o, gate/up
joined, down, as the runtime joins them), random weights, each product
evaluated over all the layers at once, so the weights stream from memory as
in a forward; the median of ``--repeat`` rounds, the products taking turns
within a round. The products (``cpu_paths.lay_out_linears`` picks one on the
CPU paths):

* ``x @ w.T``: the weight (out, in) row-major, as loaded; what ``nn.Linear``,
  mlx-lm and the GPU paths compute;
* ``x @ w``: the weight stored (in, out), the CPU paths' transposed layout
  (``cpu_paths.store_weights_transposed``);
* ``(w @ x.T).T``: weight-major, the (out, in) weight as the outer dimension
  (the CPU paths' layout under MKL with several threads).

Each cell is the milliseconds of one pass's matmuls over every layer, with
its cost over one row's in the same product. The products are checked to
agree first. On a CPU the BLAS and its threads are printed: they decide it.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Dict, List, Optional

import mlx.core as mx
import numpy as np

from refusion_mlx._blas import blas_in_use
from refusion_mlx.bench.report import device_description, format_table, package_version
from refusion_mlx.cli import OneLineParser, positive_ints, run
from refusion_mlx.errors import RefusionError

from .speed_common import check_json_path, median, shape_flags, write_json

PRODUCTS: Dict[str, Callable[[mx.array, mx.array, mx.array], mx.array]] = {
    "x @ w.T": lambda x, w, w_in_out: x @ w.T,
    "x @ w (in, out)": lambda x, w, w_in_out: x @ w_in_out,
    "(w @ x.T).T": lambda x, w, w_in_out: (w @ x.T).T,
}


def layer_weights(config: dict, dtype: mx.Dtype) -> List[mx.array]:
    """(out, in) weights of one layer's joined linears."""
    hidden, heads, kv, hd = (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
                             config["head_dim"])
    inner = config["intermediate_size"]
    shapes = [((heads + 2 * kv) * hd, hidden), (hidden, heads * hd), (2 * inner, hidden), (hidden, inner)]
    return [(mx.random.normal(s) * 0.02).astype(dtype) for s in shapes]


def build(config: dict, dtype: mx.Dtype):
    """Every layer's weights, (out, in) and (in, out), computed a layer at a time."""
    weights, in_out = [], []
    for _ in range(config["num_hidden_layers"]):
        w = layer_weights(config, dtype)
        t = [mx.contiguous(a.T) for a in w]
        mx.eval(w, t)
        weights += w
        in_out += t
    return weights, in_out


def check_products(weights, in_out, dtype: mx.Dtype) -> None:
    """The three products of the first weight agree (a wrong product is not worth timing)."""
    x = mx.random.normal((3, weights[0].shape[1])).astype(dtype)
    results = [np.array(f(x, weights[0], in_out[0]).astype(mx.float32)) for f in PRODUCTS.values()]
    tol = 1e-3 if dtype == mx.float32 else 5e-2
    for name, r in zip(list(PRODUCTS)[1:], results[1:]):
        if not np.allclose(r, results[0], rtol=tol, atol=tol):
            raise RefusionError(f"{name} differs from x @ w.T on this device")


def measure(weights, in_out, rows: List[int], repeat: int, dtype: mx.Dtype) -> List[dict]:
    timings: Dict[tuple, List[float]] = {}
    for _ in range(repeat + 1):  # the first round warms up
        for m in rows:
            xs = {k: mx.random.normal((m, k)).astype(dtype) for k in {w.shape[1] for w in weights}}
            mx.eval(list(xs.values()))
            for name, product in PRODUCTS.items():
                start = time.perf_counter()
                mx.eval([product(xs[w.shape[1]], w, t) for w, t in zip(weights, in_out)])
                timings.setdefault((m, name), []).append((time.perf_counter() - start) * 1e3)
    out = []
    for (m, name), ms in timings.items():
        ms = ms[1:]
        out.append({"rows": m, "product": name, "ms": round(median(ms), 3), "ms_min": round(min(ms), 3)})
    return out


def table(results: List[dict], rows: List[int]) -> str:
    by = {(r["rows"], r["product"]): r["ms"] for r in results}
    one = {p: by.get((rows[0], p)) for p in PRODUCTS}
    body = [[m] + [f"{by[m, p]:.1f} ({by[m, p] / one[p]:.2f}x)" for p in PRODUCTS] for m in rows]
    return format_table(["rows"] + [f"{p} ms (x {rows[0]} row{'s' * (rows[0] > 1)})" for p in PRODUCTS], body)


def main(argv: Optional[List[str]] = None) -> int:
    from refusion_mlx.bench.shapes import shape_config

    parser = OneLineParser(prog="python -m benchmarks.matmul_rows",
                           description="A pass's linear matmuls by rows, in each product a layer can ask for.")
    shape_flags(parser, dtype="float32")
    parser.add_argument("--rows", type=positive_ints, default=[1, 2, 4, 8, 16, 32],
                        help="rows per pass (default 1,2,4,8,16,32; the first is the reference)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds timed (default 5)")
    parser.add_argument("--json", metavar="OUT", help="write the rows to this JSON file")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be positive")

    def body() -> int:
        check_json_path(args.json)
        config, dtype = shape_config(args.shape), getattr(mx, args.dtype)
        mx.random.seed(0)
        weights, in_out = build(config, dtype)
        check_products(weights, in_out, dtype)
        on_cpu = mx.default_device() == mx.cpu
        blas = blas_in_use() if on_cpu else None
        print(f"{args.shape}: {len(weights)} linears of {config['num_hidden_layers']} layers ({args.dtype}, "
              f"{sum(w.nbytes for w in weights) / 2**20:.0f} MiB) on {device_description()}"
              + (f"; BLAS: {blas}" if blas else ""))
        results = measure(weights, in_out, args.rows, args.repeat, dtype)
        print(table(results, args.rows))
        write_json(args.json, {"shape": args.shape, "dtype": args.dtype, "device": device_description(),
                               "mlx_version": package_version("mlx"), "blas": blas, "repeat": args.repeat,
                               "rows": results})
        return 0

    return run(body)


if __name__ == "__main__":
    sys.exit(main())
