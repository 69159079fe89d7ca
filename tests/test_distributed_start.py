"""Two ranks on their way to ready (started as ``mlx.launch`` starts them,
``tests/ranks.py``): the hostfile checked before MLX reads it, one random
seed for every rank, the model compared file by file, another rank's slow
loading waited for (and a dead one not for ever), a failure on the way said
once (``distributed/meeting.py``)."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import FIXTURE_MODEL
from tests.ranks import ROOT, start_ranks, wait_for


def test_the_python_api_samples_alike_on_every_rank(tmp_path):
    """distributed.group.init seeds MLX's generator alike on every rank, so unseeded sampling in the Python
    API draws alike. Only the commands' join seeded it: MLX seeds each process from the clock (in ms) at its
    first draw, so ranks that got there at different times (rank 1 half a second later here, as a rank on
    another machine would) drew apart, decoded apart, and the ring failed or hung. PyTorch is kept out of the
    ranks as the commands keep it out: transformers imports it where it is installed (2 CPU-s a rank), and
    it has no part in MLX's generator."""
    code = ("import sys, time\nsys.modules.setdefault('torch', None)\nimport refusion_mlx as rm\n"
            "from refusion_mlx.distributed import group\n"
            "dist = group.init()\ntime.sleep(0.5 * dist.rank)\nmodel, tok = rm.load(sys.argv[1], dist=dist)\n"
            "for p in ['Who is Sven?', 'Count from 1 to 30.']:\n"
            "    print(repr(rm.generate(model, tok, rm.chat_prompt(tok, p), max_tokens=32, temperature=1.0)))\n")
    procs = start_ranks(tmp_path, [str(FIXTURE_MODEL)], command=["-c", code])
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [0, 0], [err.decode() for _, err in outs]
    assert outs[0][0] == outs[1][0] and len(outs[0][0].splitlines()) == 2, outs


def test_ranks_wait_for_a_rank_that_loads_slowly(tmp_path):
    """Rank 0 takes 4.5 s to find its model (a download) and 4.5 s more before reading its weights (a slow
    disk) under a 3-s limit on collectives: rank 1 waits for it, in the ranks' model check and in the barrier
    after loading, and both answer (the watchdog ended rank 1 in the first of those waits). Rank 1 polls its
    socket as it waits, a core's worth: the waits are no longer than they must be to outlast the limit and
    the watchdog's look every 0.75 s."""
    argv = ["4.5", "refusion_mlx.generate", "--model", str(FIXTURE_MODEL), "--prompt", "Count from 1 to 9.",
            "--max-tokens", "8"]
    procs = start_ranks(tmp_path, argv, timeout_s="3", command="tests.slow_load")
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
    argv = ["4", "refusion_mlx.generate", "--model", str(FIXTURE_MODEL), "--prompt", "Count from 1 to 9."]
    procs = start_ranks(tmp_path, argv, timeout_s="20", command="tests.slow_load")
    left = procs[1 - dead]
    try:
        wait_for(procs[0].stderr, b"loads slowly")  # both ranks have joined; rank 1 goes on to wait for rank 0
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
    procs = start_ranks(tmp_path, [["--model", str(FIXTURE_MODEL), *flags],
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
    procs = start_ranks(tmp_path, argv, timeout_s="20")
    errs = [p.communicate(timeout=60)[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [1, 1], errs
    said = [line for err in errs for line in err.splitlines() if "error" in line]
    assert said == [f"error: rank {0 if where == 'every rank' else 1}: no model folder at {missing}"], errs
