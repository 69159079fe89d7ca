"""The one switch between GPU and CPU paths (models/backend.py): both decode
every golden case token for token, alone and in one batch."""

import os
import subprocess
import sys

import mlx.core as mx
import pytest

from refusion_mlx.decode import forward as forward_module
from refusion_mlx.decode.batch import batch_generate
from refusion_mlx.decode.decoder import RefusionDecoder
from refusion_mlx.decode.params import RefusionParams
from refusion_mlx.errors import RefusionError
from refusion_mlx.models import backend

from tests.helpers import FIXTURE_MODEL


def decoded(model, tokenizer, case) -> RefusionDecoder:
    """A golden case decoded alone, to the end."""
    decoder = RefusionDecoder(model, case["prompt_ids"], params_of(case),
                              mask_id=model.args.mask_token_id, eos_id=tokenizer.eos_token_id)
    for _ in decoder.steps():
        pass
    return decoder


def params_of(case):
    return RefusionParams(gen_length=case["gen_length"], slot_size=case["slot_size"],
                          serial_num_blocks=case["serial_num_blocks"],
                          slot_threshold=case["slot_threshold"], token_threshold=case["token_threshold"])


def suite_mode() -> str:
    """The paths and attention the rest of the suite decodes on, as a mode below."""
    attention = backend.attention_mode()
    return backend.paths() + ("" if attention == "auto" else f"-{attention}")


# test_golden.py and test_batch.py decode every case alone and in one batch on
# the paths the suite runs on; here, on each of the others
MODES = [m for m in ("gpu", "cpu", "gpu-unfused", "gpu-bucketed") if m != suite_mode()]


@pytest.mark.parametrize("mode", MODES)
def test_every_golden_case_is_token_exact_on_both_paths(demo, golden_cases, set_paths, monkeypatch, mode):
    """Float32, T=0: each case alone, then all 32 in one batch; the GPU paths
    also with the unfused attention MLX's CUDA backend takes (``fused_attention``)
    and at bucketed shapes (``bucketed_attention``: every pass a padded batch).
    The suite's own mode is left to test_golden.py and test_batch.py."""
    mode, _, attention = mode.partition("-")
    monkeypatch.setenv(backend.ATTENTION_ENV, attention or "auto")
    set_paths(mode)
    assert backend.paths() == mode
    assert backend.fused_attention(4) == (mode == "gpu" and attention != "unfused")
    assert backend.bucketed_attention(4) == (attention == "bucketed")
    model, tokenizer = demo
    wrong = []
    for i, case in enumerate(golden_cases):
        decoder = RefusionDecoder(model, case["prompt_ids"], params_of(case),
                                  mask_id=model.args.mask_token_id, eos_id=tokenizer.eos_token_id)
        phases = {s.phase for s in decoder.steps()}
        if decoder.response() != case["output_ids"]:
            wrong.append(i)
        # every pass ends in one blocking evaluation, prefill chunks included,
        # but an infill draft (device values only: mx.async_eval)
        stats = decoder.stats
        assert stats.host_syncs < stats.forwards if "infill" in phases else stats.host_syncs == stats.forwards
    assert not wrong
    results = batch_generate(model, tokenizer, [c["prompt_ids"] for c in golden_cases],
                             [params_of(c) for c in golden_cases], max_batch=len(golden_cases))
    assert [i for i, (r, c) in enumerate(zip(results, golden_cases)) if r.output_ids != c["output_ids"]] == []


def test_gpu_paths_head_reads_the_weight_once_per_step(monkeypatch, set_paths):
    """CPU paths: chunks of LOGITS_BUDGET_BYTES; GPU paths: the device's budget."""
    vocab = 151_671
    set_paths("cpu")
    assert forward_module.head_chunk_rows(vocab) == forward_module.LOGITS_BUDGET_BYTES // (4 * vocab)
    set_paths("gpu")
    monkeypatch.setattr(backend, "memory_size", lambda: 64 << 30)
    assert forward_module.head_chunk_rows(vocab) == (4 << 30) // (4 * vocab)  # 1/16 of 64 GB
    monkeypatch.setattr(backend, "memory_size", lambda: None)
    assert forward_module.head_chunk_rows(vocab) == backend.FALLBACK_LOGITS_BUDGET_BYTES // (4 * vocab)


@pytest.mark.parametrize("i", [8, 24])
def test_gpu_paths_chunked_head_changes_nothing(demo, golden_cases, monkeypatch, set_paths, i):
    """A GPU budget of one slot of logits per chunk: still token-exact."""
    set_paths("gpu")
    model, tokenizer = demo
    case = golden_cases[i]
    monkeypatch.setattr(backend, "logits_budget", lambda: 4 * model.args.vocab_size * case["slot_size"])
    assert decoded(model, tokenizer, case).response() == case["output_ids"]


def test_auto_follows_the_default_device(set_paths):
    assert set_paths("") == "auto"
    assert backend.gpu_paths() == (mx.default_device() == mx.gpu)
    assert set_paths(" CPU ") == "cpu" and backend.cpu_paths()
    assert set_paths("gpu") == "gpu" and backend.paths() == "gpu"


def test_unknown_mode_is_a_one_line_error(set_paths):
    with pytest.raises(backend.PathsError) as e:
        set_paths("metal")
    assert isinstance(e.value, RefusionError)
    assert "REFUSION_MLX_PATHS='metal'" in str(e.value) and "auto, gpu, cpu" in str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_mode_fails_a_command_in_one_line():
    env = {**__import__("os").environ, backend.ENV: "fast"}
    proc = subprocess.run([sys.executable, "-m", "refusion_mlx.generate", "--model", str(FIXTURE_MODEL),
                           "--prompt", "hi", "--max-tokens", "8"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: REFUSION_MLX_PATHS='fast'"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_wired_limit_is_a_no_op_off_metal(monkeypatch):
    def refuse(*_):
        raise AssertionError("set_wired_limit called off Metal")

    monkeypatch.setattr(backend, "_is_metal", lambda: False)
    monkeypatch.setattr(mx, "set_wired_limit", refuse)
    with backend.wired_limit():
        pass


@pytest.fixture
def reported(monkeypatch):
    """Make the device report ``info`` (``mx.device_info``), read afresh."""
    def report(info):
        monkeypatch.setattr(mx, "device_info", lambda: info)
        backend._reported_memory.cache_clear()
    yield report
    backend._reported_memory.cache_clear()


def test_the_device_memory_is_what_the_device_reports(reported):
    """One home for the device's memory: a CUDA device's (80 GiB here) sizes the server's --max-kv-bytes
    default as it does the logits budget; it took the host's physical memory there."""
    import mlx.nn as nn

    from refusion_mlx.serve.core import memory

    reported({"device_name": "NVIDIA H100", "architecture": "sm_90", "memory_size": 80 << 30})
    assert backend.device_memory() == (80 << 30, "the device's memory") and backend.memory_size() == 80 << 30
    model = nn.Linear(4, 4)
    assert memory.default_max_kv_bytes(model, 1 << 30, 4096) == int(0.9 * (80 << 30)) - 80 - (1 << 30)
    reported({"memory_size": 64 << 30, "max_recommended_working_set_size": 48 << 30})  # a Mac
    assert backend.device_memory() == (48 << 30, "Metal's recommended working set")
    assert backend.logits_budget() == (48 << 30) // backend.LOGITS_MEMORY_FRACTION
    reported({"device_name": "AMD EPYC", "architecture": "x86_64"})  # the CPU: the host's memory
    assert backend.device_memory() == (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory")
    assert backend.memory_size() is None and backend.logits_budget() == backend.FALLBACK_LOGITS_BUDGET_BYTES


def test_wired_limit_sets_and_restores_on_metal(monkeypatch, reported):
    calls = []
    monkeypatch.setattr(backend, "_is_metal", lambda: True)
    reported({"max_recommended_working_set_size": 1 << 30})
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: calls.append(n) or 7)
    monkeypatch.setattr(mx, "synchronize", lambda *a: None)
    with pytest.raises(KeyError):
        with backend.wired_limit():
            assert calls == [1 << 30]
            raise KeyError("inside")
    assert calls == [1 << 30, 7]  # restored, also after an error


def test_engine_clears_the_allocator_cache_when_the_batch_empties(monkeypatch):
    from types import SimpleNamespace

    from refusion_mlx.serve.core.engine import Engine

    cleared = []
    monkeypatch.setattr(mx, "clear_cache", lambda: cleared.append(1))
    engine = Engine()
    engine.gen = SimpleNamespace(remove=lambda uid: True)
    jobs = [SimpleNamespace(uid=uid, cache=None, kv_bytes=0, post=lambda *a: None,
                            request=SimpleNamespace(api="chat.completions")) for uid in (1, 2)]
    engine.running.update({job.uid: job for job in jobs})
    engine._close(jobs[0], "completed")
    assert not cleared  # one request still decodes: its buffers are reused
    engine._close(jobs[1], "cancelled")
    assert cleared == [1]


def test_attention_mode_is_read_from_the_environment(set_paths, monkeypatch):
    monkeypatch.setenv(backend.ATTENTION_ENV, " Unfused ")
    set_paths("gpu")
    assert backend.attention_mode() == "unfused" and not backend.fused_attention(1)
    monkeypatch.setenv(backend.ATTENTION_ENV, "fused")
    assert backend.attention_mode() == "fused" and backend.fused_attention(16)
    monkeypatch.setenv(backend.ATTENTION_ENV, "flash")
    with pytest.raises(backend.PathsError) as e:
        set_paths("gpu")  # a model load reads both settings: one line naming the bad one
    assert "REFUSION_MLX_ATTENTION='flash'" in str(e.value) and "auto, fused, unfused, bucketed" in str(e.value)
    assert "\n" not in str(e.value)


def test_auto_attention_is_fused_off_cuda_and_one_query_row_on_it(set_paths, monkeypatch):
    """On CUDA a fused call of several query rows goes to cuDNN, which plans
    every new shape (docs/benchmarks.md): auto keeps fused for one row only."""
    monkeypatch.delenv(backend.ATTENTION_ENV, raising=False)
    set_paths("gpu")
    monkeypatch.setattr(backend, "is_cuda", lambda: False)
    assert all(backend.fused_attention(t) for t in (1, 2, 16, 64))
    monkeypatch.setattr(backend, "is_cuda", lambda: True)
    assert backend.fused_attention(1)
    assert not any(backend.fused_attention(t) for t in (2, 3, 4, 16, 64))


def test_on_cuda_no_fused_call_has_several_query_rows(demo, golden_cases, set_paths, monkeypatch):
    """With CUDA's policy, decoding alone and in a batch never calls the fused
    kernel (cuDNN there: a graph per shape, "Cache thrashing" after 512) with
    more than one query row, and stays token-exact."""
    monkeypatch.delenv(backend.ATTENTION_ENV, raising=False)
    set_paths("gpu")
    monkeypatch.setattr(backend, "is_cuda", lambda: True)
    rows = []
    kernel = mx.fast.scaled_dot_product_attention

    def counted(q, *args, **kwargs):
        rows.append(q.shape[2])
        return kernel(q, *args, **kwargs)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", counted)
    from refusion_mlx.models import cpu_paths

    unfused = []
    plain = cpu_paths.unfused_attend

    def counted_unfused(q, *args):
        unfused.append(q.shape[2])
        return plain(q, *args)

    monkeypatch.setattr(cpu_paths, "unfused_attend", counted_unfused)
    model, tokenizer = demo
    cases = golden_cases[:8]
    for case in cases[:3]:
        assert decoded(model, tokenizer, case).response() == case["output_ids"]
    results = batch_generate(model, tokenizer, [c["prompt_ids"] for c in cases], [params_of(c) for c in cases],
                             max_batch=len(cases))
    assert [r.output_ids for r in results] == [c["output_ids"] for c in cases]
    assert all(r == 1 for r in rows) and unfused and max(unfused) > 1


def test_narrow_quantized_passes_are_padded_where_the_kernels_read_once(monkeypatch):
    """CUDA's quantized matmul streams the weights once a row under 8 rows and
    once from 8: 2-7 rows are padded to 8 there (elsewhere, or with the
    setting off, as given); the real rows' outputs are what they were."""
    import mlx.nn as nn

    from refusion_mlx.models.projections import PaddedQuantizedLinear, pad_quantized

    monkeypatch.setattr(backend, "is_cuda", lambda: True)
    assert [backend.quantized_rows(r) for r in (1, 2, 7, 8, 17)] == [1, 8, 8, 8, 17]
    with backend.setting(backend.PAD_ENV, "off"):
        assert backend.quantized_rows(3) == 3
    monkeypatch.setattr(backend, "is_cuda", lambda: False)
    assert backend.quantized_rows(3) == 3  # the CPU, and Metal until measured there
    monkeypatch.setenv(backend.PAD_ENV, "always")
    with pytest.raises(RefusionError) as e:
        backend.mode()  # read with the other switches, as a model load reads them
    assert "REFUSION_MLX_QMM_PAD='always'" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.delenv(backend.PAD_ENV)
    backend.mode()
    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(128, 96), nn.Linear(96, 64))
    nn.quantize(model, group_size=32, bits=4)
    x = mx.random.normal((1, 5, 128))
    before = model(x)
    assert pad_quantized(model) == 0  # here: the layers stay mlx's own
    calls = []
    real = mx.quantized_matmul
    monkeypatch.setattr(mx, "quantized_matmul", lambda a, *r, **k: calls.append(a.shape) or real(a, *r, **k))
    with backend.setting(backend.PAD_ENV, "on"):
        assert pad_quantized(model) == 2 and all(isinstance(m, PaddedQuantizedLinear) for m in model.layers)
        after = model(x)
    assert calls == [(8, 128), (8, 96)] and after.shape == before.shape  # each layer: 5 rows padded to 8
    assert mx.allclose(after, before, atol=1e-5).item()


def test_overlap_is_the_cpu_paths_unless_asked(set_paths, monkeypatch):
    for setting, gpu, cpu in (("", False, True), ("on", True, True), (" OFF ", False, False)):
        monkeypatch.setenv(backend.OVERLAP_ENV, setting)
        set_paths("gpu")
        assert backend.overlaps() == gpu
        set_paths("cpu")
        assert backend.overlaps() == cpu
    monkeypatch.setenv(backend.OVERLAP_ENV, "sometimes")
    with pytest.raises(RefusionError) as e:
        backend.overlap_mode()
    assert "REFUSION_MLX_OVERLAP='sometimes'" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.delenv(backend.OVERLAP_ENV)
    backend.overlap_mode()


def test_gpu_paths_overlap_when_asked_and_stay_token_exact(demo, golden_cases, set_paths, monkeypatch):
    """REFUSION_MLX_OVERLAP=on: a GPU-paths pass starts evaluating every L/8
    layers while the rest is built; the answers are the golden ones."""
    monkeypatch.setenv(backend.OVERLAP_ENV, "on")
    set_paths("gpu")
    started = []
    plain = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: started.append(len(a)) or plain(*a))
    model, tokenizer = demo
    layers = model.args.num_hidden_layers
    forwards = 0
    for case in golden_cases[:3]:
        decoder = decoded(model, tokenizer, case)
        assert decoder.response() == case["output_ids"]
        forwards += decoder.stats.forwards
    assert len(started) >= forwards * (layers // max(1, layers // 8))  # at least every L/8 layers of each


def test_a_setting_holds_for_its_block_and_is_restored(set_paths, monkeypatch):
    monkeypatch.delenv(backend.ATTENTION_ENV, raising=False)
    set_paths("cpu")
    with backend.setting(backend.ENV, "gpu"), backend.setting(backend.ATTENTION_ENV, "bucketed"):
        assert backend.gpu_paths() and backend.bucketed_attention(4)
    assert backend.cpu_paths() and backend.attention_mode() == "auto"
    assert backend.ATTENTION_ENV not in os.environ
