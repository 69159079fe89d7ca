"""Decoder overhead: wall time of a ReFusion run / time of the same forwards run bare.

A recording run notes the shape of every forward the decoder makes; timed
decoder runs and bare replays of those forwards (same shapes, same count, a
plain KV buffer, one evaluation per forward) then alternate, and the medians
are compared. Also reported: host synchronisations per decoding step (the
decoder's own count, and every ``mx.eval`` it makes), and the split per phase.

    python -m benchmarks.overhead --model models/qwen3-0.6b-random
    python -m benchmarks.overhead                     # the bundled demo model
    python -m benchmarks.overhead --suite default --serial-num-blocks 4   # the bench suite's prompts

Each step is also split by CPU time: compute (off the main thread, where
MLX's CPU backend runs the ops) and host (the main thread), for the decoder
and the bare forwards; their host difference is the decoder's own work.

Modes fix the decoding path whatever the weights (see speed_common.MODES);
``--suite`` takes the suite's settings instead. On the random prompt every
run decodes its whole budget (EOS ignored: a random prompt's answer often
ends at once, which leaves nothing to measure; ``--no-ignore-eos`` stops at
it); the suite's prompts stop at their EOS unless ``--ignore-eos``.
``--kv-bits`` keeps the decoder's caches and the bare replays' quantized.
Target (issue): overhead <= 1.10x on the Qwen3-0.6B shape.
"""

from __future__ import annotations

import sys
import time
from typing import List, Optional, Sequence, Tuple

from refusion_mlx.bench.forward_replay import PHASE_ORDER, RecordingModel, by_phase, count_by_phase, prepare, replay
from refusion_mlx.bench.report import format_table
from refusion_mlx.bench.suite import load_suite, resolve_params
from refusion_mlx.cli import run, storage_from_args
from refusion_mlx.decode.kv_store import KVStorage
from refusion_mlx.decode.params import RefusionParams
from refusion_mlx.decode.stream import chat_prompt
from refusion_mlx.errors import RefusionError

from .speed_common import (MODES, base_parser, check_json_path, counting_evals, decode, load_model,
                           make_params, median, random_prompt, write_json)

TARGET = 1.10


def _thread_seconds() -> float:
    """CPU seconds of the calling (main) thread: the host's own work --
    Python, graph building, MLX dispatching ops -- without the compute, which
    MLX's CPU backend runs on its stream's worker thread, and without time
    spent waiting (for the device or for a core on a busy machine)."""
    return time.thread_time()


def measure_mode(model, tokenizer, prompt, params, repeat: int, storage: Optional[KVStorage] = None,
                 ignore_eos: bool = False) -> dict:
    """Record, then alternate timed decoder runs with bare replays (one prompt)."""
    return measure_jobs(model, tokenizer, [(prompt, params)], repeat, storage, ignore_eos)


def measure_jobs(model, tokenizer, jobs: Sequence[Tuple[List[int], RefusionParams]], repeat: int,
                 storage: Optional[KVStorage] = None, ignore_eos: bool = False) -> dict:
    """Record every job's forwards, then alternate timed decoder runs of all
    jobs with bare replays of all their forwards; medians of the totals.
    ``storage``: how the decoder's caches and the bare replays keep keys and
    values (--kv-bits); ``ignore_eos``: every run decodes its whole budget.

    Besides wall times it takes the main thread's CPU time on both sides:
    the decoder's host work per step beyond what the bare forwards need
    (building the same graphs) is the part of a step outside its forwards
    that no waiting hides, and it stays measurable on a loaded machine,
    where wall times drift."""
    recorded, prepared = [], []
    evals = 0
    for prompt, params in jobs:
        recorder = RecordingModel(model)
        with counting_evals() as counted:
            _, dec = decode(recorder, tokenizer, prompt, params, storage=storage, ignore_eos=ignore_eos)
        evals += counted["evals"]
        recorded.append((recorder.shapes(), dec.stats))
        prepared.append(prepare(model, recorded[-1][0], storage=storage))
    shapes = [s for sh, _ in recorded for s in sh]
    walls, hosts, cpus, bares, bare_hosts, bare_cpus, runs = [], [], [], [], [], [], []

    def bare_all() -> None:
        h0, c0 = _thread_seconds(), time.process_time()
        bares.append([t for prep in prepared for t in replay(model, prep)])
        bare_hosts.append(_thread_seconds() - h0)
        bare_cpus.append(time.process_time() - c0)

    for i in range(repeat):
        if i % 2:  # alternate which goes first, so neither always runs on a warmer machine
            bare_all()
        h0, c0, wall, decs = _thread_seconds(), time.process_time(), 0.0, []
        for (prompt, params), (sh, _) in zip(jobs, recorded):
            w, dec = decode(model, tokenizer, prompt, params, storage=storage, ignore_eos=ignore_eos)
            if dec.stats.forwards != len(sh):
                raise RefusionError(f"the timed run made {dec.stats.forwards} forwards, the recorded "
                                    f"one {len(sh)}: the decoder is not deterministic here")
            wall += w
            decs.append(dec.stats)  # not the decoder: its cache would stay allocated
        hosts.append(_thread_seconds() - h0)
        cpus.append(time.process_time() - c0)
        walls.append(wall)
        runs.append(decs)
        if not i % 2:
            bare_all()
    mid = sorted(range(repeat), key=lambda i: walls[i])[(repeat - 1) // 2]
    bare_mid = sorted(bares, key=sum)[(repeat - 1) // 2]
    host, bare_host = median(hosts), median(bare_hosts)
    cpu, bare_cpu = median(cpus), median(bare_cpus)
    decs = runs[mid]
    total = lambda name: sum(getattr(st, name) for st in decs)  # noqa: E731
    phase_seconds = {p: sum(st.seconds[p] for st in decs) for p in PHASE_ORDER}
    steps = max(total("steps"), 1)
    first = jobs[0][1]
    return {
        "params": {k: getattr(first, k) for k in ("gen_length", "slot_size", "block_length", "serial_num_blocks",
                                                  "slot_threshold", "token_threshold")},
        "ignore_eos": ignore_eos,
        "kv_cache": (storage or KVStorage()).describe(model.cache_spec()),
        "prompts": len(jobs),
        "prompt_tokens": sum(len(p) for p, _ in jobs),
        "generated_tokens": total("generated_tokens"),
        "committed_tokens": total("committed_tokens"),
        "forwards": total("forwards"),
        "steps": total("steps"),
        "host_syncs": total("host_syncs"),
        "host_syncs_per_step": round(total("host_syncs") / steps, 3),
        "evals": evals,
        "evals_per_step": round(evals / max(sum(st.steps for _, st in recorded), 1), 3),
        "decoder_seconds": round(walls[mid], 6),
        "decoder_phase_seconds": {k: round(v, 6) for k, v in phase_seconds.items()},
        "bare_seconds": round(sum(bare_mid), 6),
        "bare_phase_seconds": {k: round(v, 6) for k, v in by_phase(shapes, bare_mid).items()},
        "forwards_per_phase": count_by_phase(shapes),
        "overhead": round(walls[mid] / sum(bare_mid), 4),
        "outside_forwards_ms_per_step": round((walls[mid] - sum(bare_mid)) / steps * 1000, 4),
        "decoder_host_seconds": round(host, 6),
        "bare_host_seconds": round(bare_host, 6),
        "decoder_cpu_seconds": round(cpu, 6),
        "bare_cpu_seconds": round(bare_cpu, 6),
        "host_ms_per_step": round(host / steps * 1000, 4),
        "compute_ms_per_step": round((cpu - host) / steps * 1000, 4),
        "extra_host_ms_per_step": round((host - bare_host) / steps * 1000, 4),
        "repeat_decoder_seconds": [round(w, 6) for w in walls],
        "repeat_bare_seconds": [round(sum(b), 6) for b in bares],
        "repeat_decoder_host_seconds": [round(h, 6) for h in hosts],
        "repeat_bare_host_seconds": [round(h, 6) for h in bare_hosts],
        "repeat_decoder_cpu_seconds": [round(c, 6) for c in cpus],
        "forward_tokens": [s.tokens for s in shapes],
    }


def report(results: dict) -> str:
    rows, steps = [], []
    for mode, r in results.items():
        rows.append([mode, r["generated_tokens"], r["forwards"], r["steps"], r["host_syncs_per_step"],
                     r["evals_per_step"], r["decoder_seconds"], sum(r["decoder_phase_seconds"].values()),
                     r["bare_seconds"], f"{r['overhead']:.3f}x"])
        steps.append([mode, r["steps"], r["outside_forwards_ms_per_step"], r["compute_ms_per_step"],
                      r["host_ms_per_step"], r["bare_host_seconds"] / max(r["steps"], 1) * 1000,
                      r["extra_host_ms_per_step"]])
    lines = [format_table(["mode", "tokens", "fwd", "steps", "syncs/step", "evals/step", "decoder s",
                           "phases s", "bare s", "overhead"], rows, left=[0])]
    lines += ["", "per step: wall outside the bare forwards; CPU time of the decoder run off the main "
              "thread (compute) and on it (host), the bare forwards' host CPU, the decoder's extra",
              format_table(["mode", "steps", "outside ms/step", "compute CPU ms/step", "host CPU ms/step",
                            "bare host ms/step", "extra host ms/step"], steps, left=[0])]
    for mode, r in results.items():
        prow = []
        for p in PHASE_ORDER:
            d, b = r["decoder_phase_seconds"][p], r["bare_phase_seconds"][p]
            prow.append([p, r["forwards_per_phase"][p], d * 1000, b * 1000,
                         f"{d / b:.3f}x" if b > 0 else None])
        other = r["decoder_seconds"] - sum(r["decoder_phase_seconds"].values())
        prow.append(["outside phases", None, other * 1000, None, None])
        lines += ["", f"mode {mode}: per phase (decoder vs bare forwards)",
                  format_table(["phase", "fwd", "decoder ms", "bare ms", "ratio"], prow, left=[0])]
    return "\n".join(lines)


def suite_jobs(args, tokenizer) -> List[Tuple[List[int], RefusionParams]]:
    """--suite: the suite's (first --cases) prompts, chat-templated, with the
    suite's settings under the flags given (as ``python -m refusion_mlx.bench``)."""
    suite = load_suite(args.suite)
    cases = suite.cases[: args.cases] if args.cases else suite.cases
    overrides = {k: getattr(args, k) for k in ("gen_length", "slot_size", "block_length", "serial_num_blocks",
                                                "slot_threshold", "token_threshold")
                 if getattr(args, k) is not None}
    return [(chat_prompt(tokenizer, c.prompt, system=c.system), resolve_params(suite, c, None, overrides))
            for c in cases]


def main(argv: Optional[List[str]] = None) -> int:
    parser = base_parser("python -m benchmarks.overhead", "Decoder overhead over bare forwards.")
    parser.set_defaults(slot_size=None, seed=None, ignore_eos=None)
    parser.add_argument("--modes", help=f"comma-separated, of {', '.join(MODES)} (default all)")
    parser.add_argument("--gen-length", type=int, help="response budget (default 64)")
    parser.add_argument("--block-length", type=int, help="block size in tokens (default 16)")
    parser.add_argument("--prompt-tokens", type=int, help="random prompt length (default 64)")
    parser.add_argument("--repeat", type=int, default=3, help="timed decoder runs and replays (median)")
    parser.add_argument("--suite", help="instead of --modes on a random prompt: the prompts of a bench "
                        "suite ('default' or a suite file), chat-templated, with its settings under the "
                        "decoding flags given")
    parser.add_argument("--cases", type=int, default=0, help="with --suite: only the first N prompts")
    parser.add_argument("--serial-num-blocks", type=int, help="with --suite: number of blocks")
    parser.add_argument("--slot-threshold", type=float, help="with --suite: tau_s")
    parser.add_argument("--token-threshold", type=float, help="with --suite: tau_t")
    args = parser.parse_args(argv)
    for name in ("gen_length", "block_length", "prompt_tokens", "repeat", "slot_size", "serial_num_blocks"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.cases < 0:
        parser.error("--cases must be >= 0")
    if args.suite is not None:
        if any(getattr(args, k) is not None for k in ("modes", "prompt_tokens", "seed")):
            parser.error("--modes, --prompt-tokens and --seed make the random prompt's runs; --suite decodes "
                         "the suite's prompts with its settings")
        args.ignore_eos = bool(args.ignore_eos)  # the suite's answers end where they end, unless told
    else:
        if any(getattr(args, k) is not None for k in ("serial_num_blocks", "slot_threshold", "token_threshold")):
            parser.error("--serial-num-blocks, --slot-threshold and --token-threshold need --suite "
                         "(--modes fix the thresholds)")
        args.gen_length = args.gen_length or 64
        args.block_length = args.block_length or 16
        args.slot_size = args.slot_size or 4
        args.prompt_tokens = args.prompt_tokens or 64
        args.seed = args.seed or 0
        # a random prompt's answer often ends at once: measure the budget, unless told to stop at EOS
        args.ignore_eos = args.ignore_eos is not False
    modes = [m.strip() for m in (args.modes or ",".join(MODES)).split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        parser.error(f"unknown mode(s) {', '.join(bad) or '(none)'}; known: {', '.join(MODES)}")

    def body() -> int:
        check_json_path(args.json)
        storage_from_args(args)  # a bad pair fails before the model loads
        eos = "EOS ignored (the whole budget)" if args.ignore_eos else "stopping at EOS"
        if args.suite is not None:
            model, tokenizer, env = load_model(args.model, args.dtype)
            storage = storage_from_args(args, model)
            jobs = suite_jobs(args, tokenizer)
            layout = jobs[0][1].layout().describe()
            print(f"decoder overhead: suite {args.suite}, {len(jobs)} prompts ({sum(len(p) for p, _ in jobs)} "
                  f"prompt tokens), budget {jobs[0][1].layout().gen_length}, first prompt's blocks "
                  f"{layout['blocks']} x {layout['block_length']}, {eos}, KV cache "
                  f"{storage.describe(model.cache_spec())}, median of {args.repeat}\n")
            results = {"suite": measure_jobs(model, tokenizer, jobs, args.repeat, storage, args.ignore_eos)}
            print(f"  suite: overhead {results['suite']['overhead']:.3f}x", file=sys.stderr, flush=True)
            print(report(results))
            write_json(args.json, {"meta": env, "target": TARGET, "modes": results})
            return 0
        for m in modes:
            make_params(args.gen_length, args.slot_size, args.block_length, m).layout()
        model, tokenizer, env = load_model(args.model, args.dtype)
        storage = storage_from_args(args, model)
        prompt = random_prompt(tokenizer, model, args.prompt_tokens, args.seed)
        print(f"decoder overhead: budget {args.gen_length}, slot {args.slot_size}, block {args.block_length}, "
              f"random prompt of {len(prompt)} tokens (seed {args.seed}), {eos}, KV cache "
              f"{storage.describe(model.cache_spec())}, median of {args.repeat}; target <= {TARGET:.2f}x\n")
        results = {}
        for m in modes:
            params = make_params(args.gen_length, args.slot_size, args.block_length, m)
            results[m] = measure_mode(model, tokenizer, prompt, params, args.repeat, storage, args.ignore_eos)
            print(f"  {m}: overhead {results[m]['overhead']:.3f}x", file=sys.stderr, flush=True)
        print(report(results))
        write_json(args.json, {"meta": env, "target": TARGET, "modes": results})
        return 0

    return run(body)


if __name__ == "__main__":
    sys.exit(main())
