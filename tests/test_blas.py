"""The optimized-BLAS arrangement on Linux: preload and thread policy."""

import base64
import hashlib
import os
import re
import subprocess
import sys
import zipfile

import pytest

import refusion_mlx._blas as blas

THREAD_VARS = {v for names in blas.USER_THREAD_VARS.values() for v in names}


class FakeOpenBLAS:
    def __init__(self):
        self.calls = []

    def openblas_set_num_threads(self, n):
        self.calls.append(n)


class FakeMKL:
    def __init__(self):
        self.calls = []

    def MKL_Set_Num_Threads(self, n):
        self.calls.append(n)


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    """No thread count chosen in the environment; the module's thread state
    restored afterwards (the real library's count is left as it was)."""
    for name in THREAD_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(blas, "_threads", None)
    monkeypatch.setattr(blas, "_before", None)
    monkeypatch.setattr(blas, "_small_model", False)
    monkeypatch.setattr(blas, "mlx_first", False)


def test_small_models_get_one_blas_thread(monkeypatch):
    fake = FakeOpenBLAS()
    monkeypatch.setattr(blas, "_library", fake)
    monkeypatch.setattr(blas, "threads", lambda: 3)  # the library's own count
    assert blas.fit_threads(1024) is None and fake.calls == []  # a large model first: nothing to set
    assert blas.fit_threads(256) == 1 and fake.calls == [1]
    # a large model after a small one gets the library's count back, not the small one's single thread
    assert blas.fit_threads(1024) == 3 and not blas.small_model() and fake.calls == [1, 3]
    assert blas.fit_threads(1024) == 3 and fake.calls == [1, 3]


def test_wide_forwards_of_small_models_use_every_core(monkeypatch):
    fake = FakeOpenBLAS()
    monkeypatch.setattr(blas, "_library", fake)
    monkeypatch.setattr(blas.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(blas, "threads", lambda: None)  # a library that does not say its count: every core
    assert blas.fit_threads(256) == 1
    assert blas.fit_rows(12) == 1 and blas.fit_rows(blas.WIDE_ROWS) == 4 and blas.fit_rows(100) == 4
    assert blas.fit_rows(3) == 1 and fake.calls == [1, 4, 1]  # set only when it changes
    assert blas.fit_threads(1024) == 4 and blas.fit_rows(500) is None  # the count back, then not ours to set


def test_the_users_thread_count_wins(monkeypatch):
    fake = FakeOpenBLAS()
    monkeypatch.setattr(blas, "_library", fake)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    assert blas.fit_threads(256) is None and fake.calls == []


def test_mkl_threads_go_through_mkls_setter(monkeypatch):
    fake = FakeMKL()
    monkeypatch.setattr(blas, "_library", fake)
    monkeypatch.setattr(blas.os, "cpu_count", lambda: 2)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")  # OpenBLAS's variable: not MKL's business
    assert blas.fit_threads(256) == 1 and blas.fit_rows(blas.WIDE_ROWS) == 2 and fake.calls == [1, 2]


@pytest.mark.parametrize("name", ["MKL_NUM_THREADS", "OMP_NUM_THREADS"])
def test_the_users_mkl_thread_count_wins(monkeypatch, name):
    fake = FakeMKL()
    monkeypatch.setattr(blas, "_library", fake)
    monkeypatch.setenv(name, "2")
    assert blas.fit_threads(256) is None and blas.fit_rows(100) is None and fake.calls == []


def test_nothing_to_tune_without_an_optimized_blas(monkeypatch):
    monkeypatch.setattr(blas, "_library", None)
    assert blas.fit_threads(256) is None
    monkeypatch.setattr(blas, "_library", object())  # a library with no known setter
    assert blas.fit_threads(256) is None


def test_opt_out_and_late_import_skip_the_preload(monkeypatch):
    monkeypatch.setenv(blas.ENV, "bundled")
    assert blas.preload() is None
    monkeypatch.setenv(blas.ENV, "auto")
    assert blas.preload() is None  # mlx.core is already imported: too late to interpose


def test_system_openblas_comes_before_the_environments_mkl(monkeypatch, tmp_path):
    for name in ("libmkl_rt.so", "libmkl_rt.so.2", "libmkl_rt.so.3"):
        (tmp_path / name).write_bytes(b"")
    monkeypatch.setattr(blas, "library_roots", lambda: [str(tmp_path)])
    mkl = [str(tmp_path / n) for n in ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so")]
    assert blas.mkl_candidates() == mkl
    assert blas.candidates() == blas.CANDIDATES + mkl


def test_mkl_is_searched_in_the_environment_and_the_user_scheme():
    roots = blas.library_roots()
    assert os.path.join(sys.prefix, "lib") == roots[0]
    assert os.path.join(sys.base_prefix, "lib") in roots


def test_mkl_threads_is_mkls_count_and_none_for_another_blas(monkeypatch):
    """``cpu_paths.lay_out_linears`` asks it: MKL's thread count, None for OpenBLAS or no BLAS."""
    mkl = FakeMKL()
    mkl.MKL_Get_Max_Threads = lambda: 3
    monkeypatch.setattr(blas, "_library", mkl)
    assert blas.mkl_threads() == 3
    openblas = FakeOpenBLAS()
    openblas.openblas_get_num_threads = lambda: 3
    monkeypatch.setattr(blas, "_library", openblas)
    assert blas.threads() == 3 and blas.mkl_threads() is None
    monkeypatch.setattr(blas, "_library", None)
    monkeypatch.setattr(blas, "_mapped_libraries", lambda: [])
    assert blas.mkl_threads() is None


def test_blas_in_use_names_a_library():
    assert blas.blas_in_use() and blas.describe()


def test_reference_warning_only_without_an_optimized_blas(monkeypatch):
    monkeypatch.setattr(blas, "_library", None)
    monkeypatch.setattr(blas.sys, "platform", "linux")
    monkeypatch.delenv(blas.ENV, raising=False)
    monkeypatch.setattr(blas, "_mapped_libraries", lambda: ["/x/libblas-bd8a282c.so.3.10.0"])
    warning = blas.reference_warning()
    assert "reference BLAS" in warning and "libopenblas0-pthread" in warning and "\n" not in warning
    assert ("pip install mkl" in warning) == (os.uname().machine == "x86_64")
    assert blas.describe().startswith("reference BLAS")
    for mapped in ("/usr/lib/x86_64-linux-gnu/libopenblas.so.0", "/env/lib/libmkl_rt.so.3"):
        monkeypatch.setattr(blas, "_mapped_libraries", lambda: [mapped])
        assert blas.reference_warning() is None
    monkeypatch.setattr(blas, "_library", FakeMKL())  # preloaded
    monkeypatch.setattr(blas, "_mapped_libraries", lambda: [])
    assert blas.reference_warning() is None


def _run(code, **env):
    base = {"PATH": "/usr/bin:/bin", **env}
    out = subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\n")


@pytest.mark.skipif(sys.platform != "linux", reason="the preload is Linux's")
def test_the_opt_out_runs_on_the_reference_blas_and_says_so():
    code = ("import refusion_mlx, refusion_mlx._blas as b, mlx.core as mx; "
            "mx.set_default_device(mx.cpu); print(b.describe()); print(b.reference_warning())")
    describe, warning = _run(code, REFUSION_MLX_BLAS="bundled")[:2]
    assert describe.startswith("reference BLAS") and "REFUSION_MLX_BLAS=bundled" in warning


@pytest.mark.skipif(sys.platform != "linux" or not blas.mkl_candidates(), reason="no pip-installed MKL here")
@pytest.mark.parametrize("with_openmp", [True, False])
def test_preload_finds_the_environments_mkl_without_a_system_openblas(tmp_path, with_openmp):
    """A fake environment whose lib/ links to the real MKL files, and no system
    OpenBLAS to find: the preload loads that MKL, MLX's matmuls run on it, and
    the threading layer is INTEL beside libiomp5, SEQUENTIAL without."""
    real = os.path.dirname(blas.mkl_candidates()[0])
    lib = tmp_path / "lib"
    lib.mkdir()
    for name in os.listdir(real):
        if name.startswith("libmkl_") or (with_openmp and name.startswith("libiomp5")):
            (lib / name).symlink_to(os.path.join(real, name))
    code = (
        "import os; import refusion_mlx._blas as b; os.environ.pop('REFUSION_MLX_BLAS'); "
        f"b.CANDIDATES = ['/nonexistent/libopenblas.so.0']; b.library_roots = lambda: [{str(lib)!r}]; "
        "print(b.preload()); print(b.mkl_layer); "
        "import mlx.core as mx; mx.set_default_device(mx.cpu); "
        "a = mx.ones((64, 64)); print(float((a @ a)[0, 0])); print(b.describe())"
    )
    # bundled while refusion_mlx is imported (its own preload); cleared for ours
    path, layer, value, describe = _run(code, REFUSION_MLX_BLAS="bundled")[:4]
    assert path.startswith(str(lib)) and os.path.basename(path).startswith("libmkl_rt.so")
    assert layer == ("INTEL" if with_openmp else "SEQUENTIAL")
    assert value == "64.0" and describe.startswith("MKL ") and layer in describe


@pytest.mark.skipif(sys.platform != "linux" or not blas.mkl_candidates(), reason="no pip-installed MKL here")
def test_the_users_threading_layer_wins():
    code = "import refusion_mlx, refusion_mlx._blas as b; print(b.preloaded); print(b.mkl_layer)"
    env = {"MKL_THREADING_LAYER": "SEQUENTIAL"}
    if any(os.path.exists(p) for p in blas.CANDIDATES):
        pytest.skip("a system OpenBLAS is preloaded first")
    path, layer = _run(code, **env)[:2]
    assert "libmkl_rt" in path and layer == "None"


@pytest.mark.skipif(sys.platform != "linux", reason="the preload is Linux's")
def test_wide_matmuls_stay_right_after_torch_brings_libgomp():
    """torch (transformers imports it) loads libgomp with global visibility.
    MKL's INTEL threading then bound its OpenMP calls to libgomp: a 2-thread
    matmul after the thread fitting left rows unwritten (errors ~67). The
    preload loads libiomp5 first, so they bind to it."""
    pytest.importorskip("torch")
    code = (
        "import refusion_mlx._blas as b, torch, mlx.core as mx, numpy as np; mx.set_default_device(mx.cpu); "
        "b.fit_threads(256); b.fit_rows(96); rng = np.random.default_rng(0); "
        "a = rng.standard_normal((96, 256)).astype(np.float32); w = rng.standard_normal((768, 256)).astype(np.float32); "
        "print(float(np.abs(np.array(mx.array(a) @ mx.array(w).T) - a @ w.T).max())); print(b.describe())"
    )
    error, describe = _run(code)[:2]
    assert float(error) < 1e-3, describe


def test_preload_keeps_the_library_for_the_thread_policy(tmp_path):
    """A fresh process that preloads a library keeps its handle: fit_threads needs it."""
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


def test_the_test_run_names_its_blas_even_when_quiet():
    """The README's test command is ``pytest -q``, which hides pytest's header:
    the BLAS line (and the fix, on the reference BLAS) is written anyway."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    test = "tests/test_blas.py::test_blas_in_use_names_a_library"
    # without the plugins of packages installed beside, which this run never uses: langsmith's and
    # hypothesis's imports are ~3.5 of a run's ~5 s of CPU
    quiet = ["-q", "-p", "no:cacheprovider", "-p", "no:langsmith_plugin", "-p", "no:hypothesispytest"]
    for env, expect in (({}, None), ({"REFUSION_MLX_BLAS": "bundled"}, "WARNING: slow reference BLAS")):
        out = subprocess.run([sys.executable, "-m", "pytest", *quiet, test], cwd=root,
                             env={**os.environ, **env}, capture_output=True, text=True, timeout=120).stdout
        lines = out.splitlines()
        assert lines[0].startswith("BLAS: "), out
        if expect:
            assert lines[1].startswith(expect) and "reference BLAS" in lines[0]


# The start-up hook (_refusion_mlx_blas.py, run by refusion_mlx_blas.pth): MLX's
# matmuls on the optimized BLAS whatever the import order.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SGEMM = re.compile(r"binding file (.+?) \[\d+\] to (.+?) \[\d+\]: normal symbol `cblas_sgemm'")
SYMBOL = b"`cblas_sgemm'"


def _optimized_here():
    return sys.platform == "linux" and any(os.path.exists(p) for p in blas.candidates())


def _sgemm_bindings(log: bytes):
    """(file, library) of each binding of cblas_sgemm in a dynamic linker's log. The log of a process that
    imports PyTorch is some 27 MB: the symbol's lines are found as bytes first, and only they are matched
    (SGEMM run over the whole text took about 1 s of CPU a process)."""
    at = log.find(SYMBOL)
    while at >= 0:
        line = log[log.rfind(b"\n", 0, at) + 1:at + len(SYMBOL)].decode(errors="replace")
        match = SGEMM.search(line)
        if match:
            yield match.groups()
        at = log.find(SYMBOL, at + 1)


def _traced(args, tmp_path, **env):
    """Run Python from the repository's root with the dynamic linker logging its
    symbol bindings; return (stdout lines, stderr, the file libmlx's
    cblas_sgemm was bound to)."""
    log = tmp_path / "ld"
    env = {"PATH": "/usr/bin:/bin", "LD_DEBUG": "bindings", "LD_DEBUG_OUTPUT": str(log), **env}
    out = subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    bound = [to for f in tmp_path.glob("ld.*") for by, to in _sgemm_bindings(f.read_bytes())
             if os.path.basename(by) == "libmlx.so"]
    assert len(bound) == 1, bound
    return out.stdout.splitlines(), out.stderr, os.path.realpath(bound[0])


def test_the_pth_line_runs_the_hook_and_never_raises(tmp_path):
    hook = pytest.importorskip("_refusion_mlx_blas")
    assert hook.OPT_OUT == blas.OPT_OUT and hook.ENV == blas.ENV
    assert hook.PTH_LINE.startswith("import ") and hook.PTH_LINE.count("\n") == 1  # one line site.py runs
    (tmp_path / hook.PTH_NAME).write_text(hook.PTH_LINE)
    for cwd, expect in ((ROOT, "True"), (str(tmp_path), "False")):  # the module there, or gone
        out = subprocess.run([sys.executable, "-S", "-c", f"import site, sys; site.addsitedir({str(tmp_path)!r}); "
                              "print(any(type(f).__name__ == 'BeforeMLX' for f in sys.meta_path))"],
                             cwd=cwd, env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stderr == "" and out.stdout.split() == [
            expect if sys.platform == "linux" else "False"], out.stderr


def test_the_hook_does_nothing_on_macos_when_opted_out_or_too_late(monkeypatch):
    hook = pytest.importorskip("_refusion_mlx_blas")
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    hook.uninstall()
    assert not hook.install()  # mlx.core is imported here: nothing left to bind
    monkeypatch.delitem(sys.modules, "mlx.core")
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv(hook.ENV, "bundled")
    assert not hook.install() and not hook.installed()
    monkeypatch.setenv(hook.ENV, "auto")
    assert hook.install() and hook.install() and sum(isinstance(f, hook.BeforeMLX) for f in sys.meta_path) == 1
    assert isinstance(sys.meta_path[0], hook.BeforeMLX)
    hook.uninstall()
    monkeypatch.setattr(sys, "platform", "darwin")
    assert not hook.install() and not hook.installed()


def _installed_pth():
    import site

    from _refusion_mlx_blas import PTH_NAME

    return any(os.path.exists(os.path.join(d, PTH_NAME)) for d in site.getsitepackages())


@pytest.mark.skipif(not _optimized_here(), reason="no optimized BLAS to bind here")
@pytest.mark.parametrize("pth", ["read here", "installed"])
def test_mlx_core_imported_first_still_runs_on_the_optimized_blas(tmp_path, pth):
    """A program that imports mlx.core before refusion_mlx, with the .pth file
    read as site.py reads it at start-up ("read here"), or as pip installed it
    in this environment: the dynamic linker binds libmlx's cblas_sgemm to the
    library the hook preloaded, and no warning."""
    import _refusion_mlx_blas as hook

    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / hook.PTH_NAME).write_text(hook.PTH_LINE)
    start = f"import site; site.addsitedir({str(site_dir)!r}); "
    if pth == "installed":
        if not _installed_pth():
            pytest.skip("refusion-mlx is not pip-installed with its start-up hook here")
        start = ""
    code = (start + "import mlx.core as mx; import refusion_mlx._blas as b; mx.set_default_device(mx.cpu); "
            "a = mx.ones((64, 64)); print(float((a @ a)[0, 0])); print(b.preloaded); print(b.describe()); "
            "print(b.warn_once())")
    (value, preloaded, describe, warning), err, bound = _traced(["-c", code], tmp_path)
    assert value == "64.0" and bound == os.path.realpath(preloaded) and "libblas" not in bound
    assert not describe.startswith("reference") and warning == "None" and "WARNING" not in err


@pytest.mark.skipif(sys.platform != "linux", reason="the preload is Linux's")
@pytest.mark.parametrize("opt_out", [False, True])
def test_without_the_hook_the_first_load_says_so_once(tmp_path, opt_out):
    """``python -S`` reads no .pth file: mlx.core imported first stays on the
    reference BLAS, and the first model load says so in one line with the fix
    (none when REFUSION_MLX_BLAS chose the reference BLAS)."""
    import site

    code = ("import mlx.core as mx; from refusion_mlx.models.loading import load; "
            "import refusion_mlx._blas as b; mx.set_default_device(mx.cpu); load(); load(); print(b.describe())")
    env = {"PYTHONPATH": os.pathsep.join(site.getsitepackages()), **({blas.ENV: "bundled"} if opt_out else {})}
    (describe,), err, bound = _traced(["-S", "-c", code], tmp_path, **env)
    assert describe.startswith("reference BLAS") and "libblas" in os.path.basename(bound)
    warnings = [line for line in err.splitlines() if "reference BLAS" in line]
    if opt_out:
        assert warnings == []
        return
    assert len(warnings) == 1 and warnings[0].startswith("WARNING: slow reference BLAS in use"), err
    fix = "import refusion_mlx first" if _optimized_here() else "libopenblas0-pthread"
    assert fix in warnings[0]


def test_the_backend_lists_the_pth_file_in_the_wheels_record(tmp_path):
    pytest.importorskip("setuptools")
    sys.path.insert(0, ROOT)
    try:
        import build_backend
        from _refusion_mlx_blas import PTH_LINE, PTH_NAME
    finally:
        sys.path.remove(ROOT)
    wheel = tmp_path / "x-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as whl:
        whl.writestr("x/__init__.py", "")
        whl.writestr("x-1.0.dist-info/RECORD", "x/__init__.py,sha256=47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU,0\n"
                                                "x-1.0.dist-info/RECORD,,\n")
    build_backend.add_file(str(wheel), PTH_NAME, PTH_LINE.encode())
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        record = whl.read("x-1.0.dist-info/RECORD").decode().splitlines()
        assert whl.read(PTH_NAME).decode() == PTH_LINE
    assert names == ["x/__init__.py", PTH_NAME, "x-1.0.dist-info/RECORD"]
    digest = base64.urlsafe_b64encode(hashlib.sha256(PTH_LINE.encode()).digest()).rstrip(b"=").decode()
    assert record[-1] == f"{PTH_NAME},sha256={digest},{len(PTH_LINE.encode())}" and len(record) == 3
