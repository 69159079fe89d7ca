"""The server as operators run it: /metrics, memory-aware admission, a failing
step, the /health watchdog, the prompt cache on disk, and a short soak.

Each test starts its own in-process server on the fixture model (a fraction
of a second) with the settings it needs.
"""

from __future__ import annotations

import gc
import http.client
import json
import logging
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from refusion_mlx.serve.http_server import RefusionServer
from refusion_mlx.serve.core.metrics import parse
from tests.helpers import FIXTURE_MODEL

CHAT = "/v1/chat/completions"
GROWTH_BYTES = 256 * 4096  # the fixture's KV bytes in one growth of 256 rows (4 KiB a token)
SLOW = {"prompt": "1 2 3 4 5 6 7 8 9 10", "slot_threshold": 1.0, "token_threshold": 1.0}  # one token a step


def serve(**kw) -> RefusionServer:
    kw.setdefault("dtype", "float32")  # GROWTH_BYTES' arithmetic whichever paths run (the GPU paths default to bf16)
    return RefusionServer(str(FIXTURE_MODEL), model_id="tiny-refusion", port=0, **kw)  # started by `with`


def call(srv, method, path, body=None):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, (payload.decode() if path == "/metrics" else json.loads(payload))


def ask(srv, content="Who is Sven?", **fields):
    return call(srv, "POST", CHAT, {"messages": [{"role": "user", "content": content}], "max_tokens": 32, **fields})


LABELS = r'refusion_[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})?'  # a name, and labels if any


def metrics(srv) -> dict:
    status, text = call(srv, "GET", "/metrics")
    assert status == 200
    for line in text.splitlines():  # every sample line is `name{labels} value`, every name refusion_
        assert line.startswith("# ") or re.fullmatch(LABELS + r' [0-9.e+-]+|refusion_[a-z_]+_bucket\{le="[^"]+"\} \d+',
                                                     line), line
    return parse(text)


def wait_idle(srv, seconds=20.0) -> dict:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        _, state = call(srv, "GET", "/health")
        if state["active"] == 0 and state["queued"] == 0:
            return state
        time.sleep(0.05)
    raise AssertionError(f"still busy: {state}")


def test_metrics_move_with_the_load():
    with serve() as srv:
        before = metrics(srv)
        bodies = [{"messages": [{"role": "user", "content": p}], "max_tokens": 48, "stream": s}
                  for p in ("Who is Sven?", "Count from 17 to 38.", "Tell me about Zoe.") for s in (False, True)]
        during = []
        with ThreadPoolExecutor(8) as pool:
            slow = pool.submit(call, srv, "POST", "/v1/completions", {**SLOW, "max_tokens": 48})
            while not during or (during[-1]["refusion_requests_active"] == 0 and not slow.done()):
                during.append(metrics(srv))  # scraped under load (the slow request runs 48 steps)
            results = list(pool.map(lambda b: call(srv, "POST", CHAT, b), [b for b in bodies if not b["stream"]]))
            streams = list(pool.map(lambda b: stream_usage(srv, b), [b for b in bodies if b["stream"]]))
            bad = [call(srv, "POST", CHAT, b"{nope")[0], ask(srv, max_tokens=-1)[0]]
            results.append(slow.result())
        wait_idle(srv)
        after = metrics(srv)
        conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)  # a scraper that asks for OpenMetrics
        conn.request("GET", "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        resp = conn.getresponse()
        open_metrics, open_type = resp.read().decode(), resp.getheader("Content-Type")
        conn.close()
    assert open_type.startswith("application/openmetrics-text") and open_metrics.endswith("# EOF\n")
    assert "# TYPE refusion_requests counter" in open_metrics and "# TYPE refusion_requests_total" not in open_metrics
    usages = [r[1]["usage"] for r in results] + streams
    assert all(r[0] == 200 for r in results) and bad == [400, 400]
    d = {k: after[k] - before.get(k, 0) for k in after}
    assert d['refusion_requests_total{outcome="completed"}'] == 7
    assert d['refusion_requests_total{outcome="failed"}'] == 0
    assert d['refusion_http_errors_total{status="400"}'] == 2
    assert d["refusion_generated_tokens_total"] == sum(u["completion_tokens"] for u in usages)
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert d["refusion_cached_prompt_tokens_total"] == cached
    assert d["refusion_prefilled_tokens_total"] + cached == prompt
    steps = d["refusion_steps_total"]
    assert steps > 0 and d["refusion_step_seconds_count"] == steps == d["refusion_tokens_per_forward_count"]
    assert d["refusion_tokens_per_forward_sum"] >= d["refusion_generated_tokens_total"]
    assert d['refusion_step_seconds_bucket{le="+Inf"}'] == steps
    buckets = [v for k, v in after.items() if k.startswith("refusion_step_seconds_bucket")]
    assert buckets == sorted(buckets)  # cumulative
    assert max(m["refusion_requests_active"] for m in during) >= 1
    assert after["refusion_requests_active"] == after["refusion_requests_queued"] == 0
    assert after["refusion_prompt_cache_entries"] >= 1 and after["refusion_prompt_cache_bytes"] > 0
    assert after["refusion_memory_active_bytes"] > 0 and after["refusion_engine_up"] == 1


def stream_usage(srv, body) -> dict:
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    conn.request("POST", CHAT, json.dumps({**body, "stream_options": {"include_usage": True}}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    usage = None
    for raw in resp:
        if raw.startswith(b"data: {"):
            usage = json.loads(raw[6:]).get("usage") or usage
    conn.close()
    return usage


def five_slow_watched(srv):
    """Five slow completions sent at once, and /health as read every 10 ms meanwhile."""
    seen, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            seen.append(call(srv, "GET", "/health")[1])
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(5) as pool:
            out = list(pool.map(lambda _: call(srv, "POST", "/v1/completions", {**SLOW, "max_tokens": 24}),
                                range(5)))
    finally:
        stop.set()
        watcher.join()
    return out, seen


def test_admission_waits_for_kv_memory_and_refuses_what_never_fits():
    """Two 256-row reservations fit in 2 MiB: of five slow requests, two run at a time and the
    others wait; a prompt that leaves no slot in the whole budget is refused at once, naming the numbers."""
    with serve(max_kv_bytes=2 * GROWTH_BYTES) as srv:
        _, alone = call(srv, "POST", "/v1/completions", {**SLOW, "max_tokens": 24})
        out, seen = five_slow_watched(srv)
        t0 = time.monotonic()
        status, err = call(srv, "POST", "/v1/completions", {"prompt": " ".join(["7"] * 600), "max_tokens": 8})
        refused_in = time.monotonic() - t0
        state = wait_idle(srv)
    assert [s for s, _ in out] == [200] * 5
    assert all(r["choices"][0]["text"] == alone["choices"][0]["text"] for _, r in out)
    assert max(h["active"] for h in seen) == 2 and max(h["queued"] for h in seen) >= 1
    assert all(h["kv"]["reserved_bytes"] <= h["kv"]["max_bytes"] == 2 * GROWTH_BYTES for h in seen)
    assert state["kv_waits"] >= 1 and state["kv"]["reserved_bytes"] == 0
    assert status == 400 and err["error"]["code"] == "kv_memory_exceeded" and refused_in < 5, err
    assert err["error"]["param"] == "prompt" and re.search(
        rf"^the prompt is \d+ tokens; the server's --max-kv-bytes of {2 * GROWTH_BYTES} holds 512 rows of KV cache "
        r"\(4096 bytes each\), no whole slot of 4 after it$", err["error"]["message"]), err


def test_a_budget_max_kv_bytes_cannot_hold_is_cut_to_what_it_holds(caplog):
    """Claude Code asks for 32,000 to 128,000 tokens: past the context, cut to it; past what --max-kv-bytes
    holds (a request reserves its whole budget when it starts), every request was refused. It is now cut to
    the whole slots the budget holds after the prompt, as one past the context is cut to it, and says so."""
    with caplog.at_level(logging.INFO, logger="refusion_mlx.server"):
        with serve(max_kv_bytes=2 * GROWTH_BYTES) as srv:
            conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
            for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to 900."}],
                                                         "max_tokens": 600}),
                               ("/v1/messages", {"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                                                 "max_tokens": 128000}),
                               ("/v1/responses", {"input": "Hi", "max_output_tokens": 1000})):
                conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                answer = json.loads(resp.read())
                assert resp.status == 200, (path, answer)
                asked, given = resp.getheader("X-Max-Tokens-Cut").split(" -> ")
                usage = answer["usage"]
                prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
                assert asked == str(body.get("max_tokens", body.get("max_output_tokens"))), path
                assert 512 - 16 < prompt + int(given) <= 512, (path, given, prompt)  # 512 rows: within a block
            status, chat = call(srv, "POST", "/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "Who is Sven?"}]})  # the default 512
            state = wait_idle(srv)
    assert status == 200 and chat["choices"][0]["message"]["content"], chat
    assert state["refused"] == 0 and state["kv"]["reserved_bytes"] == 0
    assert "max_tokens 600 cut to" in caplog.text and "the 512 rows --max-kv-bytes holds" in caplog.text
    # one line a request, of the cut that holds: 128,000 was cut by the context, then by memory (two lines)
    cuts = [line for line in caplog.text.splitlines() if "max_tokens 128000 cut to" in line]
    assert len(cuts) == 1 and cuts[0].endswith("the 512 rows --max-kv-bytes holds"), cuts


def test_an_open_budget_is_cut_to_what_max_kv_bytes_holds(caplog):
    """Codex sends no max_output_tokens: the open budget (the context left, 2048 rows) would not fit 512 rows of
    --max-kv-bytes and every turn was refused naming a field it never sent; it is now cut to the whole slots the
    budget holds after the prompt, and the server says so at start-up. Chat keeps its default budget."""
    with caplog.at_level(logging.WARNING, logger="refusion_mlx.server"):
        with serve(max_kv_bytes=2 * GROWTH_BYTES) as srv:
            status, answer = call(srv, "POST", "/v1/responses", {"input": "Who is Sven?"})
            chat_status, _ = call(srv, "POST", "/v1/chat/completions",
                                  {"messages": [{"role": "user", "content": "Who is Sven?"}]})
    assert status == 200 and answer["max_output_tokens"] is None, answer
    held = (512 - answer["usage"]["input_tokens"]) // 4 * 4  # whole slots of 4 in 512 rows
    assert answer["usage"]["layout"]["blocks"] == -(-held // 16), answer["usage"]
    assert chat_status == 200  # chat keeps the default 512, cut to what the budget holds (warned at start-up)
    assert "holds less than the model's context of 2048 tokens" in caplog.text


def test_a_kv_refusal_names_the_field_of_its_api():
    """The prompt that leaves no slot is each API's own field (Responses: input, Messages: messages); a scored
    prompt's need is its prompt's, in rows that multiply out to the bytes named."""
    with serve(max_kv_bytes=2 * GROWTH_BYTES) as srv:
        long = " ".join(["7"] * 600)
        status, err = call(srv, "POST", "/v1/responses", {"input": long, "max_output_tokens": 8})
        assert status == 400 and err["error"]["param"] == "input", err
        status, err = call(srv, "POST", "/v1/messages", {"model": "m", "max_tokens": 8,
                                                          "messages": [{"role": "user", "content": long}]})
        assert status == 400 and err["error"]["type"] == "invalid_request_error" and "--max-kv-bytes" in \
            err["error"]["message"], err
        status, err = call(srv, "POST", "/v1/completions", {"prompt": " ".join(["7"] * 1000), "max_tokens": 0,
                                                            "echo": True, "logprobs": 1})
        assert status == 400 and err["error"]["param"] == "prompt", err
        need, rows, row = map(int, re.search(r"needs (\d+) bytes of KV cache \((\d+) rows of (\d+) bytes",
                                             err["error"]["message"]).groups())
        assert need == rows * row


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(monkeypatch):
    with serve() as srv:
        gen = srv.engine.gen
        real = gen.step
        calls = []

        def broken():
            if not calls:
                calls.append(1)
                raise RuntimeError("[metal::malloc] Attempting to allocate 99999999999 bytes")
            return real()

        monkeypatch.setattr(gen, "step", broken)
        status, err = ask(srv)
        assert status == 500 and err["error"]["code"] == "step_failed"
        assert "RuntimeError" in err["error"]["message"] and "allocate" in err["error"]["message"]
        assert ask(srv)[0] == 200  # the next request is served
        # a failure inside the batched forward (BatchGenerator catches it): its requests fail alone
        import refusion_mlx.decode.batch as batch

        real_passes, failed = batch.run_passes, []

        def failing_passes(model, passes):
            if not failed:
                failed.append(1)
                raise MemoryError("out of memory")
            return real_passes(model, passes)

        monkeypatch.setattr(batch, "run_passes", failing_passes)
        status, err = ask(srv)
        assert status == 500 and err["error"]["code"] == "generation_failed" and "MemoryError" in err["error"]["message"]
        status, ok = ask(srv)
        state = wait_idle(srv)
        health_status = call(srv, "GET", "/health")[0]
    assert status == 200 and ok["choices"][0]["message"]["content"]
    assert state["failed"] == 2 and state["kv"]["reserved_bytes"] == 0 and health_status == 200


def test_health_is_503_when_a_step_is_stuck_or_the_engine_is_dead(monkeypatch):
    with serve(watchdog_seconds=0.3) as srv:
        gen, engine = srv.engine.gen, srv.engine
        real = gen.step

        def slow():
            time.sleep(1.2)
            return real()

        monkeypatch.setattr(gen, "step", slow)
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(ask, srv)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                status, body = call(srv, "GET", "/health")
                if status == 503:
                    break
                time.sleep(0.05)
            assert (status, body["status"]) == (503, "stuck")
            up = metrics(srv)["refusion_engine_up"]
            monkeypatch.setattr(gen, "step", real)
            assert answer.result()[0] == 200
        assert up == 0 and call(srv, "GET", "/health")[0] == 200

        def bug():  # outside any step: the engine thread fails
            raise ValueError("a bug")

        monkeypatch.setattr(engine, "_decide", bug)
        status, err = ask(srv)
        engine._thread.join(5)
        health = call(srv, "GET", "/health")
        after = ask(srv)
    assert status == 500 and err["error"]["code"] == "engine_failed"
    assert health[0] == 503 and health[1]["status"] == "dead"
    assert after[0] == 503 and after[1]["error"]["code"] == "engine_dead"


def test_prompt_cache_survives_a_restart(tmp_path, caplog):
    folder = tmp_path / "cache"
    with serve(prompt_cache_dir=str(folder)) as srv:
        _, first = ask(srv)
        _, other = ask(srv, "Count from 17 to 38.")
    files = sorted(folder.glob("*.safetensors"))
    assert len(files) == 2 and not list(folder.glob(".tmp-*"))
    # a corrupt file and one written for another model under this model's name are skipped, one warning line
    # each; the file of another model (its own name) is left alone, unread and untrimmed
    prefix = files[0].name[:17]
    (folder / f"{prefix}{'c' * 32}.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    import mlx.core as mx

    arrays, meta = mx.load(str(files[0]), return_metadata=True)
    mx.save_safetensors(str(folder / f"{prefix}{'f' * 32}.safetensors"), arrays, metadata={**meta, "model": "x"})
    mx.save_safetensors(str(folder / f"{'0' * 16}-{'f' * 32}.safetensors"), arrays, metadata={**meta, "model": "x"})
    caplog.set_level(logging.WARNING, logger="refusion_mlx.server")
    with serve(prompt_cache_dir=str(folder)) as srv:
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        loaded = call(srv, "GET", "/health")[1]["prompt_cache"]["entries"]
        _, again = ask(srv)
    assert loaded == 2
    # and one line for the other fingerprint's file, which nothing of this server counts or removes (a
    # changed model's or an older version's files were left behind without a word)
    assert len(warnings) == 3 and all(w.count("\n") == 0 for w in warnings), warnings
    assert any(w.startswith("prompt cache: 1 file(s), ") and "not counted in --prompt-cache-dir-bytes" in w
               for w in warnings), warnings
    assert any("c" * 32 in w for w in warnings)
    assert any("f" * 32 in w and "another model" in w for w in warnings)
    assert (folder / f"{'0' * 16}-{'f' * 32}.safetensors").exists()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == first["usage"]["prompt_tokens"] - 1
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


def test_a_prompt_cache_file_is_checked_before_anything_is_allocated_for_it():
    """A file from the cache folder (anyone who can write there) holds one entry of at most the context's rows,
    at positions 0, 1, ... with finite keys and values: a file that claims 2e8 rows took 1.5 GB before it was
    skipped; positions near 2**31 made every request sharing its prefix a 400; NaN keys answered garbage."""
    import mlx.core as mx

    from refusion_mlx.decode.cache import CommittedCache
    from refusion_mlx.decode.prefill import prefill
    from refusion_mlx.models.loading import load
    from refusion_mlx.serve.caches.cache_files import _entry_problem

    model, _ = load(None)
    cache = CommittedCache.for_model(model)
    prefill(model, cache, list(range(5, 25)))
    good = cache.to_arrays()
    context = model.args.max_position_embeddings
    assert _entry_problem(good, context) is None
    keys = next(k for k in good if k.startswith("keys."))
    bad = [({"positions": good["positions"] + ((1 << 31) - 30)}, "not 0, 1, 2"),
           ({"positions": good["positions"] - 1}, "not 0, 1, 2"),
           ({"positions": mx.zeros_like(good["positions"])}, "not 0, 1, 2"),
           ({keys: good[keys] * float("nan")}, "not finite"),
           ({keys: good[keys][:, :, :10]}, "one row per position"),
           ({"positions": mx.zeros((2 * 10 ** 8,), mx.int32)}, f"1 to {context} rows")]
    for change, needle in bad:
        active = mx.get_active_memory()
        assert needle in _entry_problem({**good, **change}, context), needle
        assert mx.get_active_memory() - active < 1 << 20  # nothing of the claimed size was made


def test_prompt_cache_dir_keeps_to_its_byte_budget(tmp_path):
    """Entries of 20-25 rows (80-100 KB) in a 120 KB budget: each new file evicts the older one."""
    folder = tmp_path / "cache"
    with serve(prompt_cache_dir=str(folder), prompt_cache_dir_bytes=120_000) as srv:
        for p in ("Who is Sven?", "Tell me about Zoe.", "Count from 17 to 38."):
            ask(srv, p, max_tokens=8)
            sizes = [f.stat().st_size for f in folder.glob("*.safetensors")]
            assert len(sizes) == 1 and sum(sizes) <= 120_000
    with serve(prompt_cache_dir=str(folder)) as srv:  # the newest entry is the one kept
        _, last = ask(srv, "Count from 17 to 38.", max_tokens=8)
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == last["usage"]["prompt_tokens"] - 1


def test_a_full_disk_makes_room_for_the_newest_entry(tmp_path, monkeypatch, caplog):
    """A --prompt-cache-dir-bytes budget larger than the disk's room: a write that finds the disk full
    deletes the least recently used files, as the budget would, and goes in; the newest conversations are
    the ones kept (the first few files were, and every later write failed with a warning)."""
    import errno
    import os

    import mlx.core as mx

    from refusion_mlx.decode.cache import CommittedCache
    from refusion_mlx.decode.prefill import prefill
    from refusion_mlx.models.loading import load
    from refusion_mlx.serve.caches.cache_files import CacheDir, entry_name

    model, _ = load(None)
    folder = tmp_path / "cache"
    store = CacheDir(folder, 1 << 40, "f" * 32)
    probe = CommittedCache.for_model(model)
    prefill(model, probe, list(range(5, 205)))
    disk, real = int(3.2 * sum(a.nbytes for a in probe.to_arrays().values())), mx.save_safetensors  # three fit

    def small_disk(fh, arrays, metadata=None):
        used = sum(f.stat().st_size for f in folder.iterdir())
        if used + sum(a.nbytes for a in arrays.values()) > disk:
            fh.write(b"\0" * max(0, disk - used))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fh, arrays, metadata=metadata)

    monkeypatch.setattr(mx, "save_safetensors", small_disk)
    caplog.set_level(logging.WARNING, logger="refusion_mlx.server")
    names = []
    for i in range(6):
        cache, ids = CommittedCache.for_model(model), list(range(5 + i, 205 + i))
        prefill(model, cache, ids)
        store.save("owner", ids, cache)
        names.append(folder / entry_name("f" * 32, "owner", ids))
        assert names[-1].is_file(), f"entry {i} was not written"
    kept = sorted(folder.iterdir())
    assert set(kept) <= set(names) and names[-1] in kept and names[0] not in kept
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_heap_a_busy_period_freed_goes_back_when_the_engine_is_idle():
    """glibc keeps freed heap in its arenas (a soak's resident memory stayed 1-1.5 GB over what MLX and the
    prompt cache hold): when a busy period ends the engine calls malloc_trim, at most every 30 s."""
    import sys

    from refusion_mlx.serve.core.memory import HeapTrim

    calls = []
    heap = HeapTrim(every=30.0)
    if sys.platform.startswith("linux"):
        assert heap.trim is not None and heap.trim(0) in (0, 1)  # glibc's, callable
    heap.trim = calls.append
    assert not heap.idle() and calls == []  # no work since: nothing to give back
    heap.busy()
    assert heap.idle() and not heap.idle() and calls == [0]  # once
    heap.busy()
    assert not heap.idle() and calls == [0]  # worked again, but within its interval: later
    heap.after = 0.0
    assert heap.idle() and calls == [0, 0]
    with serve() as srv:
        trims = []
        srv.engine.heap.trim, srv.engine.heap.after = trims.append, 0.0
        ask(srv)
        wait_idle(srv)
        assert wait_for_value(lambda: trims) == [0]  # the request's busy period ended: one trim


def wait_for_value(get, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not get() and time.monotonic() < deadline:
        time.sleep(0.05)
    return get()


def test_short_soak():
    """Mixed traffic for 3 s: every kind of request comes within it (seed 1: 32 checked answers, 14 malformed
    requests and 13 drops here; 5 s only repeated them, at 2.5 s more CPU)."""
    from benchmarks.soak import failed, soak

    with serve(max_kv_bytes=4 * GROWTH_BYTES, max_batch=4) as srv:
        result = soak(srv.url[:-3], duration=3.0, clients=4, max_tokens=24, seed=1)
    assert failed(result) is None, result["problems"]
    assert result["5xx"] == 0 and result["left_active"] == 0 and result["left_queued"] == 0
    assert result["checked"] > 10 and result["exact"] == result["checked"]
    assert result["4xx"] == result["malformed"] > 0  # a request over the budget is cut, not refused
    m = result["metrics"]["requests"]
    drops = result["drops_mid_stream"] + result["drops_before_answer"]
    assert drops > 0 and m["cancelled"] + result["drops_finished_first"] == drops and m["failed"] == 0
    assert result["metrics"]["generated_tokens"] > 0


def test_prompt_cache_dir_that_vanishes_is_one_warning_not_a_failure(tmp_path, caplog):
    folder = tmp_path / "cache"
    caplog.set_level(logging.WARNING, logger="refusion_mlx.server")
    with serve(prompt_cache_dir=str(folder)) as srv:
        folder.rmdir()  # the disk goes away under the server
        status, answer = ask(srv)
        health = call(srv, "GET", "/health")
    assert status == 200 and answer["choices"][0]["message"]["content"] and health[0] == 200
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cannot write" in warnings[0]


def test_cli_prompt_cache_dir_survives_kill_9(tmp_path):
    """`python -m refusion_mlx.server --prompt-cache-dir DIR`, killed with SIGKILL and started again."""
    from tests.test_server import start_cli, wait_ready

    def chat(port):
        deadline = time.monotonic() + 10
        while True:  # the "serving" line comes just before uvicorn listens
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            try:
                conn.request("POST", CHAT, json.dumps({"messages": [{"role": "user", "content": "Who is Sven?"}],
                                                       "max_tokens": 16}), {"Content-Type": "application/json"})
                return json.loads(conn.getresponse().read())
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
            finally:
                conn.close()

    folder = tmp_path / "cache"
    answers = []
    for _ in range(2):
        proc, lines = start_cli("--prompt-cache-dir", str(folder))
        try:
            answers.append(chat(wait_ready(proc, lines)))
        finally:
            proc.kill()
            proc.wait(10)
    first, again = (a["usage"] for a in answers)
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["prompt_tokens_details"]["cached_tokens"] == again["prompt_tokens"] - 1
    assert answers[0]["choices"][0]["message"]["content"] == answers[1]["choices"][0]["message"]["content"]


def test_a_client_that_leaves_is_noticed_while_events_keep_coming():
    """A decode fast enough that its next event is always ready still looks at its client every
    CLIENT_CHECK s: a non-streaming request whose client left ends (ClientGone) instead of running on."""
    import asyncio

    from refusion_mlx.decode.params import make_params
    from refusion_mlx.serve.edge.answering import CLIENT_CHECK, ClientGone, collect
    from refusion_mlx.serve.core.engine_request import EngineRequest
    from refusion_mlx.serve.core.job import Job

    class Gone:
        async def is_disconnected(self):
            return True

    async def run():
        job = Job(EngineRequest(prompt_ids=[1, 2, 3], params=make_params(max_tokens=8)), asyncio.get_running_loop())
        fed = 0

        async def feed():  # a step's text every few ms, for far longer than the checks take
            nonlocal fed
            for _ in range(2000):
                job.events.put_nowait(("text", "x"))
                fed += 1
                await asyncio.sleep(0.002)
            job.events.put_nowait(("done", {"finish_reason": "length"}))

        feeder = asyncio.create_task(feed())
        try:
            with pytest.raises(ClientGone):
                await collect(job, None, Gone())
        finally:
            feeder.cancel()
        return fed

    fed = asyncio.run(run())
    assert fed < 2000 and fed * 0.002 < CLIENT_CHECK * 8, fed


def raw_post(srv, path, body):
    """A client that sends a request and may hang up before its answer (close the socket)."""
    s = socket.create_connection((srv.host, srv.port), timeout=30)
    data = json.dumps(body).encode()
    s.sendall(b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
    return s


def until(srv, ok, seconds=20.0) -> dict:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        _, state = call(srv, "GET", "/health")
        if ok(state):
            return state
        time.sleep(0.05)
    raise AssertionError(f"/health never got there: {state}")


def test_a_request_is_queued_whole_or_not_and_leaves_the_queue_when_its_client_does():
    """A request's choices are queued all or none: one refused for a full queue
    leaves nothing in it; one whose client hangs up frees its places at once."""
    with serve(max_batch=1, max_queue=4) as srv:
        runner = raw_post(srv, "/v1/completions", {**SLOW, "max_tokens": 200})  # holds the one row
        until(srv, lambda s: s["active"] == 1)
        waiting = raw_post(srv, "/v1/completions", {**SLOW, "prompt": ["a", "b", "c"], "max_tokens": 4})
        until(srv, lambda s: s["queued"] == 3)
        status, body = call(srv, "POST", "/v1/completions", {**SLOW, "prompt": ["d", "e"], "max_tokens": 4})
        assert status == 503 and "3 requests waiting, and this one brings 2" in body["error"]["message"]
        assert call(srv, "GET", "/health")[1]["queued"] == 3  # nothing of the refused one was left
        waiting.close()  # its client leaves: its 3 places are free before it would have reached the batch
        until(srv, lambda s: s["queued"] == 0)
        with ThreadPoolExecutor(1) as pool:
            four = pool.submit(call, srv, "POST", "/v1/completions", {**SLOW, "prompt": list("wxyz"), "max_tokens": 2})
            until(srv, lambda s: s["queued"] == 4)
            runner.close()
            status, body = four.result()
        assert status == 200 and len(body["choices"]) == 4


def test_one_request_with_many_choices_does_not_hold_a_later_one_behind_them():
    """Rows go to the request holding the fewest: a one-choice request sent
    while a six-prompt one fills the batch starts at the next free row, ahead
    of the six-prompt request's waiting choices."""
    with serve(max_batch=2) as srv, ThreadPoolExecutor(2) as pool:
        big = pool.submit(call, srv, "POST", "/v1/completions",
                          {**SLOW, "prompt": [f"{i} {i + 1}" for i in range(6)], "max_tokens": 24})
        until(srv, lambda s: s["active"] == 2 and s["queued"] == 4)
        small = pool.submit(call, srv, "POST", "/v1/completions", {**SLOW, "max_tokens": 24})
        status, _ = small.result()
        state = call(srv, "GET", "/health")[1]
        assert status == 200 and not big.done()
        assert state["queued"] >= 1  # the big one's choices still wait: the small one went ahead of them
        status, body = big.result()
        assert status == 200 and len(body["choices"]) == 6


def test_a_stream_of_more_choices_than_the_batch_begins_with_its_first(monkeypatch):
    """n past --max-batch: the stream waited for its last choice's admission, near the end of the whole
    answer (n=16 of 256 tokens under --max-batch 2: the first byte after 7.6 s of 8.8 s). It now begins
    once its first choice is admitted, the others' chunks following as they come."""
    from refusion_mlx.decode.batch import BatchGenerator

    step = BatchGenerator.step
    monkeypatch.setattr(BatchGenerator, "step", lambda self, *a, **k: (time.sleep(0.01), step(self, *a, **k))[1])
    with serve(max_batch=2) as srv:
        conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
        conn.request("POST", CHAT, body=json.dumps({"slot_threshold": 1.0, "token_threshold": 1.0, "max_tokens": 24, "n": 6, "stream": True,
                                                    "messages": [{"role": "user", "content": "Count to 30."}]}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        first = resp.readline()
        waiting = call(srv, "GET", "/health")[1]["queued"]
        rest = resp.read().decode()
    assert resp.status == 200 and first.startswith(b"data: ") and waiting >= 2, (first, waiting)
    indexes = {json.loads(line[6:])["choices"][0]["index"] for line in rest.splitlines()
               if line.startswith("data: {") and json.loads(line[6:])["choices"]}
    assert indexes == set(range(6)) and rest.rstrip().endswith("data: [DONE]")


def test_main_in_process_gives_the_callers_signal_handlers_back(monkeypatch):
    """``server.main()`` called in process (a library user, a test), served, then stopped by SIGHUP as a
    closed terminal stops it: SIGINT, SIGTERM and SIGHUP have the caller's handlers again when it returns
    (SIGHUP kept the server's, which raised SIGTERM into the process; SIGINT and SIGTERM were left at
    SIG_DFL by the handler that stopped it)."""
    import os
    import signal

    from refusion_mlx import server

    started, frozen = [], []

    class Recorded(RefusionServer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

        def load(self):  # the imports are out of the collector's scans by now (_startup.freeze_imports)
            frozen.append(gc.get_freeze_count())
            return super().load()

    def stop():  # once it serves, as a terminal that closes (sent anyway after a minute: the test ends)
        deadline = time.monotonic() + 60
        while not (started and started[0].uvicorn.started) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGHUP)

    def mine(signum, frame):
        pass

    monkeypatch.setattr(server, "RefusionServer", Recorded)
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = {s: signal.signal(s, mine) for s in sigs}
    gc.unfreeze()  # what the test run froze (conftest): main freezes its own
    try:
        threading.Thread(target=stop, daemon=True).start()
        code = server.main(["--model", str(FIXTURE_MODEL), "--port", "0", "--log-level", "ERROR"])
        after = {s: signal.getsignal(s) for s in sigs}
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    assert code == 0 and started and after == {s: mine for s in sigs}, after
    assert frozen and frozen[0] > 10_000, frozen
