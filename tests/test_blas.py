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
