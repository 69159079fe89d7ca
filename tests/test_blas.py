"""The optimized-BLAS arrangement on Linux: preload and thread policy."""

import refusion_mlx._blas as blas


class FakeOpenBLAS:
    def __init__(self):
        self.calls = []

    def openblas_set_num_threads(self, n):
        self.calls.append(n)


def test_small_models_get_one_blas_thread(monkeypatch):
    fake = FakeOpenBLAS()
    monkeypatch.setattr(blas, "_library", fake)
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    assert blas.fit_threads(256) == 1 and fake.calls == [1]
    assert blas.fit_threads(1024) is None and fake.calls == [1]


def test_wide_forwards_of_small_models_use_every_core(monkeypatch):
    fake = FakeOpenBLAS()
    monkeypatch.setattr(blas, "_library", fake)
    monkeypatch.setattr(blas.os, "cpu_count", lambda: 4)
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    assert blas.fit_threads(256) == 1
    assert blas.fit_rows(12) == 1 and blas.fit_rows(blas.WIDE_ROWS) == 4 and blas.fit_rows(100) == 4
    assert blas.fit_rows(3) == 1 and fake.calls == [1, 4, 1]  # set only when it changes
    assert blas.fit_threads(1024) is None and blas.fit_rows(500) is None  # big models: not ours to set


def test_the_users_thread_count_wins(monkeypatch):
    fake = FakeOpenBLAS()
    monkeypatch.setattr(blas, "_library", fake)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    assert blas.fit_threads(256) is None and fake.calls == []


def test_nothing_to_tune_without_openblas(monkeypatch):
    monkeypatch.setattr(blas, "_library", None)
    assert blas.fit_threads(256) is None


def test_opt_out_and_late_import_skip_the_preload(monkeypatch):
    monkeypatch.setenv(blas.ENV, "bundled")
    assert blas.preload() is None
    monkeypatch.setenv(blas.ENV, "auto")
    assert blas.preload() is None  # mlx.core is already imported: too late to interpose


def test_blas_in_use_names_a_library():
    assert blas.blas_in_use()


def test_preload_keeps_the_library_for_the_thread_policy(tmp_path):
    """A fresh process that preloads a library keeps its handle: fit_threads needs it."""
    import subprocess
    import sys

    maps = open("/proc/self/maps").read() if sys.platform == "linux" else ""
    libm = next((line.split()[-1] for line in maps.splitlines() if "/libm.so" in line), None)
    assert sys.platform != "linux" or libm, "no libm mapped on Linux?"
    code = ("import refusion_mlx._blas as b, sys; "
            "print(b.preloaded, b._library is not None, 'mlx.core' in sys.modules)")
    env = {"REFUSION_MLX_BLAS": libm or "auto", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    if sys.platform == "linux":
        assert out.stdout.split() == [libm, "True", "False"]
    else:
        assert out.stdout.split()[:2] == ["None", "False"]
