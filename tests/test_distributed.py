"""Two ranks over the ring backend on loopback (``mlx.launch --backend ring
-n 2``): answers equal one process's token for token (float32), tensor
parallel (generate) and pipeline (the server, under the openai client);
only rank 0 prints; a server whose rank stops mid-step ends with one line,
one whose rank is killed answers its open requests first. Each start costs
two interpreters' start: three in all (mlx.launch for generate; the others
started as it starts ranks, ``tests/ranks.py``, so the test sees each rank's
own exit status), so each server serves its module's tests, the last of
them ending it. The ranks' way to ready is ``test_distributed_start.py``,
ranks that die under generate and the chat ``test_distributed_ends.py``."""

import contextlib
import dataclasses
import http.client
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from refusion_mlx.errors import ConfigError
from refusion_mlx.generate import main as generate_main
from refusion_mlx.models.loading import model_args, read_config
from refusion_mlx.models.sharding import check_tensor_parallel, layer_range

from tests.helpers import FIXTURE_MODEL
from tests.ranks import ROOT, free_ports, two_rank_server

PROMPTS = [
    {"prompt": "Write the multiplication table of 3 up to 4."},
    {"prompt": "Count from 1 to 9.", "max_tokens": 24},
    {"prompt": "Write the multiplication table of 7 up to 5.", "temperature": 0.7, "seed": 3, "xtc_probability": 0.5,
     "xtc_threshold": 0.05},
    {"prompt": "Count from 1 to 9.", "max_tokens": 24, "frequency_penalty": 1.5, "logit_bias": {"17": -100},
     "repetition_penalty": 1.3},
]


def _launcher():
    script = Path(sys.executable).parent / "mlx.launch"
    return [str(script)] if script.exists() else [sys.executable, "-m", "mlx._distributed_utils.launch"]


def _launch(args, timeout=90):
    """``mlx.launch --backend ring -n 2 python -m refusion_mlx.<args>`` from the repository root.
    mlx.launch exits 0 whatever its ranks do; a rank whose port another process took between
    choosing and binding it (the suite runs servers alongside) is tried again on new ports."""
    for _ in range(3):
        cmd = [*_launcher(), "--backend", "ring", "-n", "2", "--starting-port", str(free_ports(2)),
               sys.executable, "-m", *args]
        run = _run_fed(cmd, timeout)
        if "Couldn't bind socket" not in run.stderr:
            return run
    return run


def _run_fed(cmd, timeout):
    """``cmd`` run to its end, its output captured, with a MiB on a standard input held open. mlx.launch
    passes its input on to each rank, one thread a rank, and those threads loop without sleeping while a
    rank's input pipe has room, or its own input is at its end: a core for as long as the ranks run (4.7
    CPU-s to launch two ``sleep 4``). Once the ranks' pipes are full of input they never read, the
    launcher waits in select (0.2 CPU-s)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    stdin, proc.stdin = proc.stdin, None  # not closed by communicate: its end sets the launcher looping

    def feed():
        with contextlib.suppress(OSError):
            stdin.write("\n" * (1 << 20))
            stdin.flush()

    threading.Thread(target=feed, daemon=True).start()
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
        proc.wait()
        with contextlib.suppress(OSError):
            stdin.close()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _one_process(argv, capsys):
    assert generate_main(argv) == 0
    return capsys.readouterr().out


def test_two_ranks_answer_like_one(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    argv = ["--model", str(FIXTURE_MODEL), "--prompts-file", str(prompts), "--json", "--dtype", "float32"]
    alone = [json.loads(line) for line in _one_process(argv, capsys).splitlines()]
    two = _launch(["refusion_mlx.generate", *argv])
    assert two.returncode == 0 and "error" not in two.stderr, two.stderr
    lines = two.stdout.splitlines()
    assert len(lines) == len(PROMPTS), two.stdout + two.stderr  # rank 1 printed nothing
    for a, b in zip(alone, map(json.loads, lines)):
        assert b["output_ids"] == a["output_ids"] and b["text"] == a["text"] and a["output_ids"]
        dist = b["stats"]["distributed"]
        assert dist["backend"] == "ring" and dist["size"] == 2 and dist["mode"] == "tensor"
        # every layer weight is split; the embedding, norms and LM head stay whole
        assert dist["weight_bytes"] / 2 < dist["weight_bytes_per_rank"] < dist["weight_bytes"]
        assert "distributed" not in a["stats"]


@pytest.fixture(scope="module")
def tensor_server(tmp_path_factory):
    """A server on two ranks, split by heads (tensor parallel), on the demo model, sampling unseeded by
    default (--temp 1.0), with a 4-s limit on collectives."""
    with two_rank_server(tmp_path_factory.mktemp("tensor"), ["--temp", "1.0", "--max-tokens", "64"], timeout_s="4",
                          model=None) as served:
        yield served


@pytest.fixture(scope="module")
def one_process():
    """What one process answers and scores, for the pipeline server's tests: found before that server starts,
    since a rank that waits for the next step polls its socket, a core's worth, as long as it waits."""
    from refusion_mlx.decode.scoring import score_ar, score_mc
    from refusion_mlx.decode.stream import chat_prompt, stream_generate
    from refusion_mlx.models.loading import load

    model, tok = load(FIXTURE_MODEL)
    prompts = [p["prompt"] for p in PROMPTS[:2]] + ["Who is Sven?"]
    answers = {p: "".join(r.text for r in stream_generate(model, tok, chat_prompt(tok, p), max_tokens=32, kv_bits=8))
               for p in prompts}
    ids = tok.encode("Sven lives in Oslo. Where does Sven live? In Oslo.")
    context = len(ids) - 3
    want_ar = score_ar(model, [ids], kv_bits=8)[0].logprobs[1:]
    want_mc = score_mc(model, ids, context, model.args.mask_token_id, mc_num=8, seed=2, kv_bits=8).logprobs[context:]
    return {"model": model, "answers": answers, "ids": ids, "context": context, "ar": want_ar, "mc": want_mc}


@pytest.fixture(scope="module")
def pipeline_server(tmp_path_factory, one_process):
    """A server on two ranks, split by layers (--pipeline), its KV caches
    quantized (--kv-bits 8: each rank keeps its own layers' codes)."""
    with two_rank_server(tmp_path_factory.mktemp("ranks"), ["--pipeline", "--kv-bits", "8"]) as served:
        yield served


def test_a_tensor_parallel_server_samples_alike_on_every_rank(tensor_server):
    """Unseeded sampling (--temp 1.0, no seed in the request): each rank decodes on its engine thread, whose
    MLX generator is the thread's own; every rank seeds it with the seed rank 0 broadcast. Unseeded, the
    ranks' drafts parted and, under mlx.launch, the server hung until the watchdog ended both ranks (two
    ranks started as here drew alike even so: this test keeps the path working, the hang was reproduced
    under mlx.launch)."""
    import openai

    port, procs = tensor_server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="local", max_retries=0, timeout=30)
    for _ in range(6):
        hot = client.chat.completions.create(model="m", max_tokens=32, temperature=1.0,
                                             messages=[{"role": "user", "content": "Who is Sven?"}])
        assert hot.choices[0].finish_reason in ("stop", "length")
    assert all(p.poll() is None for p in procs)


def test_a_server_whose_rank_was_killed_answers_its_open_requests(tensor_server):
    """Rank 1 killed mid-request: rank 0's engine gets the ring's error (or, when MLX waits for ever
    instead, the watchdog ends the rank); either way every open request gets the server's "shutting down"
    answer -- a 503 in the API's shape, a stream's error event and [DONE] -- before rank 0 exits 1 with one
    line (it exited at once: the requests' connections were reset, a stream cut mid-answer). Ends the
    tensor-parallel server; its requests ask for greedy decoding, which samples none."""
    port, procs = tensor_server
    body = {"messages": [{"role": "user", "content": "Count to 1000."}], "max_tokens": 2000, "block_length": 4,
            "temperature": 0}

    def ask():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())

    with ThreadPoolExecutor(1) as pool:
        whole = pool.submit(ask)
        while True:  # the engine holds it (queued or in the batch)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as resp:
                health = json.load(resp)
            if health["active"] + health["queued"]:
                break
            time.sleep(0.05)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})
        stream = conn.getresponse()
        assert stream.status == 200 and stream.readline().startswith(b"data: ")  # in the batch
        procs[1].send_signal(signal.SIGKILL)
        rest = stream.read()
        status, payload = whole.result(timeout=60)
    _, err = procs[0].communicate(timeout=60)
    assert (status, payload["error"]["code"]) == (503, "shutting_down"), payload
    assert b'"code": "shutting_down"' in rest and rest.rstrip().endswith(b"data: [DONE]"), rest
    err = err.decode()
    assert procs[0].returncode == 1 and "Traceback" not in err, err
    assert [line for line in err.splitlines() if "error" in line.lower()] in (
        ["error: rank 0: lost the other ranks ([ring] connection to a peer was lost): a rank died or the link broke"],
        ["error: rank 0: no progress from the other ranks for 4 s (a rank died or the link is down); stopping "
         "(REFUSION_MLX_COLLECTIVE_TIMEOUT sets the limit)"]), err


def test_pipeline_server_under_two_ranks_answers_the_openai_client(pipeline_server, one_process):
    """Rank 0 serves HTTP; every rank runs the batches it broadcasts:
    concurrent requests (streamed and not) answer as one process does. The
    model is split by layers here (--pipeline; the tests above split heads)
    and its KV caches are 8-bit, so one start checks the server, the
    pipeline and a quantized cache across ranks."""
    import openai

    port, _ = pipeline_server
    model, answers = one_process["model"], one_process["answers"]
    prompts, expected = list(answers), list(answers.values())
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="local", max_retries=0, timeout=60)

    def ask(i):
        messages = [{"role": "user", "content": prompts[i]}]
        if i % 2:
            stream = client.chat.completions.create(model="m", messages=messages, max_tokens=32, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        return client.chat.completions.create(model="m", messages=messages, max_tokens=32).choices[0].message.content

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(ask, range(len(prompts)))) == expected
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as resp:
        kv = json.load(resp)["kv"]
    spec = model.cache_spec()  # 2 KV heads of 64 codes, and a scale and a bias in the model's dtype for each
    assert (kv["bits"], kv["bytes_per_token"]) == (8, spec.layers * 2 * 2 * (64 + 2 * spec.dtype.size))


def test_pipeline_server_decodes_a_constrained_answer_on_every_rank(pipeline_server):
    """A request's constraint is compiled on rank 0's request thread; the plan carries the constraint,
    not rank 0's compiled matcher, and each rank decodes under it: the answer parses."""
    import openai

    port, procs = pipeline_server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="local", max_retries=0, timeout=60)
    schema = {"type": "object", "properties": {"pet": {"enum": ["cat", "turtle"]}}, "required": ["pet"],
              "additionalProperties": False}
    answer = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Who is Sven?"}], max_tokens=32,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}})
    assert answer.choices[0].finish_reason == "stop"
    assert json.loads(answer.choices[0].message.content)["pet"] in ("cat", "turtle")
    # its last pass (known tokens only) had no output, and neither has a step of prefill chunks: a rank's
    # forward must still run then, or the next rank waits for its hidden states for ever (the GPU paths did)
    long = "Count: " + "1 2 3 " * 120  # over 512 tokens: prefilled in two chunks
    again = client.chat.completions.create(model="m", messages=[{"role": "user", "content": long}], max_tokens=16)
    assert again.usage.prompt_tokens > 512 and again.usage.completion_tokens == 16
    assert all(p.poll() is None for p in procs)


def test_pipeline_server_scores_a_prompt_as_one_process_does(pipeline_server, one_process):
    """Echo scoring under two ranks (each running its layers of every scoring
    piece): the AR and the Monte Carlo estimates are those of one process
    with the same quantized cache (--kv-bits 8)."""
    port, _ = pipeline_server
    ids, context, want_ar, want_mc = (one_process[k] for k in ("ids", "context", "ar", "mc"))
    for body, want, skip in (({}, want_ar, 1),
                             ({"logprob_estimator": "mc", "mc_num": 8, "seed": 2, "context_tokens": context},
                              want_mc, context)):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": ids, "echo": True, "logprobs": 0,
                                                            "max_tokens": 0, **body}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        payload = json.loads(response.read())
        assert response.status == 200, payload
        got = payload["choices"][0]["logprobs"]["token_logprobs"][skip:]
        assert got == pytest.approx(want, abs=1e-4)


def test_a_server_whose_rank_died_mid_step_stops_with_one_line(pipeline_server):
    """When a rank of a server dies, mlx.launch sends rank 0 SIGTERM; if the
    peer died mid-evaluation, rank 0's collective never ends. Rank 1 stopped
    (SIGSTOP) mid-request, then that SIGTERM: the open stream ends with
    "shutting down", and rank 0 prints one line and exits 1 within the stop's
    grace (watchdog.STOP_GRACE, not the collectives' 120 s) -- no traceback
    of uvicorn cancelling the request (issue 38). Ends the module's server."""
    port, procs = pipeline_server
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = {"messages": [{"role": "user", "content": "Count to 1000."}], "max_tokens": 2000,
            "block_length": 4, "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")  # in the batch
    procs[1].send_signal(signal.SIGSTOP)
    procs[0].send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    rest = response.read()
    _, err = procs[0].communicate(timeout=30)
    assert time.monotonic() - t0 < 15
    assert b'"code": "shutting_down"' in rest, rest
    err = err.decode()
    assert procs[0].returncode == 1, err
    assert "Traceback" not in err and "Cancel" not in err, err
    assert [line for line in err.splitlines() if "error" in line.lower()] == [
        "error: rank 0: no progress from the other ranks for 5 s after the stop (a rank died or the link is down)"], err


def test_tensor_parallel_checks_are_one_line():
    args = model_args(read_config(FIXTURE_MODEL))  # 4 heads, 2 KV heads
    check_tensor_parallel(args, 2)
    with pytest.raises(ConfigError, match="num_key_value_heads \\(2\\) divisible by 4"):
        check_tensor_parallel(args, 4)
    with pytest.raises(ConfigError, match="num_attention_heads \\(4\\) divisible by 3"):
        check_tensor_parallel(args, 3)
    assert [layer_range(7, r, 3) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]


def test_step_plan_crosses_to_the_other_ranks():
    """What rank 0 broadcasts each turn: requests, not its HTTP-side jobs."""
    import pickle

    from refusion_mlx.decode.params import RefusionParams
    from refusion_mlx.serve.core.engine_request import EngineRequest
    from refusion_mlx.serve.core.job import Job, Turn

    request = EngineRequest([5, 6, 7], RefusionParams(gen_length=8), ("\n",))
    plan = Turn(cancelled=[3], admitted=[Job(request, loop=None)], score=False)
    copy = Turn.from_wire(pickle.loads(pickle.dumps(plan.wire())), lambda r: Job(r, loop=None))
    assert copy.cancelled == [3] and not copy.score and not copy.stop
    assert [j.request for j in copy.admitted] == [request] and copy.admitted[0].uid is None
    copy.admitted[0].post("text", "x")  # nobody listens on the other ranks: a no-op
    assert Turn.from_wire(Turn(stop=True).wire(), Job).stop

    from mlx_lm.utils import load_tokenizer

    from refusion_mlx.decode.grammar import Constraint, compile_constraint

    tok = load_tokenizer(FIXTURE_MODEL)
    constraint = Constraint.json_schema({"type": "object"}, "response_format")
    vocab = json.loads((FIXTURE_MODEL / "config.json").read_text())["vocab_size"]
    made = compile_constraint(constraint, tok, vocab, tok.eos_token_id)
    shaped = dataclasses.replace(request, constraint=constraint, compiled=made)
    copy = Turn.from_wire(pickle.loads(pickle.dumps(Turn(admitted=[Job(shaped, loop=None)]).wire())),
                          lambda r: Job(r, loop=None))
    assert copy.admitted[0].request == dataclasses.replace(shaped, compiled=None)


def test_a_rank_reads_only_its_slice_of_a_safetensors_tensor(tmp_path):
    import mlx.core as mx

    from refusion_mlx.errors import LoadError
    from refusion_mlx.models import slices

    full = {"w": mx.arange(48, dtype=mx.float32).reshape(6, 8).astype(mx.bfloat16),
            "q": mx.arange(24, dtype=mx.uint32).reshape(4, 6), "b": mx.arange(6, dtype=mx.float32)}
    mx.save_safetensors(str(tmp_path / "model.safetensors"), full)
    stored = slices.index([tmp_path / "model.safetensors"])
    assert stored["w"].shape == (6, 8) and stored["w"].mx_dtype == mx.bfloat16
    for rank in (0, 1):
        rows = slices.read(stored["w"], (3, 8), rank)
        cols = slices.read(stored["w"], (6, 4), rank)
        assert rows.dtype == mx.bfloat16 and mx.array_equal(rows, full["w"][3 * rank:3 * rank + 3])
        assert mx.array_equal(cols, full["w"][:, 4 * rank:4 * rank + 4])
        assert mx.array_equal(slices.read(stored["q"], (2, 6), rank), full["q"][2 * rank:2 * rank + 2])
    assert mx.array_equal(slices.read(stored["b"], (6,), 1), full["b"])  # whole
    with pytest.raises(LoadError, match="stored with shape"):
        slices.read(stored["w"], (3, 4), 0)  # two axes cannot both be split


