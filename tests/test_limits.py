"""No single request holds the server (issue 50): each hostile or careless
request next to a well-behaved client, on the demo model.

Scoring shares the engine with decoding and stops when its client leaves;
stored responses are bounded in bytes; connections that never finish their
headers are cut; tokenization leaves the event loop free; schemas past the
limits and grammars the engine cannot compile are 400s naming the field, and
so are stop strings past their length, whose check at each step reads only
the step's new text; a queued client that leaves logs nothing; hostile model
folders are refused.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import select
import shutil
import socket
import threading
import time

import numpy as np
import pytest

from refusion_mlx.models.loading import DEMO_MODEL

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server():
    from refusion_mlx.serve.http_server import RefusionServer

    srv = RefusionServer(str(DEMO_MODEL), model_id="demo", port=0, header_timeout=1.0, max_connections=24,
                         max_stored_response_bytes=200_000, max_batch=2).start()
    yield srv
    srv.close()


def call(srv, method, path, body=None, timeout=60):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=timeout)
    conn.request(method, path, body=None if body is None else json.dumps(body),
                 headers={"Content-Type": "application/json"} if body is not None else {})
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, json.loads(payload) if payload else None


def timed(fn, *args):
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


def in_thread(fn, *args):
    box = {}
    thread = threading.Thread(target=lambda: box.update(out=timed(fn, *args)))
    thread.start()
    return thread, box


def wait_for(check, seconds=30.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


def long_prompt(n: int, seed: int = 0) -> list:
    return [int(t) for t in np.random.default_rng(seed).integers(20, 700, n)]


def scoring(n: int, mc_num: int, seed: int = 0) -> dict:
    return {"prompt": long_prompt(n, seed), "echo": True, "logprobs": 1, "max_tokens": 0,
            "logprob_estimator": "mc", "mc_num": mc_num, "context_tokens": 10}


def active(srv) -> int:
    return call(srv, "GET", "/health")[1]["active"]


def test_scoring_shares_the_engine_with_a_chat(server):
    """A long Monte Carlo scoring request runs in pieces between decoding steps:
    a short chat sent while it scores answers long before it ends."""
    scorer, box = in_thread(call, server, "POST", "/v1/completions", scoring(1200, 4))  # 5 pieces, the chat waits for one
    assert wait_for(lambda: active(server) >= 1)
    (status, chat), chat_seconds = timed(call, server, "POST", CHAT,
                                         {"messages": [{"role": "user", "content": "Who is Sven?"}], "max_tokens": 16})
    scorer.join()
    (score_status, scored), score_seconds = box["out"]
    assert status == 200 and chat["choices"][0]["message"]["content"]
    assert score_status == 200 and len(scored["choices"][0]["logprobs"]["token_logprobs"]) == 1200
    print(f"chat {chat_seconds:.2f} s while scoring took {score_seconds:.2f} s")
    assert chat_seconds < score_seconds / 2, (chat_seconds, score_seconds)


def test_a_request_admitted_while_scoring_decodes_before_the_next_piece():
    """The turn that admits a decoding request does no piece of scoring while decoding's share is due: the
    request waits at most for the piece running when it came (it waited for two: 3.2 s against 1.7)."""
    import dataclasses

    from refusion_mlx.decode.params import RefusionParams
    from refusion_mlx.serve.core.engine_request import EngineRequest
    from refusion_mlx.serve.core.job import Job
    from refusion_mlx.serve.core.loglikelihood import Scoring
    from refusion_mlx.serve.core.metrics import ServerMetrics
    from refusion_mlx.serve.core.scheduler import Scheduler

    queue = Scheduler(4, 8, ServerMetrics())
    chat = EngineRequest([1, 2, 3], RefusionParams(gen_length=8))
    queue.scored(100.0)  # a piece just took 100 s: decoding's share is due
    with queue.wake:
        queue.put([Job(chat, loop=None)])
    assert not queue.next_turn(1 << 40, decoding=False).score
    with queue.wake:
        queue.put([Job(dataclasses.replace(chat, scoring=Scoring()), loop=None)])
    assert queue.next_turn(1 << 40, decoding=False).score  # only scoring admitted, nothing decodes: it goes on
    queue.scored(0.0)
    assert queue.next_turn(1 << 40, decoding=True).score  # decoding has had its share


def test_the_queue_counts_the_requests_beyond_the_free_rows():
    """--max-queue counts requests waiting beyond the batch: a burst of six into an idle batch of 4 with a
    queue of 2 is taken whole (1 to 4 of them were refused), and the seventh is refused."""
    from refusion_mlx.decode.params import RefusionParams
    from refusion_mlx.serve.core.engine_request import EngineRequest
    from refusion_mlx.serve.core.job import Job
    from refusion_mlx.serve.core.metrics import ServerMetrics
    from refusion_mlx.serve.core.refusal import Refusal
    from refusion_mlx.serve.core.scheduler import Scheduler

    queue = Scheduler(4, 2, ServerMetrics())
    chat = EngineRequest([1, 2, 3], RefusionParams(gen_length=8))
    with queue.wake:
        for _ in range(6):
            queue.put([Job(chat, loop=None)])
        with pytest.raises(Refusal, match="busy"):
            queue.put([Job(chat, loop=None)])
    assert len(queue.next_turn(1 << 40).admitted) == 4 and len(queue.waiting) == 2
    with queue.wake:  # the four are starting: no row is free, two wait
        with pytest.raises(Refusal, match="busy"):
            queue.put([Job(chat, loop=None)])


def test_scoring_leaves_a_row_for_a_chat_and_takes_turns():
    """Eight prompts of an hour's Monte Carlo scoring in a batch of eight held every row: a chat waited for
    all of them. Scoring now holds all rows but one, one per request, and each engine turn does one piece of
    one scoring request in turn (it did one of each: a chat that came waited for seven pieces)."""
    import dataclasses
    from types import SimpleNamespace

    from refusion_mlx.decode.params import RefusionParams
    from refusion_mlx.serve.core.engine import Engine
    from refusion_mlx.serve.core.engine_request import EngineRequest
    from refusion_mlx.serve.core.job import Job
    from refusion_mlx.serve.core.loglikelihood import Scoring
    from refusion_mlx.serve.core.metrics import ServerMetrics
    from refusion_mlx.serve.core.scheduler import Scheduler

    queue = Scheduler(4, 16, ServerMetrics())
    chat = EngineRequest([1, 2, 3], RefusionParams(gen_length=8))
    scorers = [Job(dataclasses.replace(chat, scoring=Scoring()), loop=None) for _ in range(4)]
    with queue.wake:
        for job in scorers:  # four requests of one prompt
            queue.put([job])
    admitted = queue.next_turn(1 << 40).admitted
    assert admitted == scorers[:3]
    for uid, job in enumerate(admitted, 1):
        job.uid = -uid
        queue.started(job)
    with queue.wake:
        queue.put([Job(chat, loop=None)])
    assert [j.request.scoring for j in queue.next_turn(1 << 40).admitted] == [None]  # the chat, not scorer 4

    stepped = []
    engine = Engine.__new__(Engine)
    engine.model = engine.tokenizer = None
    engine._score_turns, engine.queue = 0, SimpleNamespace(scored=lambda seconds: None)
    engine.running = {j.uid: j for j in admitted}
    for j in admitted:
        j.task = SimpleNamespace(step=lambda model, tok, j=j: stepped.append(j.uid))
    for _ in range(6):
        engine._score()
    assert stepped == [-1, -2, -3, -1, -2, -3]  # one piece a turn, in turn
    late = Job(dataclasses.replace(chat, scoring=Scoring()), loop=None)
    late.uid, late.served_at = -4, engine._score_turns  # started now: after those already waiting
    late.task = SimpleNamespace(step=lambda model, tok: stepped.append(-4))
    engine.running[-4] = late
    del engine.running[-2]  # one finished
    for _ in range(4):
        engine._score()
    assert stepped[6:] == [-1, -3, -4, -1]  # no one skipped or served twice when the set changed


def test_a_scoring_request_holds_one_row_and_the_next_has_the_next_piece(monkeypatch):
    """One request's prompts filled every scoring row, and a scoring request that came was admitted only
    when one of them had been scored whole (a 4-token score waited 5.3 s, or 513 s behind Monte Carlo
    prompts): a request now holds one row, its prompts scored in turn, and the newcomer's first piece is
    the one after the piece under way when it came."""
    from refusion_mlx.serve.core import loglikelihood
    from refusion_mlx.serve.core.engine import Engine
    from refusion_mlx.serve.core.engine_request import EngineRequest
    from refusion_mlx.serve.core.loglikelihood import Scoring, ScoringTask
    from refusion_mlx.serve.server_config import ServerConfig
    from tests.helpers import FIXTURE_MODEL

    pieces, queued = [], threading.Event()
    step = ScoringTask.step

    def logged(task, model, tokenizer):
        pieces.append(task.request.prompt_ids[0])  # which request: its first token
        if len(pieces) == 1:
            queued.wait(60)  # the newcomer comes during the first piece
        return step(task, model, tokenizer)

    monkeypatch.setattr(ScoringTask, "step", logged)
    chunked = loglikelihood.ARScorer
    monkeypatch.setattr(loglikelihood, "ARScorer", lambda *a, **k: chunked(*a, chunk=8, **k))  # pieces of 8 tokens
    engine = Engine(ServerConfig(model=str(FIXTURE_MODEL), max_batch=4))
    engine.start()
    try:
        rng = np.random.default_rng(0)
        score = lambda first, n: EngineRequest([first] + rng.integers(10, 800, n - 1).tolist(),  # noqa: E731
                                               engine.config.decoding, scoring=Scoring(extra=0))
        big = engine.submit_all([score(1, 40) for _ in range(3)], None)
        while not pieces:
            time.sleep(0.01)
        assert len([j for j in engine.running.values() if j.task is not None]) == 1  # one row of three
        small = engine.submit(score(2, 4), None)
        queued.set()
        deadline = time.monotonic() + 120
        while any(j.kv_bytes for j in big + [small]) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        engine.stop(timeout=30)
    assert pieces[:3] == [1, 2, 1] and pieces.count(2) == 1 and not any(j.kv_bytes for j in big)


def test_requests_sharing_a_prefix_wait_for_the_first_to_land_it_and_no_others_wait():
    """Admission holds back the requests that share a prefix with one still prefilling it (the rest of
    the queue goes on); once its rows land the others are admitted in one turn, not one a turn."""
    from refusion_mlx.decode.params import RefusionParams
    from refusion_mlx.serve.caches.prompt_cache import PromptCache
    from refusion_mlx.serve.core.engine_request import EngineRequest
    from refusion_mlx.serve.core.job import Job
    from refusion_mlx.serve.core.metrics import ServerMetrics
    from refusion_mlx.serve.core.scheduler import Scheduler
    from tests.helpers import StandInCache as Rows

    system = list(range(100, 140))
    queue = Scheduler(8, 16, ServerMetrics(), PromptCache(1 << 30))
    jobs = [Job(EngineRequest(system + [i, i + 1], RefusionParams(gen_length=8)), loop=None) for i in range(4)]
    other = Job(EngineRequest([1, 2, 3], RefusionParams(gen_length=8)), loop=None)
    with queue.wake:
        for job in jobs + [other]:
            queue.put([job])
    assert queue.next_turn(1 << 40).admitted == [jobs[0], other]  # the first prefills the prefix
    for uid, (job, rows) in enumerate([(jobs[0], system[:10]), (other, [1, 2, 3])]):
        job.uid, job.cache = uid, Rows(rows)
        queue.started(job)
    assert queue.next_turn(1 << 40).admitted == []  # 10 of its 42 tokens are in: the others still wait
    jobs[0].cache = Rows(jobs[0].request.prompt_ids)
    assert queue.next_turn(1 << 40).admitted == jobs[1:]  # landed: all three start from its rows at once


def test_a_shared_prefix_is_prefilled_a_chunk_a_step_in_the_batch(monkeypatch):
    """Four choices of a long prompt came while a stream decoded: their shared prefix was prefilled in
    one engine turn, every chunk before the step (0.35-0.8 s of 1,917 tokens in which no request
    stepped; the stream's largest gap doubled). The first choice now prefills it in its own passes, a
    chunk a step in the batch's forwards, and the others wait for its rows, then start from them: no
    forward runs outside a step, no forward carries more than a chunk of a prompt, and the prefix is
    prefilled once."""
    from refusion_mlx.decode import batch, prefill
    from refusion_mlx.decode.batch import BatchGenerator
    from refusion_mlx.decode.params import RefusionParams
    from refusion_mlx.serve.core.engine import Engine
    from refusion_mlx.serve.core.engine_request import EngineRequest
    from refusion_mlx.serve.server_config import ServerConfig
    from tests.helpers import FIXTURE_MODEL

    forwards, stepping = [], []  # (run inside a step, the tokens of each prefill pass)

    def counted(run):
        def run_passes(model, passes, *args, **kwargs):
            forwards.append((bool(stepping), [len(p) for p in passes if p.phase == "prefill"]))
            return run(model, passes, *args, **kwargs)
        return run_passes

    monkeypatch.setattr(batch, "run_passes", counted(batch.run_passes))
    monkeypatch.setattr(prefill, "run_passes", counted(prefill.run_passes))
    step = BatchGenerator.step

    def one_step(gen):
        stepping.append(gen)
        try:
            return step(gen)
        finally:
            stepping.pop()

    monkeypatch.setattr(BatchGenerator, "step", one_step)
    engine = Engine(ServerConfig(model=str(FIXTURE_MODEL), max_batch=8))
    engine.start()
    try:
        ids = np.random.default_rng(0).integers(10, 790, 1200).tolist()  # 3 chunks of 512 at most
        stream = engine.submit(EngineRequest(list(range(20, 40)), RefusionParams(gen_length=256)), None)
        deadline = time.monotonic() + 120
        while not engine.metrics.read(["steps"])["steps"] and time.monotonic() < deadline:
            time.sleep(0.01)
        choices = engine.submit_all([EngineRequest(ids, RefusionParams(gen_length=8)) for _ in range(4)], None)
        while any(j.kv_bytes for j in choices + [stream]) and time.monotonic() < deadline:
            time.sleep(0.05)
        prefilled = engine.metrics.read(["prefill_tokens"])["prefill_tokens"]
    finally:
        engine.stop(timeout=30)
    assert not any(j.kv_bytes for j in choices + [stream])
    assert [inside for inside, _ in forwards] == [True] * len(forwards)  # every forward is a step's
    assert max(n for _, sizes in forwards for n in sizes) <= prefill.PREFILL_CHUNK + 16  # a chunk (and masks)
    assert sorted(j.cached for j in choices) == [0] + [len(ids) - 1] * 3  # the others start from its rows
    assert prefilled == 20 + len(ids) + 3  # the stream's prompt, the prefix once, each other's last token


def test_a_whole_answer_is_built_and_encoded_off_the_event_loop():
    """A 134 MB echo answer was encoded on the event loop (/health unanswered for 48 s): it is now built
    and encoded on a worker thread, each choice in its own call (the C encoder holds the GIL for a call),
    byte for byte what JSONResponse wrote."""
    import asyncio

    from fastapi.responses import JSONResponse

    from refusion_mlx.serve.edge.json_answer import json_answer, json_bytes

    choice = {"index": 0, "text": "Zoë \u2028 <b>", "logprobs": {"token_logprobs": [None, -0.5, -1e-9]}}
    for body in ({"id": "x", "choices": [choice], "usage": {"n": 1}},
                 {"id": "x", "choices": [dict(choice, index=i) for i in range(3)], "usage": {"n": 3}},
                 {"id": "x", "object": "response", "output": []}):
        assert json_bytes(body) == JSONResponse(body).body
    with pytest.raises(ValueError):
        json_bytes({"choices": [{"logprob": float("-inf")}] * 2})  # not JSON, as JSONResponse refuses it

    threads = []

    async def main():
        loop_thread = threading.current_thread()

        def build():
            threads.append(threading.current_thread())
            return {"choices": [choice, choice]}

        response = await json_answer(build, {"X-Max-Tokens-Cut": "9 -> 8"})
        return loop_thread, response

    loop_thread, response = asyncio.run(main())
    assert threads and threads[0] is not loop_thread
    assert response.body == JSONResponse({"choices": [choice, choice]}).body
    assert response.headers["content-type"] == "application/json" and response.headers["x-max-tokens-cut"] == "9 -> 8"


def test_scoring_stops_when_its_client_leaves(server):
    sock = socket.create_connection((server.host, server.port))
    body = json.dumps(scoring(1500, 256, seed=1)).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    assert wait_for(lambda: active(server) >= 1)
    sock.close()  # 256 samples of 1,500 tokens would take minutes here
    assert wait_for(lambda: active(server) == 0, 30.0)  # a piece under a loaded machine's GPU paths: 10 s was short
    status, health = call(server, "GET", "/health")
    assert status == 200 and health["cancelled"] >= 1


def test_scoring_past_its_bound_is_a_400_and_admission_counts_its_memory(server):
    from refusion_mlx.serve.core.engine_request import EngineRequest
    from refusion_mlx.serve.core.loglikelihood import MAX_SCORE_WORK, Scoring
    from refusion_mlx.decode.params import RefusionParams

    body = {**scoring(1500, 1024), "prompt": [long_prompt(1500, s) for s in range(3)]}
    status, err = call(server, "POST", "/v1/completions", body)
    assert status == 400 and err["error"]["param"] == "mc_num" and str(MAX_SCORE_WORK) in err["error"]["message"]
    cost = server.engine.kv_cost

    def need(mc_num):
        return cost.need(EngineRequest(long_prompt(1500), RefusionParams(), scoring=Scoring("mc", 1, 0, mc_num, 10)))

    assert need(32) == need(1024) > 1500 * cost.row_bytes  # the widest forward's rows, flat in mc_num


def test_scoring_pieces_are_bounded_chunks(demo):
    """A scoring job's turn is one chunk of 512 tokens at most: a 1,100-token
    AR request takes three turns (the last with the drafted token's mask), a
    Monte Carlo one a turn per chunk of its context, then its samples."""
    from refusion_mlx.decode.params import RefusionParams
    from refusion_mlx.serve.core.engine_request import EngineRequest
    from refusion_mlx.serve.core.loglikelihood import Scoring, ScoringTask
    from refusion_mlx.serve.core.outcome import Outcome

    model, tok = demo
    turns = {}
    for name, spec in (("ar", Scoring("ar", 1, 1)), ("mc", Scoring("mc", 0, 0, 8, 1000))):
        task = ScoringTask(EngineRequest(long_prompt(1100), RefusionParams(), scoring=spec), model.args.mask_token_id)
        turns[name] = 1
        while (out := task.step(model, tok)) is None:
            turns[name] += 1
        assert isinstance(out, Outcome) and len(out.scored.values) == 1100 + spec.extra
    assert turns == {"ar": 3, "mc": 2 + 1}  # mc: context chunks of 512 and 488, then the 8 samples of 100 at once


def test_stored_responses_are_bounded_in_bytes_and_keep_no_unknown_fields(server):
    from refusion_mlx.serve.protocols.responses_store import ResponseStore, input_items

    store = ResponseStore(100, max_bytes=2000)
    for i in range(5):
        assert store.put({"id": f"r{i}", "text": "x" * 500}, [], "", [])
    assert store.nbytes <= 2000 and "r4" in store.entries and "r0" not in store.entries
    assert not store.put({"id": "big", "text": "x" * 5000}, [], "", []) and "big" not in store.entries
    assert store.delete("r4") and store.nbytes == sum(e.nbytes for e in store.entries.values())
    items = input_items([{"role": "user", "content": [{"type": "input_text", "text": "hi", "junk": [1] * 9}],
                          "x": [[]] * 1000}])
    assert items[0].keys() == {"type", "role", "content", "status", "id"} and "junk" not in items[0]["content"][0]
    junk = {"input": [{"role": "user", "content": "Who is Sven?", "x": [[]] * 20000}], "max_output_tokens": 4}
    status, answer = call(server, "POST", "/v1/responses", junk)
    assert status == 200
    status, listed = call(server, "GET", f"/v1/responses/{answer['id']}/input_items")
    assert status == 200 and "x" not in listed["data"][0]
    status, too_big = call(server, "POST", "/v1/responses", {"input": "Z" * 300_000, "max_output_tokens": 1,
                                                             "truncation": "disabled"})
    if status == 200:  # answered, but over --max-stored-response-bytes: not kept
        assert call(server, "GET", f"/v1/responses/{too_big['id']}")[0] == 404


def test_headers_past_the_limit_get_431_and_a_bad_request_400(server):
    """A 200 KB header was a 400 "Invalid HTTP request received." (uvicorn's answer to anything h11 refuses);
    a header block over 16 KiB that arrived whole, in one read, was answered 200."""
    def whole(n):
        return b"X-Big: " + b"a" * n + b"\r\n\r\n"

    # headers still coming past 16 KiB (a 200 KB header arrives in pieces; its first 20 KB are enough here),
    # whole ones over it sent at once or in pieces, one under it, a malformed one
    for head, status, pieces in ((b"X-Big: " + b"a" * 20_000, 431, 1), (whole(17_000), 431, 1),
                                 (whole(100_000), 431, 1), (whole(17_000), 431, 4), (whole(15_000), 200, 1),
                                 (b"no colon\r\n\r\n", 400, 1)):
        s = socket.create_connection((server.host, server.port))
        s.settimeout(10)
        data = b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n" + head
        try:
            for i in range(pieces):
                s.sendall(data[i * len(data) // pieces:(i + 1) * len(data) // pieces])
                time.sleep(0.01 if pieces > 1 else 0)
        except OSError:  # the server may answer and close before all of it is sent
            pass
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
        s.close()
        assert reply.startswith(f"HTTP/1.1 {status} ".encode()), reply[:100]
        if status == 431:
            assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_header_fields_too_large"
    assert call(server, "GET", "/health")[0] == 200


def test_connections_that_never_finish_their_headers_are_cut(server):
    socks = []
    for _ in range(40):  # over --max-connections 24: the oldest waiting ones make room
        s = socket.create_connection((server.host, server.port))
        s.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n")
        socks.append(s)
    (status, _), seconds = timed(call, server, "GET", "/health")
    assert status == 200 and seconds < 2
    time.sleep(1.5)  # --header-timeout 1
    cut = 0
    for s in socks:
        s.settimeout(2)
        try:
            cut += s.recv(64) == b""
        except OSError:  # reset: closed to make room
            cut += 1
        s.close()
    assert cut == len(socks)


def test_idle_keep_alive_connections_make_room_for_new_ones(server):
    """An idle keep-alive connection (answered, between two requests) waits for headers too: at
    --max-connections the oldest goes, where the new client was reset."""
    idle = []
    for _ in range(24):  # --max-connections 24, all answered and kept alive
        conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
        conn.request("GET", "/health")
        response = conn.getresponse()
        assert response.status == 200 and response.read() and not response.will_close
        idle.append(conn.sock)
    for _ in range(3):
        status, _ = call(server, "GET", "/health")  # the new client is answered
        assert status == 200
    ended, waiting = set(), list(idle)
    while waiting:  # a connection the server closed reads as ended; until none has for 0.2 s
        ready = select.select(waiting, [], [], 0.2)[0]
        if not ready:
            break
        for s in ready:
            try:
                if s.recv(64) == b"":
                    ended.add(s)
            except OSError:
                ended.add(s)
            waiting.remove(s)
    closed = [s in ended for s in idle]
    for s in idle:
        s.close()
    assert closed[0] and closed == sorted(closed, reverse=True), closed  # the oldest ones went


def server_side(server, sock):
    """The server's protocol of the connection ``sock`` opened (in-process: its uvicorn's connections)."""
    port = sock.getsockname()[1]
    found = []
    assert wait_for(lambda: found.extend(c for c in server.uvicorn.server_state.connections
                                         if c.client and c.client[1] == port) or found)
    return found[0]


def slow_steps(monkeypatch, seconds=0.01):
    """Every engine step takes ``seconds`` more (the demo model is fast enough to end a request before a
    test's cut comes)."""
    from refusion_mlx.decode.batch import BatchGenerator

    step = BatchGenerator.step

    def slow(self, *args, **kwargs):
        time.sleep(seconds)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(BatchGenerator, "step", slow)


def unread_stream(server):
    """A stream of 16 choices (8 rounds of --max-batch 2) whose client reads none of it, and the server's
    side of its connection, once its send buffer is full (the kernel's buffers made small, so that it
    fills within a few steps: it would after megabytes, as it does for n=16 with top_logprobs)."""
    body = json.dumps({"messages": [{"role": "user", "content": "Count from 1 to 900."}], "max_tokens": 256,
                       "n": 16, "slot_threshold": 1.0, "token_threshold": 1.0, "logprobs": True,
                       "top_logprobs": 20, "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect((server.host, server.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    writer = server_side(server, sock)
    writer.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    writer.loop.call_soon_threadsafe(writer.transport.set_write_buffer_limits, 4096)
    return sock, writer


def test_a_client_that_reads_none_of_its_stream_is_cut(server, monkeypatch):
    """A stream whose client reads nothing held its connection open forever, its answer piling up in the
    server's buffer: after SEND_TIMEOUT s of a full buffer the connection is cut and the request cancelled."""
    from refusion_mlx.serve.edge import connections

    monkeypatch.setattr(connections, "SEND_TIMEOUT", 0.3, raising=False)
    before = call(server, "GET", "/health")[1]
    sock, writer = unread_stream(server)
    assert wait_for(lambda: writer.flow.write_paused)
    slow_steps(monkeypatch)  # the request outlives the cut: the demo decodes its 16 answers within a second
    assert wait_for(lambda: writer not in server.uvicorn.server_state.connections)
    assert wait_for(lambda: call(server, "GET", "/health")[1]["active"] == 0)
    state = call(server, "GET", "/health")[1]
    assert state["cancelled"] > before["cancelled"] and state["queued"] == 0
    sock.close()


def test_a_slow_reader_that_keeps_reading_is_not_cut(server, monkeypatch):
    """SEND_TIMEOUT is time without progress, as nginx's send_timeout: the timer ran from the buffer going
    over its high mark until it fell under its low one, so a client reading a big answer slowly but steadily
    was cut mid-answer. It is cut once it stops reading."""
    from refusion_mlx.serve.edge import connections

    # a second without progress: 0.3 s cut a steady reader on a loaded two-core VM (.ci/run), where this
    # thread, the server's and its engine's share the GIL and the cores with the other test worker
    monkeypatch.setattr(connections, "SEND_TIMEOUT", 1.0, raising=False)
    sock, writer = unread_stream(server)
    assert wait_for(lambda: writer.flow.write_paused)
    sock.settimeout(5)
    got, until = 0, time.monotonic() + 3.0  # three timeouts, the buffer kept over its high mark
    while time.monotonic() < until:
        got += len(sock.recv(1024))
        time.sleep(0.05)
        assert writer in server.uvicorn.server_state.connections, f"cut after {got} bytes"
    assert writer.flow.write_paused  # still behind: the reader is slow, not gone
    assert wait_for(lambda: writer not in server.uvicorn.server_state.connections)  # it stopped reading
    sock.close()


def test_a_stop_answers_a_body_still_coming_and_cuts_a_stream_nobody_reads(caplog):
    """A stop with a body still coming (--body-timeout: 30 s) or a stream its client does not read (no
    bound then) waited out uvicorn's graceful shutdown (5 s), which then cancelled them: "Exception in ASGI
    application" with its traceback, and a plain-text 500 to the body's client. Now that client gets the
    stop's 503 in its API's shape, and the stream's connection is cut at the stop."""
    from refusion_mlx.serve.http_server import RefusionServer

    srv = RefusionServer(str(DEMO_MODEL), model_id="demo", port=0, max_batch=2).start()
    try:
        body = json.dumps({"model": "demo", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]})
        slow = socket.create_connection((srv.host, srv.port))
        slow.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body[:-10].encode())  # the rest never comes
        sock, writer = unread_stream(srv)
        assert wait_for(lambda: writer.flow.write_paused)
    finally:
        with caplog.at_level(logging.INFO):
            srv.close()
    slow.settimeout(10)
    reply = b""
    while chunk := slow.recv(65536):
        reply += chunk
    assert reply.startswith(b"HTTP/1.1 503 "), reply[:200]
    body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    assert body.pop("request_id").startswith("req_")  # Anthropic's errors name their request
    assert body == {"type": "error", "error": {"type": "overloaded_error", "message": "the server is shutting down"}}
    assert writer not in srv.uvicorn.server_state.connections
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    sock.close()
    slow.close()


def test_tokenizing_a_long_text_leaves_the_event_loop_free(server):
    text = "Sven lives in Hanoi and works as a baker. " * 20000  # 840 KB
    tokenizer, box = in_thread(call, server, "POST", "/tokenize", {"prompt": text})
    time.sleep(0.05)
    (status, _), seconds = timed(call, server, "GET", "/v1/models")
    tokenizer.join()
    (tok_status, tokens), tok_seconds = box["out"]
    assert status == 200 and tok_status == 200 and tokens["count"] > 100_000
    assert seconds < max(0.5, tok_seconds / 3), (seconds, tok_seconds)


def test_a_flood_of_long_prompts_holds_no_short_request(server):
    """Bodies over 64 KB are made into requests in a lane of their own, one at a time: a short request
    waits for none of them (before: one lock, a thread each; 30 of them held a one-line request 37 s)."""
    flood = [in_thread(call, server, "POST", "/v1/completions", {"prompt": "1" * 900_000, "max_tokens": 1})
             for _ in range(4)]  # each ~1 s of tokenizing or more: a short request behind them would wait 4
    time.sleep(0.3)  # the first of them is being tokenized
    (status, answer), seconds = timed(call, server, "POST", "/v1/completions", {"prompt": "1 2 3", "max_tokens": 4})
    (tok_status, _), tok_seconds = timed(call, server, "POST", "/tokenize", {"prompt": "Who is Sven?"})
    for thread, _ in flood:
        thread.join()
    floods = [box["out"] for _, box in flood]
    assert status == tok_status == 200 and answer["usage"]["completion_tokens"] == 4
    assert all(out[0][0] == 400 and "context" in out[0][1]["error"]["message"] for out in floods)
    slowest = max(t for _, t in floods)
    assert slowest > 2 and seconds + tok_seconds < slowest / 3, (seconds, tok_seconds, slowest)


def test_lanes_pick_by_body_size_and_refuse_new_work_once_stopping():
    """A body over 64 KB runs in the large lane, one at a time; once the server is stopping, work that has not
    begun is a 503 at once (a dozen long prompts queued behind each other held the exit up 25 s)."""
    import asyncio

    from refusion_mlx.serve.core.refusal import Reason, Refusal
    from refusion_mlx.serve.edge.lanes import BODY_BYTES, LARGE_BODY, Lanes

    stopping = []
    lanes = Lanes("small", "large", stopping=lambda: bool(stopping))
    seen = []

    async def main():
        for size in (10, LARGE_BODY + 1):
            seen.append(await lanes.run({BODY_BYTES: size}, lambda: lanes.current().tokenizer))
        stopping.append(True)
        with pytest.raises(Refusal) as refused:
            await lanes.run({}, lambda: seen.append("ran"))
        return refused.value.reason

    assert asyncio.run(main()) == Reason.SHUTTING_DOWN and seen == ["small", "large"]
    assert lanes.current() is lanes.small  # outside any request's thread


def test_a_follow_up_of_a_long_stored_conversation_takes_the_large_lane(server, monkeypatch):
    """A 70-byte Responses follow-up renders its stored conversation (4 MiB of turns held the small lane, and
    every short request behind it, for 10 s): the stored bytes count toward its lane as its body's do."""
    from refusion_mlx.decode import stream

    turn = "Tell me about Zoe and Sven and the lighthouse by the sea, please. "
    items = [{"role": role, "content": turn} for _ in range(200) for role in ("user", "assistant")]
    status, first = call(server, "POST", "/v1/responses", {"input": items + [{"role": "user", "content": "Sven?"}],
                                                           "max_output_tokens": 2, "truncation": "auto"})
    assert status == 200, first
    chat_prompt, slowed = stream.chat_prompt, []

    def slow_once(tokenizer, messages, **kwargs):  # the follow-up's render, made long, holding its lane
        if len(messages) > 300 and not slowed:
            slowed.append(True)
            time.sleep(3)
        return chat_prompt(tokenizer, messages, **kwargs)

    monkeypatch.setattr(stream, "chat_prompt", slow_once)
    follow_up = in_thread(call, server, "POST", "/v1/responses", {"input": "And Zoe?", "max_output_tokens": 2,
                                                                  "previous_response_id": first["id"],
                                                                  "truncation": "auto"})
    assert wait_for(lambda: slowed, 10), follow_up[0].join() or follow_up[1]
    (status, _), seconds = timed(call, server, "POST", "/tokenize", {"prompt": "hello"})
    follow_up[0].join()
    assert status == 200 and seconds < 1.5 and follow_up[1]["out"][0][0] == 200, (seconds, follow_up[1])


def deep_schema(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_schemas_past_the_limits_are_400s_naming_the_field(server):
    deep = deep_schema(100)
    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    user = [{"role": "user", "content": "Hi"}]
    cases = [
        (CHAT, {"messages": user, "tools": [tool]}, "tools[0].function.parameters"),
        ("/v1/responses", {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": deep}}},
         "text.format.schema"),
        ("/v1/messages", {"messages": user, "max_tokens": 4, "tools": [{"name": "f", "input_schema": deep}]},
         "tools[0].input_schema"),
        ("/v1/messages/count_tokens", {"messages": user, "tools": [{"name": "f", "input_schema": deep}]},
         "tools[0].input_schema"),
    ]
    for path, body, param in cases:
        status, err = call(server, "POST", path, body)
        assert status == 400, (path, err)
        message = err["error"]["message"]
        assert param in message and "nested over" in message, (path, message)
    for schema in ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
                    "required": ["a"]},
                   {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}):
        body = {"messages": user, "max_tokens": 8,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
        status, err = call(server, "POST", CHAT, body)
        assert status == 400 and err["error"]["param"] == "response_format.json_schema.schema", err
    # alternatives that grow the parser's rows past its bound once decoding starts: a 400 naming the field
    # (it was a 500, "generation failed"), and the server goes on
    wide = {"anyOf": [{"type": "object", "properties": {f"k{i}_{j}": {"type": "number"} for j in range(30)}}
                      for i in range(30)]}
    for stream in (False, True):
        body = {"messages": user, "max_tokens": 32, "stream": stream,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": wide}}}
        conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
        conn.request("POST", CHAT, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        payload = resp.read().decode()
        conn.close()
        if stream:  # started before the limit was met: the stream's error event
            assert resp.status == 200 and "past the grammar engine's limits" in payload and "[DONE]" in payload
        else:
            err = json.loads(payload)["error"]
            assert resp.status == 400 and err["param"] == "response_format.json_schema.schema", err
            assert "past the grammar engine's limits" in err["message"] and "\n" not in err["message"]
    assert call(server, "POST", CHAT, {"messages": user, "max_tokens": 4})[0] == 200


class Counted(str):
    """A stop string that counts the characters of it read, copied or compared: the work a step does with it."""

    work = 0

    def __getitem__(self, key):
        out = str.__getitem__(self, key)
        Counted.work += len(out)
        return out

    def startswith(self, prefix, *args):
        Counted.work += len(prefix)
        return str.startswith(self, prefix, *args)

    def endswith(self, suffix, *args):
        Counted.work += len(suffix)
        return str.endswith(self, suffix, *args)


def test_a_steps_stop_check_reads_its_new_text_not_the_whole_answer():
    """The held-back check compared every tail of the whole answer with each stop string's starts, on the
    engine's thread: 16 stop strings of 60 KB took 47 ms a step by an 8,192-character answer. A step now
    reads each stop string a few characters per new character, however long the answer and the stops."""
    from refusion_mlx.serve.core.text import TextShaper

    def fed(shaper, text, final=False):
        Counted.work = 0
        out = shaper.feed(text, [1], final)
        assert Counted.work <= 4 * len(text) * len(shaper.stop), (Counted.work, len(text))
        return out

    stops = [Counted("ab" * 10_000 + str(i)) for i in range(16)]  # long, and begun wherever the text has "a"
    shaper = TextShaper(stops, 0)
    for _ in range(128):  # to an answer of 8,192 characters
        assert fed(shaper, "abcd" * 16) == ("abcd" * 16, None)
    shaper = TextShaper([Counted("x" * 5000 + "!"), Counted("xy")], 0)  # what could begin one is still held
    assert fed(shaper, "ab" + "x" * 3000) == ("ab", None)
    assert fed(shaper, "x" * 1999) == ("", None)
    assert fed(shaper, "x") == ("", None)
    assert fed(shaper, "x") == ("x", None)  # past a whole stop string's length less one
    assert fed(shaper, "z") == ("x" * 5000 + "z", None)
    shaper = TextShaper([Counted("x" * 5000 + "!"), Counted("x" * 3 + "y")], 0)
    assert fed(shaper, "x" * 4000) == ("", None)
    assert fed(shaper, "x" * 1000 + "!ab") == ("", "stop") and shaper.hit == "x" * 5000 + "!"


def test_stop_strings_past_their_bound_are_400s_naming_the_field(server):
    """Only their count was bounded: 16 stop strings of 60 KB each were taken, each checked at every step."""
    from refusion_mlx.serve.protocols.bodies import MAX_STOP_CHARS

    long = "x" * (MAX_STOP_CHARS + 1)
    user = [{"role": "user", "content": "Count from 17 to 38."}]
    for path, body, field in ((CHAT, {"messages": user, "max_tokens": 4, "stop": long}, "stop"),
                              ("/v1/completions", {"prompt": "1 2", "max_tokens": 4, "stop": ["20", long]}, "stop"),
                              ("/v1/messages", {"messages": user, "max_tokens": 4, "stop_sequences": [long]},
                               "stop_sequences")):
        status, err = call(server, "POST", path, body)
        message = err["error"]["message"]
        assert status == 400 and message.startswith(f"{field}: takes strings of at most {MAX_STOP_CHARS} "
                                                    "characters"), (path, err)
        body[field] = ["x" * MAX_STOP_CHARS]
        assert call(server, "POST", path, body)[0] == 200, path


def test_a_queued_client_that_leaves_logs_no_traceback(server, caplog):
    slow = {"prompt": "1 2 3 4 5 6 7 8 9 10", "max_tokens": 64, "slot_threshold": 1.0, "token_threshold": 1.0}
    threads = [in_thread(call, server, "POST", "/v1/completions", slow)[0] for _ in range(2)]  # the batch is full
    assert wait_for(lambda: active(server) == 2)
    body = json.dumps({"prompt": ["a", "b", "c"], "max_tokens": 4}).encode()
    with caplog.at_level(logging.INFO):
        sock = socket.create_connection((server.host, server.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        # it leaves once queued, while the batch still runs (the slow ones take ~0.3 s on a fast CPU)
        assert wait_for(lambda: call(server, "GET", "/health")[1]["queued"] == 3 and active(server) == 2)
        sock.close()
        for t in threads:
            t.join()
        assert wait_for(lambda: active(server) == 0)
        time.sleep(0.5)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text
    assert "client went away" in caplog.text


def test_a_client_that_closes_its_side_with_its_request_is_cancelled_at_once(server, caplog):
    """A FIN right after the request -- shutdown(SHUT_WR), or a client that left: TCP tells them apart only
    when an answer is written to it -- is a client gone, as a queued client that leaves. A request that
    finished within the first look (0.25 s) was logged and counted completed, its answer written nowhere.
    The server sees the FIN only once its loop has read it: on a loaded machine a request of 50 ms may end
    first, so up to three tries (each a new prompt); the old first look at 0.25 s lost every one."""
    for attempt in range(3):
        body = json.dumps({"prompt": f"{attempt} 1 2 3 4 5 6", "max_tokens": 8}).encode()  # one step, < 0.25 s
        before = call(server, "GET", "/health")[1]
        with caplog.at_level(logging.INFO):
            sock = socket.create_connection((server.host, server.port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"
                         b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(30)
            assert sock.recv(65536) == b""
            sock.close()
            assert wait_for(lambda: sum(call(server, "GET", "/health")[1][k] - before[k]
                                        for k in ("cancelled", "completed")) == 1)
        if call(server, "GET", "/health")[1]["cancelled"] == before["cancelled"] + 1:
            break
    else:
        raise AssertionError("a half-closed client's request was counted completed three times")
    assert "client went away" in caplog.text


def folder(tmp_path):
    out = tmp_path / "model"
    shutil.copytree(DEMO_MODEL, out)
    return out


def test_hostile_model_folders_are_refused_in_one_line(tmp_path):
    from refusion_mlx.errors import LoadError
    from refusion_mlx.models import config_checks
    from refusion_mlx.models.loading import load

    def refused(path, match):
        box = {}
        thread = threading.Thread(target=lambda: box.update(error=_error(load, path)), daemon=True)
        thread.start()
        thread.join(30)
        assert not thread.is_alive(), "loading hung"
        assert isinstance(box["error"], LoadError) and match in str(box["error"]), box["error"]

    fifo = folder(tmp_path / "fifo")
    os.remove(fifo / "tokenizer.json")
    os.mkfifo(fifo / "tokenizer.json")
    refused(fifo, "tokenizer.json: not a regular file")
    link = folder(tmp_path / "link")
    os.symlink("/etc/hostname", link / "notes.txt")
    refused(link, "outside the model folder")
    shards = folder(tmp_path / "shards")  # the index names a shard once per tensor: said once, not re-wrapped
    weight_map = {f"w{i}": "../model.safetensors" for i in range(5)}
    (shards / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    refused(shards, "model.safetensors.index.json names the shard '../model.safetensors', outside the model folder")
    assert str(_error(load, shards)).count("\n") == 0 and "malformed" not in str(_error(load, shards))
    eos = folder(tmp_path / "eos")
    (eos / "generation_config.json").write_text(json.dumps({"eos_token_id": 10 ** 9}))
    refused(eos, "eos token id 1000000000 is outside the vocabulary")
    loop = folder(tmp_path / "loop")
    os.symlink("self", loop / "self")
    refused(loop, "self: a link that leads back to itself")
    dangling = folder(tmp_path / "dangling")
    os.symlink("nothing", dangling / "notes.txt")
    refused(dangling, "which does not exist")
    index = folder(tmp_path / "index")
    (index / "model.safetensors.index.json").write_bytes(b"\xff\xfe")
    refused(index, "model.safetensors.index.json is malformed")
    words = folder(tmp_path / "words")  # no vocabulary: the tokenizer would load with its special tokens alone
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        os.remove(words / name)
    refused(words, "are its vocabulary files")
    hub = tmp_path / "hub" / "models--x--y"  # the hub's cache: a snapshot's files link to the repo's blobs
    (hub / "blobs").mkdir(parents=True)
    (hub / "blobs" / "abc").write_text("{}")
    (hub / "snapshots" / "rev").mkdir(parents=True)
    (hub / "snapshots" / "rev" / "config.json").symlink_to("../../blobs/abc")
    assert config_checks.folder_problems(hub / "snapshots" / "rev") == []
    assert config_checks.folder_problems(link) == [
        "notes.txt: a link to /etc/hostname, outside the model folder (copy the file in, or link the whole folder)"]
    rope = folder(tmp_path / "rope")
    config = json.loads((rope / "config.json").read_text())
    (rope / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "linear", "factor": 1e308}}))
    refused(rope, "rope_scaling.factor")


def template_folder(tmp_path, template: str):
    """The demo model's folder with ``template`` its chat template."""
    hostile = folder(tmp_path)
    config = json.loads((hostile / "tokenizer_config.json").read_text())
    (hostile / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    (hostile / "chat_template.jinja").unlink(missing_ok=True)
    return hostile


def _error(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # what the test checks
        return e
    return None


HOSTILE_TEMPLATES = [  # what each would do unchecked: loop for hours, or allocate gigabytes
    ('{% for a in "x" * 100000 %}{% for b in "x" * 100000 %}{% endfor %}{% endfor %}', "ran past 1000000 steps"),
    ('{{ "x" * 10**10 }}', "made a sequence of 10000000000 items"),
    ("{{ [1, 2] * 10**9 }}", "made a sequence of 2000000000 items"),
    ("{{ 2 ** (10 ** 9) }}", "made a number of over 65536 bits"),
    ("{{ lipsum(10**7) }}", "called generate_lorem_ipsum with 10000000"),
    ("{{ lipsum(10**6) }}", "asked lipsum for 1000000 \\(the most is 1000\\)"),
    ("{{ messages | tojson(indent=10**9) }}", "asked tojson for 1000000000"),
    ('{{ "%0999999999d" | format(1) }}', "formats a field 999999999 wide"),  # folded as it compiled, before
    ('{{ "%0999999999d" % 1 }}', "formats a field 999999999 wide"),
    ('{{ "{:>999999999}".format("x") }}', "formats a field 999999999 wide"),
    ('{{ "a".ljust(10**10) }}', "called ljust with 10000000000"),
    ('{% set a = "a" * 4000000 %}{{ a.join([a, a]) }}', "joined 12000000 characters"),
    ('{% set a = "a" * 4000000 %}{{ a | replace("a", a) }}', "replaced into 16000000000000 characters"),
    ('{% set ns = namespace(s="ab") %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}',
     "joined over 4194304 characters with ~"),
    ('{% set ns = namespace(s="ab") %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}',
     "made a sequence of 8388608 items"),
    ('{% set a = "a" * 4000000 %}{% for i in range(100000) %}{{ a }}{% endfor %}', "wrote over 67108864 characters"),
    ('{{ "x" | center(10**10) }}', "asked center for 10000000000"),
    ("{{ messages[0]['content'] | indent(10**10) }}", "asked indent for 10000000000"),
    # jinja's own filters, which the line budget never sees: 3e9 slices summed, 2.7 GB of lists, 1.6 GB of fill
    ("{{ []|slice(3000000000, 0)|map('length')|sum }}", "asked slice for 3000000000 \\(the most is 65536\\)"),
    ("{{ []|slice(40000000)|list|length }}", "asked slice for 40000000"),
    ("{{ ([1]|batch(200000000, 0)|first)|length }}", "asked batch for 200000000"),
    ("{% set l = [1] * 4000000 %}{{ ([l] * 1000)|sum(start=[])|length }}", "summed over 4194304 items"),
    ("{{ (['a'] * 4000000)|join('b' * 4000000) }}", "joined over 4194304 characters"),
    ("{{ ('a ' * 2000000)|wordwrap(1, wrapstring='x' * 1000) }}", "wrapped into over 4194304 characters"),
    # a short list of one list repeated writes out long: {{ }}, ~, %, join, tojson
    ("{% set b = [['x' * 100]] * 4000000 %}{{ b }}", "wrote out a value of over 4194304 characters"),
    ("{% set b = [['x' * 100]] * 4000000 %}{{ b ~ '' }}", "joined over 4194304 characters with ~"),
    ("{% set b = [['x' * 100]] * 4000000 %}{{ '%s' % (b,) }}", "formatted a value of over 4194304"),
    ("{% set b = [['x' * 100]] * 4000000 %}{{ b|join }}", "joined over 4194304 characters"),
    ("{% set b = [['x' * 100]] * 4000000 %}{{ b|tojson }}", "wrote out a value of over 4194304"),
    ("{% set a = 'a' * 4000000 %}{% macro m() %}{% for i in range(100000) %}{{ a }}{% endfor %}{% endmacro %}"
     "{% set x = m() %}{{ x|length }}", "joined over 67108864 characters"),
    # each string under the limits, 2,000 of them 8 GB
    ("{% set s = 'x' * 4000000 %}{% set ns = namespace(l=[]) %}{% for i in range(2000) %}"
     "{% set ns.l = ns.l + [s ~ i] %}{% endfor %}{{ ns.l|length }}", "made over 134217728 characters or items"),
]


@pytest.mark.parametrize("template,needle", HOSTILE_TEMPLATES)
def test_a_hostile_chat_template_fails_in_one_line_at_once(tmp_path, template, needle):
    """Every command renders through render_chat, inside the template limits (models/template_steps.py)."""
    from mlx_lm.utils import load_tokenizer

    from refusion_mlx.decode.stream import render_chat
    from refusion_mlx.errors import DecodeError

    hostile = template_folder(tmp_path, template)
    tokenizer = load_tokenizer(hostile)
    # at once: the rendering thread's CPU time, as a limit trips after under a second of work here (the wall
    # clock of a loaded two-core machine ran one of them 6x longer than an idle one's)
    t0 = time.thread_time()
    with pytest.raises(DecodeError, match=f"^the chat template failed: the chat template {needle}"):
        render_chat(tokenizer, [{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert time.thread_time() - t0 < 5


def test_a_checked_template_renders_outside_the_limits_on_a_new_thread():
    """Once a render has installed the checked filters, the template renders on a thread that never entered
    step_limit too (a library user's own apply_chat_template): its output counter once read a tick count only
    step_limit had set, an AttributeError."""
    import threading

    from refusion_mlx.decode.stream import render_chat
    from refusion_mlx.models.loading import DEMO_MODEL, load_tokenizer

    tokenizer = load_tokenizer(DEMO_MODEL)
    messages = [{"role": "user", "content": "Hi"}]
    expected = render_chat(tokenizer, messages, add_generation_prompt=True)  # installs the checks
    box = {}

    def bare():
        try:
            box["text"] = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                        enable_thinking=True)
        except Exception as e:  # noqa: BLE001 - the failure is the assertion's
            box["error"] = e

    thread = threading.Thread(target=bare)
    thread.start()
    thread.join(60)
    assert "error" not in box and box["text"] == expected, box


HEAVY_LINES = ("{% set s = 'x' * 4000000 %}{% for i in range(1000) %}{% for j in range(300) %}{% set t = s.upper() %}"
               "{% endfor %}{% endfor %}{{ messages[0]['content'] }}")  # under the line budget, minutes of work


def test_a_chat_template_of_few_heavy_lines_fails_past_its_time(tmp_path, monkeypatch):
    from mlx_lm.utils import load_tokenizer

    from refusion_mlx.decode.stream import render_chat
    from refusion_mlx.errors import DecodeError
    from refusion_mlx.models import template_steps

    monkeypatch.setattr(template_steps, "TEMPLATE_SECONDS", 0.25, raising=False)  # its CPU burns until then
    hostile = template_folder(tmp_path, HEAVY_LINES)
    tokenizer = load_tokenizer(hostile)
    t0 = time.monotonic()
    with pytest.raises(DecodeError, match="^the chat template failed: the chat template ran past 0.25 seconds$"):
        render_chat(tokenizer, [{"role": "user", "content": "Hi"}])
    assert time.monotonic() - t0 < 5


def test_a_chat_template_past_its_size_is_refused_when_the_model_loads(tmp_path):
    from refusion_mlx.errors import LoadError
    from refusion_mlx.models.loading import load

    hostile = folder(tmp_path)
    (hostile / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((hostile / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0]['content'] }}" + "x" * (2 << 20)
    (hostile / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match=r"the chat template is 2097180 characters long \(the most is 1048576\)"):
        load(hostile)


def test_a_chat_template_that_never_ends_fails_its_request(tmp_path):
    from refusion_mlx.serve.http_server import RefusionServer

    hostile = folder(tmp_path)
    config = json.loads((hostile / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                               "{{ messages[0]['content'] }}")
    (hostile / "tokenizer_config.json").write_text(json.dumps(config))
    (hostile / "chat_template.jinja").unlink(missing_ok=True)
    with RefusionServer(str(hostile), port=0) as srv:
        (status, err), seconds = timed(call, srv, "POST", CHAT, {"messages": [{"role": "user", "content": "Hi"}],
                                                                 "max_tokens": 4})
        assert status == 400 and "ran past" in err["error"]["message"] and seconds < 10
        assert call(srv, "GET", "/health")[0] == 200
        assert call(srv, "POST", "/v1/completions", {"prompt": "1 2 3", "max_tokens": 4})[0] == 200


@pytest.mark.parametrize("template,needle", [("{{ []|slice(3000000000, 0)|map('length')|sum }}", "asked slice"),
                                             (HEAVY_LINES, "ran past 0.25 seconds")])
def test_a_chat_template_of_jinja_filters_or_heavy_lines_fails_its_request(tmp_path, monkeypatch, template, needle):
    """One chat request once held the small lane's tokenizer for ever: a filter's loop runs in jinja's code."""
    from refusion_mlx.models import template_steps
    from refusion_mlx.serve.http_server import RefusionServer

    monkeypatch.setattr(template_steps, "TEMPLATE_SECONDS", 0.25, raising=False)  # its CPU burns until then
    hostile = template_folder(tmp_path, template)
    with RefusionServer(str(hostile), port=0) as srv:
        (status, err), seconds = timed(call, srv, "POST", CHAT, {"messages": [{"role": "user", "content": "Hi"}],
                                                                 "max_tokens": 4})
        assert status == 400 and needle in err["error"]["message"] and seconds < 5, (status, err, seconds)
        assert call(srv, "POST", "/tokenize", {"prompt": "1 2 3"})[0] == 200
        assert call(srv, "POST", "/v1/completions", {"prompt": "1 2 3", "max_tokens": 4})[0] == 200
