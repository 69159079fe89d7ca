"""A quantized KV cache (``--kv-bits``) against the float one: quality,
bytes, and what memory admission makes of them.

    python -m benchmarks.kv_cache                          # every section, the bundled demo model
    python -m benchmarks.kv_cache --sections golden --paths cpu,gpu --json kv.json
    python -m benchmarks.kv_cache --sections admission --max-kv-bytes 8M --requests 40

Sections, each a table (and the whole in ``--json``):

* ``golden``: the 32 golden prompts (tests/fixtures, decoded by the
  authors' reference at float32) decoded with the cache kept in the model's
  dtype and at 8 and 4 bits, on each device path (``--paths``;
  ``gpu`` runs the GPU paths on the CPU here): how many answers agree token
  for token with the reference, and how many a batch of 8 decodes exactly as
  alone.
* ``bytes``: KV bytes per token of the model (every layer), as each form
  keeps it, and of ReFusion-8B's shape in bfloat16 (``bench/kv_memory.py``).
* ``admission``: an in-process server per form under the same
  ``--max-kv-bytes``; ``--requests`` identical slow requests of about
  ``--prompt-tokens`` + ``--max-tokens`` sent at once. Reported: the most
  that ran at once (``/health``'s ``active``), what admission's arithmetic
  says should fit, requests that waited, and that every one answered (200,
  the same text as the others: nothing lost).

Task-suite accuracy is ``python -m refusion_mlx.train.accuracy --kv-bits N``
and speed at long contexts ``python -m benchmarks.scaling --kv-bits N``
(docs/benchmarks.md).
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List, Optional

from refusion_mlx.bench.report import format_table
from refusion_mlx.cli import OneLineParser, byte_size, interrupt_once, run

from .speed_common import check_json_path, write_json

FORMS = (None, 8, 4)
SECTIONS = ("golden", "bytes", "admission")
FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
SLOW = {"slot_threshold": 1.0, "token_threshold": 1.0}  # one token a step: requests stay in the batch


def label(bits: Optional[int]) -> str:
    return "float" if bits is None else f"{bits}-bit"


def golden_section(paths: List[str]) -> List[dict]:
    from refusion_mlx.models import backend

    cases = json.loads((FIXTURES / "golden_outputs.json").read_text())
    rows: List[dict] = []
    for path in paths:  # restored after each: the other sections run on the paths the environment says
        with backend.setting(backend.ENV, path):  # read by the model's load
            rows += golden_on_paths(path, cases)
    return rows


def golden_on_paths(path: str, cases: List[dict]) -> List[dict]:
    """Every form on the device paths in force."""
    from refusion_mlx.decode.batch import BatchGenerator
    from refusion_mlx.decode.cache import CommittedCache
    from refusion_mlx.decode.decoder import RefusionDecoder
    from refusion_mlx.decode.kv_store import KVStorage
    from refusion_mlx.decode.params import RefusionParams
    from refusion_mlx.models.loading import load

    model, tokenizer = load(FIXTURES / "tiny-refusion", dtype="float32")
    params = [RefusionParams(gen_length=c["gen_length"], slot_size=c["slot_size"],
                             serial_num_blocks=c["serial_num_blocks"], slot_threshold=c["slot_threshold"],
                             token_threshold=c["token_threshold"]) for c in cases]
    rows = []
    for bits in FORMS:
        storage = KVStorage.of(bits, model=model)
        t0 = time.perf_counter()
        alone = []
        for c, p in zip(cases, params):
            cache = CommittedCache.for_model(model, storage=storage)
            d = RefusionDecoder(model, c["prompt_ids"], p, mask_id=model.args.mask_token_id,
                                eos_id=tokenizer.eos_token_id, cache=cache)
            for _ in d.steps():
                pass
            alone.append(d.response())
        seconds = time.perf_counter() - t0
        gen = BatchGenerator(model, tokenizer, max_batch=8, storage=KVStorage.of(bits))
        uids = [gen.insert(c["prompt_ids"], p) for c, p in zip(cases, params)]
        batched = {u: [] for u in uids}
        while gen.has_work:
            for r in gen.step():
                batched[r.uid] += r.tokens
        rows.append({"paths": path, "kv_bits": bits, "cases": len(cases),
                     "agree_with_reference": sum(a == c["output_ids"] for a, c in zip(alone, cases)),
                     "batched_equals_alone": sum(batched[u] == a for u, a in zip(uids, alone)),
                     "alone_seconds": round(seconds, 3)})
        print(f"  {path} paths, {label(bits)}: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def bytes_section() -> dict:
    from refusion_mlx.bench.kv_memory import kv_memory
    from refusion_mlx.bench.shapes import shape_config
    from refusion_mlx.models.loading import read_config

    demo = read_config(FIXTURES / "tiny-refusion")
    demo.setdefault("head_dim", demo["hidden_size"] // demo["num_attention_heads"])
    return {"demo float32": kv_memory(demo, "float32"), "demo bfloat16": kv_memory(demo, "bfloat16"),
            "refusion-8b bfloat16": kv_memory(shape_config("refusion-8b"), "bfloat16")}


def _call(port: int, method: str, path: str, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request(method, path, body=None if body is None else json.dumps(body),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def admission_section(args) -> List[dict]:
    from types import SimpleNamespace

    from refusion_mlx.decode.params import make_params
    from refusion_mlx.serve.http_server import RefusionServer
    from refusion_mlx.serve.core.memory import KVCost

    prompt = " ".join(str(i % 10) for i in range(args.prompt_tokens // 2))  # a digit and a space: 2 tokens
    dtype = {"dtype": args.dtype} if args.dtype else {}
    body = {"prompt": prompt, "max_tokens": args.max_tokens, **SLOW}
    rows = []
    for bits in FORMS:
        server = RefusionServer(args.model, port=0, max_batch=args.requests, max_kv_bytes=args.max_kv_bytes,
                                prompt_cache_bytes=0, kv_bits=bits, **dtype)
        with server:
            port = server.port
            seen, stop = [], threading.Event()

            def watch():
                while not stop.is_set():
                    try:
                        seen.append(_call(port, "GET", "/health")[1]["active"])
                    except OSError:  # the server is closing (Ctrl-C): the run is over
                        return
                    time.sleep(0.02)

            watcher = threading.Thread(target=watch)
            watcher.start()
            t0 = time.perf_counter()
            try:
                with ThreadPoolExecutor(args.requests) as pool:
                    out = list(pool.map(lambda _: _call(port, "POST", "/v1/completions", body),
                                        range(args.requests)))
            finally:  # before the server closes, whatever ended the requests
                stop.set()
                watcher.join()
            wall = time.perf_counter() - t0
            health = _call(port, "GET", "/health")[1]
            dtype_used = str(server.engine.model.cache_spec().dtype).replace("mlx.core.", "")
        kv = health["kv"]
        answered = [o for s, o in out if s == 200]
        prompt_tokens = answered[0]["usage"]["prompt_tokens"] if answered else 0
        request = SimpleNamespace(prompt_ids=[0] * prompt_tokens, params=make_params(max_tokens=args.max_tokens))
        need = KVCost(kv["bytes_per_token"], kv["scratch_bytes_per_token"]).need(request)  # as admission counts
        rows.append({"kv_bits": bits, "dtype": dtype_used, "bytes_per_token": kv["bytes_per_token"],
                     "prompt_tokens": prompt_tokens,
                     "max_tokens": args.max_tokens, "need_bytes": need, "max_kv_bytes": args.max_kv_bytes,
                     "fit": args.max_kv_bytes // need, "most_at_once": max(seen, default=0),
                     "requests": args.requests, "answered": len(answered), "waited": health["kv_waits"],
                     "same_text": len({a["choices"][0]["text"] for a in answered}) == 1,
                     "wall_seconds": round(wall, 3)})
        print(f"  {label(bits)}: {rows[-1]}", file=sys.stderr, flush=True)
    for r in rows:
        r["vs_float"] = round(r["most_at_once"] / max(rows[0]["most_at_once"], 1), 3)
    return rows


def print_tables(results: dict) -> None:
    if "golden" in results:
        print("\ngolden prompts: answers agreeing with the reference decoder, and batched == alone")
        print(format_table(["paths", "KV cache", "agree (of 32)", "batched == alone", "alone s"],
                           [[r["paths"], label(r["kv_bits"]), r["agree_with_reference"], r["batched_equals_alone"],
                             r["alone_seconds"]] for r in results["golden"]]))
    if "bytes" in results:
        for name, kv in results["bytes"].items():
            print(f"\nKV bytes per token: {name} ({kv['layers']} layers)")
            print(format_table(["form", "bytes/token", "float / this"],
                               [[f["form"].replace("mlx.core.", ""), f["bytes_per_token"],
                                 f"{kv['forms'][0]['bytes_per_token'] / f['bytes_per_token']:.2f}x"]
                                for f in kv["forms"]]))
    if "admission" in results:
        r0 = results["admission"][0]
        print(f"\nadmission under --max-kv-bytes {r0['max_kv_bytes']}: {r0['requests']} requests of "
              f"{r0['prompt_tokens']} + {r0['max_tokens']} tokens sent at once ({r0['dtype']})")
        print(format_table(["KV cache", "bytes/token", "bytes/request", "fit", "most at once", "vs float",
                            "waited", "answered", "same text"],
                           [[label(r["kv_bits"]), r["bytes_per_token"], r["need_bytes"], r["fit"],
                             r["most_at_once"], f"{r['vs_float']:.2f}x", r["waited"], r["answered"],
                             r["same_text"]] for r in results["admission"]]))


def main(argv: Optional[List[str]] = None) -> int:
    parser = OneLineParser(prog="python -m benchmarks.kv_cache", description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--paths", default="cpu,gpu", help="device paths of the golden section (cpu, gpu)")
    parser.add_argument("--model", default=str(FIXTURES / "tiny-refusion"), help="the admission section's model")
    parser.add_argument("--max-kv-bytes", type=byte_size, default=8 << 20, help="admission's budget (default 8M)")
    parser.add_argument("--requests", type=int, default=40, help="admission's requests sent at once (default 40)")
    parser.add_argument("--prompt-tokens", type=int, default=200, help="admission's prompt length (default 200)")
    parser.add_argument("--max-tokens", type=int, default=24, help="admission's max_tokens (default 24)")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                        help="admission's compute dtype (default: float32 on the CPU, the model's on a GPU)")
    parser.add_argument("--json", metavar="OUT", help="write the results to this JSON file")
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not sections or any(s not in SECTIONS for s in sections):
        parser.error(f"--sections takes {', '.join(SECTIONS)}")
    if not paths or any(p not in ("cpu", "gpu") for p in paths):
        parser.error("--paths takes cpu, gpu")
    if min(args.requests, args.prompt_tokens, args.max_tokens, args.max_kv_bytes) < 1:
        parser.error("--requests, --prompt-tokens, --max-tokens and --max-kv-bytes must be positive")

    def body() -> int:
        check_json_path(args.json)
        results = {}
        if "golden" in sections:
            results["golden"] = golden_section(paths)
        if "bytes" in sections:
            results["bytes"] = bytes_section()
        if "admission" in sections:
            results["admission"] = admission_section(args)
        print_tables(results)
        write_json(args.json, {"settings": {k: v for k, v in vars(args).items() if k != "json"}, **results})
        return 0

    with interrupt_once():  # a second Ctrl-C while the server shuts down ends at once
        return run(body)


if __name__ == "__main__":
    sys.exit(main())
