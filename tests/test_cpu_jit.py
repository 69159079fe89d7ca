"""MLX's CPU kernels build against a precompiled preamble (``refusion_mlx/_cpu_jit.py``): built once per
machine where MLX's kernel sources find it first, with the flags MLX's library builds kernels with, and
taken by g++ for MLX's own kernels (a kernel built in ~1.3 CPU-s; ~0.25 s with it)."""

import os
import shutil
import subprocess
import sys
import time

import pytest

from refusion_mlx import _cpu_jit

pytestmark = pytest.mark.skipif(sys.platform != "linux" or shutil.which("g++") is None,
                                reason="MLX's CPU kernels are built with g++ on Linux only")

KERNEL = """
import mlx.core as mx
from refusion_mlx import _cpu_jit
made = _cpu_jit.prepare()
x = mx.arange(6, dtype=mx.float32)
fused = mx.compile(lambda x: mx.sin(x) * 2.5 + 0.75)(x)
print(made, mx.allclose(fused, mx.sin(x) * 2.5 + 0.75).item())
"""


def test_the_preamble_is_built_once_where_mlx_kernels_find_it_and_g_plus_plus_takes_it(tmp_path):
    assert _cpu_jit.mlx_flags() is not None, "MLX's kernel command was not found in its library"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", KERNEL], env=env, capture_output=True, text=True, timeout=300)
    made, right = out.stdout.split()
    kernels = tmp_path / "mlx" / _cpu_jit.kernel_dir().parent.name / "cpu"
    header = kernels / (_cpu_jit.PREAMBLE + ".gch")
    assert out.returncode == 0 and made == str(header) and header.is_file() and right == "True", out.stderr
    assert not list(header.parent.glob("*.part")) and not list(header.parent.glob("*.lock"))
    # one of the kernels MLX wrote, built as MLX builds it: g++ -H marks a precompiled header it used with "!"
    source = next(kernels.glob("*.cpp"))
    used = subprocess.run(["g++", *_cpu_jit.mlx_flags(), "-shared", "-H", "-I", str(_cpu_jit.include_dir()),
                           str(source), "-o", str(tmp_path / "k.so")], capture_output=True, text=True, timeout=300)
    assert used.returncode == 0 and f"! {header}" in used.stderr, used.stderr[-2000:]


def test_another_process_building_it_is_left_to_finish_and_a_stale_build_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    builds = []
    monkeypatch.setattr(_cpu_jit.subprocess, "run",
                        lambda args, **kw: builds.append(args) or open(args[-1], "wb").close() or
                        subprocess.CompletedProcess(args, 0))
    header = _cpu_jit.header_path()
    header.parent.mkdir(parents=True)
    lock = header.with_name(header.name + ".lock")
    lock.touch()
    assert _cpu_jit.prepare() is None and builds == [] and not header.exists()  # another process is at it
    old = time.time() - _cpu_jit.STALE_LOCK - 1
    os.utime(lock, (old, old))
    assert _cpu_jit.prepare() == header and len(builds) == 1 and header.is_file() and not lock.exists()
    assert _cpu_jit.prepare() == header and len(builds) == 1  # there: not built again


def test_it_is_left_out_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv(_cpu_jit.ENV, "off")
    assert _cpu_jit.prepare() is None and not (tmp_path / "mlx").exists()


def test_a_build_g_plus_plus_refuses_is_not_tried_again_at_every_load(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    builds = []
    monkeypatch.setattr(_cpu_jit.subprocess, "run",
                        lambda args, **kw: builds.append(args) or subprocess.CompletedProcess(args, 1))
    assert _cpu_jit.prepare() is None and _cpu_jit.prepare() is None and len(builds) == 1
    header = _cpu_jit.header_path()
    assert not header.exists() and header.with_name(header.name + ".failed").is_file()


def test_a_mistyped_switch_is_said_and_builds_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv(_cpu_jit.ENV, "of")
    assert _cpu_jit.prepare() is None and not (tmp_path / "mlx").exists()
    assert capsys.readouterr().err == (f"warning: {_cpu_jit.ENV}='of' is not a setting (off, or unset): "
                                       "left out\n")
