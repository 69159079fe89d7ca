"""Run lm-evaluation-harness against ``python -m refusion_mlx.server``.

    pip install "lm_eval[api]"
    python examples/lm_eval_recipe/run.py --tasks demo_facts              # the demo model, offline
    python examples/lm_eval_recipe/run.py --model ./refusion-mlx-8bit --tasks gsm8k arc-c --limit 50

For each task the script starts the server with the authors' decoding
settings for it (``--preset``: their eval.sh's slot size, blocks and
thresholds, 512 tokens), runs ``lm_eval`` against it and stops it. The
authors' tasks are generation tasks run through the chat template
(``local-chat-completions``, ``--apply_chat_template``, zero-shot, as their
eval.sh); ``demo_facts`` is a local multiple-choice task
(``demo_facts.yaml``) scored through ``/v1/completions`` with echo +
logprobs, ``demo_facts_gen`` the same questions answered by decoding
(``local-completions``, batches of 4, 4 clients, both).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent

# task -> (lm-eval task name, server preset); the authors' eval.sh tasks, zero-shot with the chat template
AUTHORS_TASKS = {
    "gsm8k": ("gsm8k_cot", "gsm8k"),
    "math": ("minerva_math", "math"),
    "gpqa": ("gpqa_main_generative_n_shot", "gpqa"),
    "mbpp": ("mbpp", "mbpp"),
    "humaneval": ("humaneval_instruct_noprefix", "humaneval"),
    "arc-c": ("arc_challenge_chat", "arc-c"),
    "mmlu-pro": ("mmlu_pro", "mmlu-pro"),
}
LOCAL_TASKS = {"demo_facts": "demo_facts", "demo_facts_gen": "demo_facts_gen"}  # task -> its YAML here
CODE_TASKS = {"mbpp", "humaneval"}  # lm-eval runs the model's code: --confirm_run_unsafe_code


def start_server(model, port: int, preset=None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "refusion_mlx.server", "--port", str(port), "--model-id", "refusion"]
    cmd += ["--model", model] if model else []
    cmd += ["--preset", preset] if preset else []
    proc = subprocess.Popen(cmd)
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if json.load(r).get("status") == "ok":
                    return proc
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"error: the server exited with {proc.returncode}")
        time.sleep(1)
    proc.terminate()
    raise SystemExit("error: the server did not start in 10 minutes")


def local_tasks(into: Path) -> Path:
    """The local tasks' YAML files and data, with the data's absolute path, in a folder for --include_path."""
    into.mkdir(parents=True, exist_ok=True)
    shutil.copy(HERE / "demo_facts.jsonl", into)
    for name in LOCAL_TASKS.values():
        text = (HERE / f"{name}.yaml").read_text()
        (into / f"{name}.yaml").write_text(text.replace("test: demo_facts.jsonl",
                                                        f"test: {into / 'demo_facts.jsonl'}"))
    return into


def lm_eval_args(task: str, port: int, out: Path, limit, mc_num=None) -> list:
    """lm_eval's arguments for ``task``; ``mc_num``: score with the Monte Carlo estimator
    (the ``refusion-completions`` model of refusion_lm.py)."""
    base = f"http://127.0.0.1:{port}/v1"
    if task in LOCAL_TASKS:
        include = local_tasks(Path(tempfile.mkdtemp()) / "tasks")
        model = "local-completions" if mc_num is None else "refusion-completions"
        mc = "" if mc_num is None else f",estimator=mc,mc_num={mc_num}"
        args = ["--model", model, "--tasks", f"refusion_{LOCAL_TASKS[task]}", "--include_path",
                str(include), "--batch_size", "4", "--model_args",
                f"model=refusion,base_url={base}/completions,num_concurrent=4,max_retries=1{mc}"]
        # no tokenizer named: lm-eval uses the server's (/tokenize, /tokenizer_info)
    else:
        name, _ = AUTHORS_TASKS[task]
        args = ["--model", "local-chat-completions", "--tasks", name, "--apply_chat_template", "--num_fewshot", "0",
                "--batch_size", "1", "--model_args",
                f"model=refusion,base_url={base}/chat/completions,num_concurrent=4,max_retries=1,"
                "tokenized_requests=False", "--gen_kwargs", "max_gen_toks=512"]
        args += ["--confirm_run_unsafe_code"] if task in CODE_TASKS else []
    args += ["--output_path", str(out / task), "--log_samples"]
    return args + (["--limit", str(limit)] if limit else [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the bundled demo model)")
    parser.add_argument("--tasks", nargs="+", default=["demo_facts"],
                        choices=[*LOCAL_TASKS, *AUTHORS_TASKS])
    parser.add_argument("--port", type=int, default=8089)
    parser.add_argument("--limit", type=int, default=None, help="documents per task (lm-eval's --limit)")
    parser.add_argument("--output", type=Path, default=Path("lm_eval_results"))
    parser.add_argument("--mc-num", type=int, default=None,
                        help="score multiple-choice tasks with the Monte Carlo estimator, this many samples "
                             "(default: the AR estimator)")
    args = parser.parse_args()
    if importlib.util.find_spec("lm_eval") is None:  # run as this Python's module: no script on PATH needed
        print(f'error: lm_eval is not installed in this Python ({sys.executable}); pip install "lm_eval[api]"',
              file=sys.stderr)
        return 1
    status = 0
    for task in args.tasks:
        preset = AUTHORS_TASKS[task][1] if task in AUTHORS_TASKS else None
        server = start_server(args.model, args.port, preset)
        try:
            lm_eval = [sys.executable, "-m", "lm_eval"] if args.mc_num is None else [sys.executable,
                                                                                     str(HERE / "refusion_lm.py")]
            cmd = [*lm_eval, *lm_eval_args(task, args.port, args.output, args.limit, args.mc_num)]
            print("$", " ".join(cmd), flush=True)
            status |= subprocess.call(cmd)
        finally:
            server.terminate()
            server.wait(60)
    return status


if __name__ == "__main__":
    sys.exit(main())
