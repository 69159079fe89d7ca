"""Two ranks over the ring backend on loopback (``mlx.launch --backend ring
-n 2``): answers equal one process's token for token (float32), tensor
parallel (generate) and pipeline (the server, under the openai client);
only rank 0 prints; a rank that dies or goes silent ends the run with one
line, the server's too. Each start costs two interpreters' start: three
in all (mlx.launch for generate; the others started as it starts ranks, so
the test sees each rank's own exit status)."""

import contextlib
import dataclasses
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
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

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    {"prompt": "Write the multiplication table of 3 up to 4."},
    {"prompt": "Count from 1 to 9.", "max_tokens": 24},
    {"prompt": "Write the multiplication table of 7 up to 5.", "temperature": 0.7, "seed": 3},
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher():
    script = Path(sys.executable).parent / "mlx.launch"
    return [str(script)] if script.exists() else [sys.executable, "-m", "mlx._distributed_utils.launch"]


def _free_ports(n: int) -> int:
    """The first of ``n`` consecutive ports free now (mlx.launch gives rank i ``--starting-port`` + i)."""
    for _ in range(50):
        socks = []
        try:
            first = socket.socket()
            first.bind(("127.0.0.1", 0))
            socks.append(first)
            base = first.getsockname()[1]
            for i in range(1, n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def _launch(args, timeout=90, **kwargs):
    """``mlx.launch --backend ring -n 2 python -m refusion_mlx.<args>`` from the repository root.
    mlx.launch exits 0 whatever its ranks do; a rank whose port another process took between
    choosing and binding it (the suite runs servers alongside) is tried again on new ports."""
    for _ in range(3):
        cmd = [*_launcher(), "--backend", "ring", "-n", "2", "--starting-port", str(_free_ports(2)),
               sys.executable, "-m", *args]
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kwargs)
        if "Couldn't bind socket" not in run.stderr:
            return run
    return run


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


def _start_ranks(tmp_path, argv, timeout_s="4", command="refusion_mlx.generate", feed=None):
    """Two ranks started as mlx.launch starts them (MLX_RANK, MLX_HOSTFILE),
    so the test sees rank 0's own exit status. ``timeout_s`` None: the
    collectives' default timeout (120 s)."""
    hostfile = tmp_path / "hosts.json"
    port = _free_ports(2)
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    procs = []
    for rank in range(2):
        env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile))
        env.pop("REFUSION_MLX_COLLECTIVE_TIMEOUT", None)
        if timeout_s is not None:
            env["REFUSION_MLX_COLLECTIVE_TIMEOUT"] = timeout_s
        own = argv[rank] if argv and isinstance(argv[0], list) else argv  # a list per rank, or one for both
        run = ["-m", command] if isinstance(command, str) else command  # a module, or the interpreter's arguments
        procs.append(subprocess.Popen([sys.executable, *run, *own], cwd=ROOT, env=env,
                                      stdin=subprocess.PIPE if feed is not None and rank == 0 else None,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    if feed is not None:  # rank 0 reads the user's lines (a chat); they reach the others by broadcast
        procs[0].stdin.write(feed)
        procs[0].stdin.flush()
    return procs


def test_a_killed_rank_ends_the_run_with_one_line(tmp_path):
    argv = ["--model", str(FIXTURE_MODEL), "--prompt", "Count to 1000.", "--max-tokens", "2000",
            "--block-length", "4"]
    procs = _start_ranks(tmp_path, argv)
    try:
        assert procs[0].stdout.read(1)  # decoding has started on both ranks
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        _, err = procs[0].communicate(timeout=30)
        assert time.monotonic() - t0 < 20
    finally:
        for p in procs:
            p.kill()
            p.wait()
    err = err.decode()
    assert procs[0].returncode == 1
    lines = err.strip().splitlines()  # the backend's per-socket complaints are filtered out
    # the ring's error when MLX raises it; when the peer dies while an evaluation is in flight MLX
    # can wait for ever instead, and the watchdog (4 s here) ends the rank
    assert len(lines) == 1, err
    assert lines[0].startswith(("error: rank 0: lost the other ranks",
                                "error: rank 0: no progress from the other ranks for 4 s")), err


def test_a_killed_rank_ends_a_chat_with_one_line(tmp_path):
    """The chat as generate: a rank killed mid-answer is one error line on rank 0 and exit 1 (it was a
    traceback of the ring's RuntimeError)."""
    argv = ["--model", str(FIXTURE_MODEL), "--max-tokens", "2000", "--block-length", "4"]
    procs = _start_ranks(tmp_path, argv, command="refusion_mlx.chat", feed=b"Count to 1000.\n")
    try:
        assert procs[0].stdout.read(1)  # the answer has started on both ranks
        procs[1].send_signal(signal.SIGKILL)
        _, err = procs[0].communicate(timeout=30)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    err = err.decode()
    assert procs[0].returncode == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith(("error: rank 0: lost the other ranks",
                                                    "error: rank 0: no progress from the other ranks")), err


def _get(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path)
    response = conn.getresponse()
    response.read()
    return response.status


@contextlib.contextmanager
def _two_rank_server(folder, flags, timeout_s=None, model=FIXTURE_MODEL):
    """A server on two ranks, started as mlx.launch starts them, once it answers: (HTTP port, [rank 0, 1])."""
    port = _free_port()
    procs = _start_ranks(folder, [*(["--model", str(model)] if model else []), "--port", str(port), *flags],
                         timeout_s=timeout_s, command="refusion_mlx.server")
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if _get(port, "/health") == 200:
                    break
            except OSError:
                pass
            assert procs[0].poll() is None and time.monotonic() < deadline, procs[0].communicate()[1]
            time.sleep(0.2)
        yield port, procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def pipeline_server(tmp_path_factory):
    """A server on two ranks, split by layers (--pipeline), its KV caches
    quantized (--kv-bits 8: each rank keeps its own layers' codes)."""
    with _two_rank_server(tmp_path_factory.mktemp("ranks"), ["--pipeline", "--kv-bits", "8"]) as served:
        yield served


def test_the_python_api_samples_alike_on_every_rank(tmp_path):
    """distributed.group.init seeds MLX's generator alike on every rank, so unseeded sampling in the Python
    API draws alike. Only the commands' join seeded it: MLX seeds each process from the clock (in ms) at its
    first draw, so ranks that got there at different times (rank 1 half a second later here, as a rank on
    another machine would) drew apart, decoded apart, and the ring failed or hung."""
    code = ("import sys, time\nimport refusion_mlx as rm\nfrom refusion_mlx.distributed import group\n"
            "dist = group.init()\ntime.sleep(0.5 * dist.rank)\nmodel, tok = rm.load(sys.argv[1], dist=dist)\n"
            "for p in ['Who is Sven?', 'Count from 1 to 30.']:\n"
            "    print(repr(rm.generate(model, tok, rm.chat_prompt(tok, p), max_tokens=32, temperature=1.0)))\n")
    procs = _start_ranks(tmp_path, [str(FIXTURE_MODEL)], command=["-c", code])
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [0, 0], [err.decode() for _, err in outs]
    assert outs[0][0] == outs[1][0] and len(outs[0][0].splitlines()) == 2, outs


def test_a_tensor_parallel_server_samples_alike_on_every_rank(tmp_path):
    """Unseeded sampling (--temp 1.0, no seed in the request): each rank decodes on its engine thread, whose
    MLX generator is the thread's own; every rank seeds it with the seed rank 0 broadcast. Unseeded, the
    ranks' drafts parted and, under mlx.launch, the server hung until the watchdog ended both ranks (two
    ranks started as here drew alike even so: this test keeps the path working, the hang was reproduced
    under mlx.launch)."""
    import openai

    with _two_rank_server(tmp_path, ["--temp", "1.0", "--max-tokens", "64"], timeout_s="20",
                          model=None) as (port, procs):  # the demo model
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="local", max_retries=0, timeout=30)
        for _ in range(6):
            hot = client.chat.completions.create(model="m", max_tokens=32, temperature=1.0,
                                                 messages=[{"role": "user", "content": "Who is Sven?"}])
            assert hot.choices[0].finish_reason in ("stop", "length")
        assert all(p.poll() is None for p in procs)


def test_pipeline_server_under_two_ranks_answers_the_openai_client(pipeline_server):
    """Rank 0 serves HTTP; every rank runs the batches it broadcasts:
    concurrent requests (streamed and not) answer as one process does. The
    model is split by layers here (--pipeline; the test above splits heads)
    and its KV caches are 8-bit, so one start checks the server, the
    pipeline and a quantized cache across ranks."""
    import openai

    from refusion_mlx.decode.stream import chat_prompt, stream_generate
    from refusion_mlx.models.loading import load

    port, _ = pipeline_server
    prompts = [p["prompt"] for p in PROMPTS[:2]] + ["Who is Sven?"]
    model, tok = load(FIXTURE_MODEL)
    expected = ["".join(r.text for r in stream_generate(model, tok, chat_prompt(tok, p), max_tokens=32, kv_bits=8))
                for p in prompts]
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


def test_pipeline_server_scores_a_prompt_as_one_process_does(pipeline_server):
    """Echo scoring under two ranks (each running its layers of every scoring
    piece): the AR and the Monte Carlo estimates are those of one process
    with the same quantized cache (--kv-bits 8)."""
    from refusion_mlx.decode.scoring import score_ar, score_mc
    from refusion_mlx.models.loading import load

    port, _ = pipeline_server
    model, tok = load(FIXTURE_MODEL)
    ids = tok.encode("Sven lives in Oslo. Where does Sven live? In Oslo.")
    context = len(ids) - 3
    want_ar = score_ar(model, [ids], kv_bits=8)[0].logprobs[1:]
    want_mc = score_mc(model, ids, context, model.args.mask_token_id, mc_num=8, seed=2, kv_bits=8).logprobs[context:]
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


def test_a_server_whose_rank_was_killed_answers_its_open_requests(tmp_path):
    """Rank 1 killed mid-request: rank 0's engine gets the ring's error (or, when MLX waits for ever
    instead, the watchdog ends the rank); either way every open request gets the server's "shutting down"
    answer -- a 503 in the API's shape, a stream's error event and [DONE] -- before rank 0 exits 1 with one
    line (it exited at once: the requests' connections were reset, a stream cut mid-answer)."""
    body = {"messages": [{"role": "user", "content": "Count to 1000."}], "max_tokens": 2000, "block_length": 4}
    with _two_rank_server(tmp_path, [], timeout_s="4") as (port, procs):
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


def test_ranks_wait_for_a_rank_that_loads_slowly(tmp_path):
    """Rank 0 takes 6 s to find its model (a download) and 6 s more before reading its weights (a slow disk)
    under a 4-s limit on collectives: rank 1 waits for it, in the ranks' model check and in the barrier
    after loading, and both answer (the watchdog ended rank 1 in the first of those waits)."""
    argv = ["6", "refusion_mlx.generate", "--model", str(FIXTURE_MODEL), "--prompt", "Count from 1 to 9.",
            "--max-tokens", "8"]
    procs = _start_ranks(tmp_path, argv, timeout_s="4", command="tests.slow_load")
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err.decode() for _, err in outs]
    assert outs[0][0].strip() and not outs[1][0], outs  # rank 0 answered, alone


@pytest.mark.parametrize("dead", [1, 0])
def test_a_rank_that_dies_while_another_loads_ends_the_wait_with_one_line(tmp_path, monkeypatch, dead):
    """Loading's waits have their own limit (REFUSION_MLX_LOAD_TIMEOUT, 2 s here). Rank 1 killed while it
    waits for rank 0's slow loading ends rank 0 with one line once it gets to the wait (the collective
    waited for ever, unwatched); rank 0 killed so ends rank 1 (its collective came back incomplete, and it
    exited 1 unsaid: a traceback into its quiet standard error). Never a wait without end."""
    monkeypatch.setenv("REFUSION_MLX_LOAD_TIMEOUT", "2")
    argv = ["6", "refusion_mlx.generate", "--model", str(FIXTURE_MODEL), "--prompt", "Count from 1 to 9."]
    procs = _start_ranks(tmp_path, argv, timeout_s="20", command="tests.slow_load")
    left = procs[1 - dead]
    try:
        _wait_for(procs[0].stderr, b"loads slowly")  # both ranks have joined; rank 1 goes on to wait for rank 0
        time.sleep(2)
        procs[dead].send_signal(signal.SIGKILL)
        _, err = left.communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    lines = [line for line in err.decode().splitlines() if line.startswith("error")]
    assert left.returncode == 1 and len(lines) == 1, err.decode()
    rank = f"error: rank {1 - dead}:"
    assert lines[0].startswith((f"{rank} lost the other ranks",
                                f"{rank} no progress from the other ranks for 2 s while they load the model")), lines


def test_a_silent_collective_times_out_with_one_line():
    """A link that goes quiet (a peer stopped, a cable pulled) raises nothing:
    the watchdog ends the rank. (Shown here without a second rank; under
    mlx.launch a SIGSTOPped rank 1 gives rank 0 this line.)"""
    code = ("import time\nfrom refusion_mlx.distributed import watchdog\n"
            "watchdog.install(0, timeout=0.5)\n"
            "with watchdog.armed():\n    time.sleep(0.2)\n    watchdog.pet()\n    time.sleep(30)\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and time.monotonic() - t0 < 15
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: no progress from the other ranks for 0.5 s")


@pytest.mark.parametrize("text, says", [
    (None, "MLX_HOSTFILE: cannot read {path}: No such file or directory"),
    ("[]", "MLX_HOSTFILE: {path} lists no hosts"),
    ("{}", "MLX_HOSTFILE: {path} must hold a JSON list of hosts, one per rank (as mlx.launch writes it), not a dict"),
    ('{"bad', "MLX_HOSTFILE: {path} is not valid JSON: "),
    ("[[]]", 'MLX_HOSTFILE: {path}: host 0 must be an "ip:port" or a list of them, got []'),
    ('[["127.0.0.1:1"], 7]', 'MLX_HOSTFILE: {path}: host 1 must be an "ip:port" or a list of them, got 7'),
    ('[["127.0.0.1:1"], ["127.0.0.1:2"]]', "MLX_RANK='2' is not a rank of the 2 hosts MLX_HOSTFILE={path} lists"),
])
def test_a_bad_hostfile_is_one_line_before_mlx_reads_it(tmp_path, monkeypatch, text, says):
    """MLX_HOSTFILE is checked before MLX reads it: an empty list or object killed the process (a floating
    point exception, exit 136), a missing file was a JSON parse error of empty input."""
    from refusion_mlx.distributed import group
    from refusion_mlx.distributed.group import DistributedError

    path = tmp_path / "hosts.json"
    if text is not None:
        path.write_text(text)
    monkeypatch.setenv("MLX_RANK", "2")
    monkeypatch.setenv("MLX_HOSTFILE", str(path))
    with pytest.raises(DistributedError) as raised:
        group.init()
    assert str(raised.value).startswith(says.format(path=path)), raised.value


def test_a_hostfile_of_one_host_runs_alone(tmp_path, monkeypatch):
    """mlx.launch -n 1 writes an empty hostfile; a list of one host is alone too (MLX's ring of one waited
    for ever). And the command line says a bad hostfile in one line, exit 1."""
    from refusion_mlx.distributed import group

    path = tmp_path / "hosts.json"
    monkeypatch.setenv("MLX_RANK", "0")
    monkeypatch.setenv("MLX_HOSTFILE", str(path))
    for text in ("\n", '[["127.0.0.1:1"]]'):
        path.write_text(text)
        assert group.init() is None
    path.write_text("[]")
    run = subprocess.run([sys.executable, "-m", "refusion_mlx.generate", "--prompt", "hi"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stderr) == (1, f"error: MLX_HOSTFILE: {path} lists no hosts\n")


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



def _wait_for(stream, needle: bytes, timeout: float = 60) -> bytes:
    """Read ``stream`` (a pipe) until ``needle`` shows; what was read."""
    import select

    seen, deadline = b"", time.monotonic() + timeout
    while needle not in seen:
        assert time.monotonic() < deadline, seen
        if select.select([stream], [], [], 0.5)[0]:
            chunk = os.read(stream.fileno(), 4096)
            assert chunk, seen
            seen += chunk
    return seen


def test_ctrl_c_in_a_two_rank_chat_stops_every_rank_at_the_same_step(tmp_path):
    """Ctrl-C reaches every rank of the terminal's process group. Mid-answer it drops the turn on every rank
    at one step, and the chat goes on (the ranks stopped at different steps and waited on each other); at the
    prompt it ends the chat on every rank as Ctrl-C ends a command: "interrupted", exit 130 (rank 0 aborted
    once: its input thread was blocked in stdin)."""
    argv = ["--model", str(FIXTURE_MODEL), "--max-tokens", "2000", "--block-length", "4"]
    procs = _start_ranks(tmp_path, argv, timeout_s="20", command="refusion_mlx.chat", feed=b"Count to 1000.\n")
    try:
        _wait_for(procs[0].stdout, b" ")  # the answer has started on both ranks
        for p in procs:
            p.send_signal(signal.SIGINT)
        _wait_for(procs[0].stderr, b"[interrupted")
        procs[0].stdin.write(b"Count from 1 to 5.\n")
        procs[0].stdin.flush()
        _wait_for(procs[0].stderr, b"tokens/forward")  # the next turn is answered on both ranks
        time.sleep(0.5)
        for p in procs:  # at the prompt
            p.send_signal(signal.SIGINT)
        out, err = procs[0].communicate(timeout=30)
        _, err1 = procs[1].communicate(timeout=30)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [130, 130], (err + err1).decode()
    assert err.decode().strip().splitlines()[-1] == "interrupted", err.decode()
    assert b"Traceback" not in err + err1 and b"Fatal" not in err + err1, (err + err1).decode()


def _other_model(folder: Path) -> Path:
    """The fixture with one layer's weight halved in place (the safetensors header and size unchanged) and
    another chat template: what a rank given another folder of the same config.json loads."""
    import shutil

    import numpy as np

    other = folder / "other"
    shutil.copytree(FIXTURE_MODEL, other)
    weights = other / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    info = json.loads(raw[8:8 + n])["model.layers.1.mlp.down_proj.weight"]
    assert info["dtype"] == "BF16"
    a, b = (8 + n + offset for offset in info["data_offsets"])
    high = np.frombuffer(bytes(raw[a:b]), np.uint16).astype(np.uint32) << 16  # bfloat16 as float32
    raw[a:b] = ((high.view(np.float32) * 0.5).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    weights.write_bytes(raw)
    (other / "chat_template.jinja").write_text((other / "chat_template.jinja").read_text() + "{# another #}")
    return other


def test_a_model_fingerprint_sees_a_tensor_changed_under_the_same_header(tmp_path):
    from refusion_mlx.models.fingerprint import model_parts

    mine, other = model_parts(FIXTURE_MODEL), model_parts(_other_model(tmp_path))
    assert {k for k in mine if mine[k] != other[k]} == {"model.safetensors", "chat_template.jinja"}
    assert set(mine) >= {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}


def test_ranks_given_different_models_say_so_in_one_line(tmp_path):
    """Another model folder on rank 1 with the same config.json (a weight scaled, another chat template):
    every rank says which rank differs, and what, and exits 1 (they decoded other text unsaid, or failed at
    a collective as a lost rank)."""
    flags = ["--prompt", "Count from 1 to 9.", "--max-tokens", "8"]
    procs = _start_ranks(tmp_path, [["--model", str(FIXTURE_MODEL), *flags],
                                    ["--model", str(_other_model(tmp_path)), *flags]], timeout_s="20")
    errs = [p.communicate(timeout=60)[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [1, 1] and "Traceback" not in "".join(errs), errs
    assert errs[0].strip().splitlines()[-1] == (  # said once, by rank 0
        "error: rank 0: rank 1 loaded another model than rank 0 (its chat_template.jinja, model.safetensors "
        "differ): give every rank the same") and "error" not in errs[1], errs


@pytest.mark.parametrize("where", ["every rank", "rank 1"])
def test_a_failure_on_the_way_to_ready_is_said_once(tmp_path, where):
    """A missing model folder on every rank is one line, rank 0's (each rank said it); on rank 1 alone it is
    rank 1's line, said once (by rank 0, whom rank 1 met where it waited for it: meeting.meet)."""
    missing = str(tmp_path / "nowhere")
    flags = ["--prompt", "Count from 1 to 9.", "--max-tokens", "8"]
    argv = [["--model", missing if where == "every rank" else str(FIXTURE_MODEL), *flags],
            ["--model", missing, *flags]]
    procs = _start_ranks(tmp_path, argv, timeout_s="20")
    errs = [p.communicate(timeout=60)[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [1, 1], errs
    said = [line for err in errs for line in err.splitlines() if "error" in line]
    assert said == [f"error: rank {0 if where == 'every rank' else 1}: no model folder at {missing}"], errs
