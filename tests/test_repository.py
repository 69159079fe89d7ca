"""The repository's shape: only the demo model, the test fixtures and the web page's screenshots are binary,
imports run one way between the package's layers, and the package never
imports the tooling beside it (convert/, benchmarks/, tests/) nor ships it;
no page, help text or public docstring sends a reader to REFUSION.md, the
specification kept outside this repository."""

import ast
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the demo model, the test fixtures, and the web page's screenshots that
# docs/serving.md shows (issue 27 asks for them; two PNGs, ~125 KB)
BINARY_HOMES = ("refusion_mlx/demo/", "tests/fixtures/", "docs/images/web-chat")

# A layer may import itself and the layers listed before it, never one after.
LAYERS = [
    {"_blas", "_cpu_jit", "_hf_index", "_malloc", "_startup", "_threads", "errors", "_callable", "_version", "_json", "distributed"},
    {"models"},
    {"decode"},
    {"cli"},  # the terminal: shared flags and one-line errors, the chat's loop, slot view and trace
    {"convert", "train"},
    {"serve"},
    {"bench"},
    {"generate", "chat", "server", "fuse", "__init__", "__main__"},  # the commands without a package of their own
]


def tracked_files():
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [f for f in out.stdout.decode().split("\0") if f]


def is_binary(path: Path) -> bool:
    return b"\0" in path.read_bytes()[:8192]


def test_only_the_demo_model_fixtures_and_screenshots_are_binary():
    files = tracked_files()
    assert "README.md" in files and any(f.startswith("refusion_mlx/demo/") for f in files)
    strays = [f for f in files if not f.startswith(BINARY_HOMES) and (ROOT / f).is_file() and is_binary(ROOT / f)]
    assert not strays, f"binary files outside {', '.join(BINARY_HOMES)}: {strays}"


def test_no_module_is_named_utils():
    assert not [p for p in (ROOT / "refusion_mlx").rglob("*.py") if p.stem == "utils"]


def _layer_of(parts):
    name = parts[0]
    for i, layer in enumerate(LAYERS):
        if name in layer:
            return i
    raise AssertionError(f"refusion_mlx.{name} is in no layer of tests/test_repository.py")


def _top(name: str):
    """``from refusion_mlx import name`` (or ``from . import name`` at the top): a module or
    subpackage, else a name the package's ``__init__`` gives."""
    package = ROOT / "refusion_mlx"
    return (name,) if (package / name).is_dir() or (package / f"{name}.py").is_file() else ("__init__",)


def _imported(source: str, package):
    """refusion_mlx submodules a module of ``package`` (its name parts below refusion_mlx) imports, as
    tuples of name parts: relative imports, ``from refusion_mlx(.x) import y`` and ``import refusion_mlx.x``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(package[: len(package) - (node.level - 1)])
            target = base + (node.module.split(".") if node.module else [])
            if target:
                yield tuple(target)
            else:  # "from . import x" at the top
                for alias in node.names:
                    yield _top(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module == "refusion_mlx":
            for alias in node.names:
                yield _top(alias.name)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("refusion_mlx."):
            yield tuple(node.module.split(".")[1:])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "refusion_mlx":
                    yield tuple(parts[1:]) or ("__init__",)


def _wrong_imports(rel, source: str):
    """The imports of the module ``rel`` (name parts below refusion_mlx) of a layer after its own."""
    here = _layer_of(rel)
    return [f"{'/'.join(rel)} imports {'.'.join(target)}" for target in _imported(source, rel[:-1])
            if _layer_of(target) > here]


def test_imports_run_one_way():
    wrong = []
    for path in (ROOT / "refusion_mlx").rglob("*.py"):
        wrong += _wrong_imports(path.relative_to(ROOT / "refusion_mlx").with_suffix("").parts, path.read_text())
    assert not wrong, wrong


def test_the_layer_check_sees_every_form_of_import():
    """``import refusion_mlx.x`` and ``from refusion_mlx import x`` were not read: a module of decode
    importing the server or the bench that way passed."""
    source = ("import refusion_mlx.serve.app\nfrom refusion_mlx import bench\nfrom refusion_mlx.serve import app\n"
              "from ..serve import app\nimport refusion_mlx\nfrom refusion_mlx import PRESETS\n"
              "from refusion_mlx import errors\nfrom .. import models\nimport numpy\n")
    assert _wrong_imports(("decode", "fit"), source) == [
        "decode/fit imports serve.app", "decode/fit imports bench", "decode/fit imports serve",
        "decode/fit imports serve", "decode/fit imports __init__", "decode/fit imports __init__"]
    assert _wrong_imports(("serve", "app"), source.replace("bench", "decode")) == [
        "serve/app imports __init__", "serve/app imports __init__"]


def test_the_package_never_imports_the_repository_tooling():
    """convert/ (PyTorch-side tooling), benchmarks/ (speed tools), tests/ and examples/ are not
    installed: a module of the package that imported them would work here and fail for every user."""
    outside = {"convert", "benchmarks", "tests", "examples"}
    wrong = []
    for path in (ROOT / "refusion_mlx").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            wrong += [f"{path.relative_to(ROOT)} imports {n}" for n in names if n.split(".")[0] in outside]
    assert not wrong, wrong


def test_the_tooling_is_not_packaged():
    """pyproject.toml installs refusion_mlx alone: the tooling folders run from a checkout."""
    import fnmatch

    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    include = config["packages"]["find"]["include"]
    for folder in ("convert", "benchmarks", "tests", "examples"):
        assert (ROOT / folder).is_dir() and not any(fnmatch.fnmatch(folder, p) for p in include), folder
    assert set(config["package-data"]) == {"refusion_mlx"}


def test_no_public_name_is_shadowed_by_a_submodule():
    """Importing a submodule binds its name on the package: an exported
    function of the same name would be replaced by a module
    (``refusion_mlx.train.evaluate`` was the trainer's function until something
    imported the exact-match CLI module). Either no submodule takes an exported
    name, or the module stays callable as that function (``_callable``)."""
    import importlib

    broken = []
    for init in sorted((ROOT / "refusion_mlx").rglob("__init__.py")):
        package = ".".join(init.relative_to(ROOT).parent.parts)
        module = importlib.import_module(package)
        submodules = {p.stem for p in init.parent.glob("*.py") if p.stem != "__init__"}
        submodules |= {p.name for p in init.parent.iterdir() if (p / "__init__.py").is_file()}
        for name in sorted(set(getattr(module, "__all__", ())) & submodules):
            before = getattr(module, name)
            importlib.import_module(f"{package}.{name}")
            if callable(before) and not callable(getattr(module, name)):
                broken.append(f"{package}.{name}")
    assert not broken, f"exported functions that a submodule import replaces: {broken}"


def test_the_trainers_evaluate_survives_every_import():
    import refusion_mlx.train as train
    import refusion_mlx.train.accuracy  # noqa: F401  (the exact-match CLI)

    assert callable(train.evaluate) and train.evaluate.__module__ == "refusion_mlx.train.trainer"


def _modules():
    """The package's modules and the speed tools beside it (one name, one home across both)."""
    return [p for folder in ("refusion_mlx", "benchmarks") for p in (ROOT / folder).rglob("*.py")]


def test_no_two_modules_share_a_name():
    """One name, one home: a command (``generate.py``, ``convert/__main__.py``)
    and the library code it calls never share a module or package name."""
    homes = {}
    for p in _modules():
        if p.stem == "__main__" or p.parent == ROOT / "refusion_mlx" and p.stem == "__init__":
            continue
        home = p.parent if p.stem == "__init__" else p  # a package is named by its folder
        homes.setdefault(home.stem, set()).add(str(home.relative_to(ROOT)))
    shared = {name: sorted(paths) for name, paths in homes.items() if len(paths) > 1}
    assert not shared, shared


def test_every_command_defines_main_where_python_m_runs_it():
    """``python -m refusion_mlx.X`` runs ``X.py`` or ``X/__main__.py``: that file defines ``main``."""
    commands = ["generate", "chat", "server", "fuse", "convert", "bench", "train", "train.accuracy"]
    missing = []
    for command in commands:
        path = ROOT / "refusion_mlx" / (command.replace(".", "/") + ".py")
        if not path.is_file():
            path = path.with_suffix("") / "__main__.py"
        tree = ast.parse(path.read_text())
        if not any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"commands whose main is defined elsewhere: {missing}"


def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


SPEC = "REFUSION.md"  # the algorithm's specification, kept outside this repository
OUTSIDE = "outside this repository"


def _paragraphs_citing_the_spec(text: str) -> list:
    """Paragraphs that name the specification without saying a reader does not have it."""
    return [p for p in text.split("\n\n") if SPEC in p and OUTSIDE not in " ".join(p.split())]


def test_no_doc_sends_a_reader_to_the_specification_file():
    """A reader has the paper and docs/design.md, not REFUSION.md: a page may name it for
    provenance only with "kept outside this repository" in the same paragraph."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").rglob("*.md"))]
    cited = {str(p.relative_to(ROOT)): found for p in pages if (found := _paragraphs_citing_the_spec(p.read_text()))}
    assert not cited, cited
    assert not any("docs/" + SPEC in p.read_text() for p in pages + _modules())


@pytest.mark.parametrize("module", ["generate", "chat", "server", "fuse", "convert.__main__", "bench.__main__",
                                    "train.__main__", "train.accuracy"])
def test_no_help_text_names_the_specification_file(module, capsys):
    main = importlib.import_module("refusion_mlx." + module).main
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert SPEC not in capsys.readouterr().out


def test_the_public_apis_docstrings_do_not_send_a_user_to_the_specification_file():
    """``help()`` on what ``import refusion_mlx`` exports, and on the modules they come from."""
    import refusion_mlx as rm
    seen = {}
    for name in rm.__all__:
        obj = getattr(rm, name)
        for doc_of in (obj, sys.modules.get(getattr(obj, "__module__", None) or "")):
            seen[f"{name}: {getattr(doc_of, '__name__', doc_of)}"] = inspect.getdoc(doc_of) or ""
        if inspect.isclass(obj):
            for attr, value in vars(obj).items():
                if not attr.startswith("_"):
                    seen[f"{name}.{attr}"] = inspect.getdoc(value) or ""
    seen["refusion_mlx.decode"] = sys.modules["refusion_mlx.decode"].__doc__
    cited = {where: found for where, doc in seen.items() if (found := _paragraphs_citing_the_spec(doc))}
    assert not cited, cited


def test_the_files_the_test_run_starts_with_are_there():
    """conftest's LONGEST_FIRST names test files: one renamed would silently go back to the end of the queue."""
    from tests.conftest import LONGEST_FIRST

    assert LONGEST_FIRST and all((ROOT / "tests" / name).is_file() for name in LONGEST_FIRST)
