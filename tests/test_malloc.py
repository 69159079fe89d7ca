"""Large MLX buffers on Linux reuse the C allocator's heap instead of fresh pages (``refusion_mlx/_malloc.py``)."""

import platform
import resource
import subprocess
import sys

import mlx.core as mx
import pytest

from refusion_mlx import _malloc

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# ops on a 64 MB array (over glibc's largest mmap threshold, 32 MiB), after a first one: page faults in the last
FAULTS = """
import resource, mlx.core as mx
x = mx.ones((4096, 4096))
mx.eval(x + 1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    mx.eval(x + 1)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_a_large_array_reuses_freed_memory_and_the_system_allocator_does_not():
    assert _malloc.keep_buffers()
    x = mx.ones((4096, 4096))
    mx.eval(x + 1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        mx.eval(x + 1)
    kept = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    # the same ops where the user keeps glibc's defaults: a page fault per 4 KiB of every result
    system = subprocess.run([sys.executable, "-c", FAULTS], env={"REFUSION_MLX_MALLOC": "system", "PATH": ""},
                            capture_output=True, text=True, check=True)
    assert kept < 1000 and int(system.stdout) > 3 * 16000, (kept, system.stdout, system.stderr)


@pytest.mark.parametrize("env", [{"REFUSION_MLX_MALLOC": "system"}, {"MALLOC_TRIM_THRESHOLD_": "0"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}])
def test_the_users_own_allocator_settings_are_left_alone(monkeypatch, env):
    calls = []
    monkeypatch.setattr(_malloc.ctypes, "CDLL", lambda *a: calls.append(a))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert _malloc._tune() is False and calls == []


def test_a_mistyped_setting_is_said_and_changes_nothing(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(_malloc.ctypes, "CDLL", lambda *a: calls.append(a))
    monkeypatch.setenv(_malloc.ENV, "sytem")
    assert _malloc._tune() is False and calls == []
    assert capsys.readouterr().err == (f"warning: {_malloc.ENV}='sytem' is not a setting (system, or unset): "
                                       "glibc's malloc left as it is\n")
