"""The scripts of benchmarks/ end bad arguments and Ctrl-C in one line, never a traceback."""

import threading
import time

import pytest

from benchmarks import kv_cache, soak, speed_common


@pytest.mark.parametrize("text, value", [("-1", 2 ** 64 - 1), ("0", 0), (str(2 ** 64 - 1), 2 ** 64 - 1),
                                         (str(-2 ** 63), 2 ** 63)])
def test_a_seed_is_taken_as_the_runtime_takes_it(text, value):
    """A negative --seed went to numpy's generator, which refused it with a traceback."""
    args = speed_common.base_parser("prog", "x").parse_args(["--seed", text])
    assert args.seed == value
    import numpy as np

    np.random.default_rng(args.seed)


@pytest.mark.parametrize("text", ["x", str(2 ** 64), str(-2 ** 63 - 1)])
def test_a_seed_out_of_range_is_one_line(text, capsys):
    with pytest.raises(SystemExit) as e:
        speed_common.base_parser("prog", "x").parse_args(["--seed", text])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "[-2**63, 2**64)" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("url", ["127.0.0.1:18360", "notaurl", "http://127.0.0.1:99999", "https://x:1"])
def test_soak_refuses_a_url_that_is_not_http(url, capsys):
    """--url without its scheme ended in an AttributeError traceback."""
    with pytest.raises(SystemExit) as e:
        soak.main(["--url", url])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "--url must be" in err and len(err.splitlines()) == 1


def test_kv_cache_admission_interrupted_stops_its_watcher_first(monkeypatch):
    """Ctrl-C during the requests closed the server under the /health watcher: its thread died on a
    ConnectionRefusedError traceback."""
    failures = []
    monkeypatch.setattr(threading, "excepthook", lambda a: failures.append(a.exc_type))

    class Interrupted:
        def __init__(self, n):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def map(self, fn, items):
            time.sleep(0.3)
            raise KeyboardInterrupt

    monkeypatch.setattr(kv_cache, "ThreadPoolExecutor", Interrupted)
    parsed = {"model": str(kv_cache.FIXTURES / "tiny-refusion"), "requests": 2, "max_kv_bytes": 8 << 20,
              "prompt_tokens": 20, "max_tokens": 4, "dtype": None}
    from types import SimpleNamespace

    with pytest.raises(KeyboardInterrupt):
        kv_cache.admission_section(SimpleNamespace(**parsed))
    time.sleep(0.5)
    assert failures == [] and not [t for t in threading.enumerate() if "watch" in t.name]


def test_scaling_defaults_fit_the_model_and_a_row_past_it_fails_first(tmp_path, capsys):
    """--sections prompts (and slots) failed on the demo model with its defaults, a 2048-token prompt
    beside a budget in a 2048-position context, after the sections before it had run: all was lost."""
    import json

    from benchmarks import scaling

    out = tmp_path / "s.json"
    assert scaling.main(["--sections", "prompts,slots", "--slots", "1,4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["prompts"] == [64, 128, 256, 512, 1024, 1920]
    assert report["settings"]["long_prompt"] == 2048 - 16
    assert [r["prompt_tokens"] for r in report["prompts"]][-1] == 1920
    capsys.readouterr()
    assert scaling.main(["--budgets", "16", "--prompts", "2048", "--slots", "1"]) == 1
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines()[-1] == (
        "error: --prompts 2048 with --prompt-budget 128: prompt (2048 tokens) + max_tokens 128 exceeds the "
        "model's context of 2048 positions (the prompt alone fills it)")
    assert "budget 16" not in captured.err and "vs budget" not in captured.out


@pytest.mark.parametrize("script, argv, message", [
    ("grammar_engines", ["--repeat", "0"], "argument --repeat: expected a positive integer"),
    ("mc_scoring", ["--shapes", "100"], "a shape is CONTEXT:SCORED"),
    ("mc_scoring", ["--shapes", "30:0"], "needs at least one token of context and one scored"),
])
def test_bad_counts_say_what_is_wrong(script, argv, message, capsys):
    """grammar_engines --repeat 0 ran once; mc_scoring --shapes 100 said only 'invalid shapes_arg value'."""
    import importlib

    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"benchmarks.{script}").main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and message in err and len(err.splitlines()) == 1
