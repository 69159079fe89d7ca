"""transformers' table of its model folders, kept between processes (``refusion_mlx._hf_index``)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

from refusion_mlx import _hf_index

ROOT = Path(__file__).resolve().parents[1]

TWICE = """
import sys
sys.modules.setdefault("torch", None)  # as the commands keep it out
from refusion_mlx import _hf_index
_hf_index.install()
from pathlib import Path
import transformers
import transformers.utils.import_utils as iu
from transformers import AutoTokenizer, PreTrainedTokenizerFast
table = iu.create_import_structure_from_path
print(table.__module__, table.__wrapped__.cache_info().misses)
if sys.argv[1] == "check":  # the stored table, against a scan now
    models = Path(transformers.__file__).parent / "models"
    print(table(models) == table.__wrapped__.__wrapped__(models))
"""


def test_a_second_process_reads_transformers_table_and_it_is_the_scans(tmp_path):
    """The first process scans (transformers' own lookups of its ~570 model folders) and stores the
    table; the next one looks up only the folders of the packages it imports (models/auto), and its
    table is what a scan finds."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}

    def run(mode):
        out = subprocess.run([sys.executable, "-c", TWICE, mode], env=env, cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    module, scanned = run("first")
    assert module == "refusion_mlx._hf_index" and int(scanned) > 500
    assert len(list((tmp_path / "refusion-mlx").glob("transformers-*.json"))) == 1
    module, scanned, same = run("check")
    assert module == "refusion_mlx._hf_index" and int(scanned) < 5 and same == "True"


TABLE = {"a": {frozenset({"tokenizers"}): {"x": {"X", "Y"}}, frozenset(): {"y": set()}}}


def fake_transformers(root: Path, made: dict = TABLE):
    """A package laid out as transformers is (``utils/import_utils.py`` beside ``models/``), with a
    table function that counts its scans and answers ``made``."""
    (root / "utils").mkdir(parents=True)
    (root / "utils" / "import_utils.py").write_text("")
    (root / "models" / "a").mkdir(parents=True)
    (root / "models" / "__init__.py").write_text("")
    (root / "models" / "a" / "x.py").write_text("__all__ = ['X']\n")
    scans = []

    def scan(path):
        scans.append(os.fspath(path))
        return made

    def module():  # as each process imports it afresh
        m = types.SimpleNamespace(__file__=str(root / "utils" / "import_utils.py"),
                                  create_import_structure_from_path=scan)
        _hf_index.wrap(m)
        return m.create_import_structure_from_path

    return module, scans


def test_the_table_is_scanned_once_then_read_until_a_file_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    module, scans = fake_transformers(tmp_path / "tf")
    models = tmp_path / "tf" / "models"
    expected = TABLE
    table = module()
    assert table(models) == expected and len(scans) == 1
    assert table(str(models / "__init__.py")) == expected and len(scans) == 1  # transformers' second ask
    table(models / "a")  # any other folder is transformers' own to scan
    assert len(scans) == 2
    assert module()(models) == expected and len(scans) == 2  # the next process reads it
    (models / "a" / "x.py").write_text("__all__ = ['X', 'Y']\n")
    assert module()(models) == expected and len(scans) == 3  # a changed file: scanned again, stored
    assert module()(models) == expected and len(scans) == 3


def test_a_damaged_or_unwritable_cache_is_a_scan(tmp_path, monkeypatch):
    module, scans = fake_transformers(tmp_path / "tf")
    models = tmp_path / "tf" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    module()(models)
    [stored] = (tmp_path / "cache" / "refusion-mlx").glob("transformers-*.json")
    current = _hf_index.stamp(_hf_index._norm(str(models)))
    for damaged in ("{", "[]", '{"stamp": "%s", "table": [[1, 2]]}' % current,
                    '{"stamp": "%s", "table": [[["tokenizers"], {"x": "XY"}]]}' % current):
        stored.write_text(damaged)
        before = len(scans)
        assert module()(models)["a"][frozenset()] == {"y": set()} and len(scans) == before + 1, damaged
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))  # no folder can be made there
    before = len(scans)
    assert module()(models)["a"][frozenset({"tokenizers"})] == {"x": {"X", "Y"}} and len(scans) == before + 1
    assert not list((tmp_path / "cache" / "refusion-mlx").glob(".transformers-*"))  # no temporary file left


def test_a_table_of_another_shape_is_never_stored(tmp_path, monkeypatch):
    """A later transformers whose table holds lists, or keys of another kind: its own table, each time."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for i, made in enumerate(({"a": {frozenset(): {"x": ["X"]}}}, {"a": {("tokenizers",): {"x": {"X"}}}},
                              {"a": {frozenset(): [("x", {"X"})]}})):
        module, scans = fake_transformers(tmp_path / f"tf{i}", made)
        models = tmp_path / f"tf{i}" / "models"
        assert module()(models) is made and module()(models) is made and len(scans) == 2
    assert not (tmp_path / "cache").exists()


def test_the_cache_folder_is_an_absolute_path_or_none(tmp_path, monkeypatch):
    """A relative XDG_CACHE_HOME is ignored (the XDG spec's rule); a user without a home directory has no
    cache, and no folder named "~" appears in the working directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _hf_index.cache_folder() == str(tmp_path / "xdg" / "refusion-mlx")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _hf_index.cache_folder() == str(tmp_path / "home" / ".cache" / "refusion-mlx")
    monkeypatch.setattr(_hf_index.os.path, "expanduser", lambda path: path)  # no home to expand "~" to
    assert _hf_index.cache_folder() is None
    module, scans = fake_transformers(tmp_path / "tf")
    monkeypatch.chdir(tmp_path)
    assert module()(tmp_path / "tf" / "models") == TABLE and module()(tmp_path / "tf" / "models") == TABLE
    assert len(scans) == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["tf"]


def test_install_hooks_transformers_first_import_once(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, _hf_index._Finder)])
    monkeypatch.delitem(sys.modules, _hf_index.MODULE, raising=False)
    _hf_index.install()
    _hf_index.install()
    assert sum(isinstance(f, _hf_index._Finder) for f in sys.meta_path) == 1
    assert sys.meta_path[0].find_spec("json") is None  # every other module is the other finders'
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, _hf_index._Finder)])
    monkeypatch.setitem(sys.modules, _hf_index.MODULE, types.ModuleType(_hf_index.MODULE))
    _hf_index.install()  # imported already: its table is built
    assert not any(isinstance(f, _hf_index._Finder) for f in sys.meta_path)
