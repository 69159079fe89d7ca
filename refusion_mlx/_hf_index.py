"""transformers' table of its model folders, kept between processes.

``import transformers`` (under mlx-lm's tokenizer loader) reads each of the ~2,600 Python files under
``transformers/models`` for its ``__all__`` list, to build the table its lazy imports look names up in:
0.4 s of every command's start, with the same answer every time for the same files. The first process
stores the table in the user's cache folder (``$XDG_CACHE_HOME/refusion-mlx``, else
``~/.cache/refusion-mlx``), under the name, size and modification time of every file the scan reads; the
next ones read it back (a few milliseconds, with 25 ms to check the files). Whatever is not as expected
(another transformers, a changed file, an unreadable or damaged cache, a read-only home) leaves
transformers to its own scan."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from typing import Optional, Tuple

MODULE = "transformers.utils.import_utils"  # the module that builds the table
FUNCTION = "create_import_structure_from_path"  # its function: a folder -> its table, recursively
FORMAT = 1  # of the stored file: a new one is written where it differs


def cache_folder() -> Optional[str]:
    """``$XDG_CACHE_HOME/refusion-mlx``, else ``~/.cache/refusion-mlx``; None where neither is an absolute
    path (a relative XDG_CACHE_HOME is ignored, as the XDG spec says; a user without a home directory gets
    no cache, not a folder named "~" in the working directory)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        home = os.path.expanduser("~")
        base = os.path.join(home, ".cache") if os.path.isabs(home) else ""
    return os.path.join(base, "refusion-mlx") if base else None


def install() -> None:
    """Have the next ``import transformers`` use the stored table. Nothing to do where transformers is
    imported already (its table built) or the hook is in place."""
    if MODULE not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Finder:
    """Finds ``transformers.utils.import_utils`` as the import system would, and runs it with its
    table function wrapped (:func:`wrap`); every other module is left to the finders after it."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != MODULE:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        run = getattr(getattr(spec, "loader", None), "exec_module", None)
        if run is None:
            return spec

        def exec_module(module):
            run(module)
            wrap(module)

        spec.loader.exec_module = exec_module  # this spec's loader, made for it
        return spec


def wrap(module) -> None:
    """Make ``module``'s table function answer for the ``models`` folder from the cache."""
    original = getattr(module, FUNCTION, None)
    file = getattr(module, "__file__", None)
    if not callable(original) or not isinstance(file, str):
        return
    folder = _norm(os.path.join(os.path.dirname(os.path.dirname(file)), "models"))
    kept: list = []  # this process's stored form of the table, once known

    def table(module_path):
        given = os.fspath(module_path)
        if _norm(os.path.dirname(given) if os.path.isfile(given) else given) != folder:
            return original(module_path)
        if kept:  # transformers asks twice (for the package, then for models/__init__.py)
            return decode(kept[0])
        where = cache_file(folder)
        current = _stamp_or_none(folder) if where is not None else None
        read = load(where, current)
        if read is not None:
            kept.append(read[1])
            return read[0]
        found = original(module_path)
        stored = storable(found)
        if stored is not None:
            kept.append(stored)
            if current is not None:
                store(where, stored, current)
        return found

    table.__wrapped__ = original
    setattr(module, FUNCTION, table)


def _norm(path: str) -> str:
    return os.path.normcase(os.path.abspath(path))


def stamp(folder: str) -> str:
    """The name, size and modification time of every file the scan reads (``.py`` files, not
    ``__pycache__``), hashed."""
    digest = hashlib.sha256(f"{FORMAT}\0{folder}".encode())
    pending = [folder]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                if entry.is_dir(follow_symlinks=False):
                    if entry.name != "__pycache__":
                        pending.append(entry.path)
                elif entry.name.endswith(".py"):
                    st = entry.stat()
                    digest.update(f"{entry.path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def cache_file(folder: str) -> Optional[str]:
    """Where the table of the transformers whose ``models`` folder is ``folder`` is kept (one file each)."""
    cache = cache_folder()
    name = f"transformers-{hashlib.sha256(folder.encode()).hexdigest()[:16]}.json"
    return None if cache is None else os.path.join(cache, name)


def _stamp_or_none(folder: str) -> Optional[str]:
    try:
        return stamp(folder)
    except OSError:
        return None


def load(where: Optional[str], current: Optional[str]) -> Optional[Tuple[dict, list]]:
    """(the table, its JSON form) where it was stored at ``where`` for the files as they are now."""
    if where is None or current is None:
        return None
    try:
        with open(where, encoding="utf-8") as f:
            stored = json.load(f)
        if stored.get("stamp") == current:
            return decode(stored["table"]), stored["table"]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):  # none yet, unreadable, another shape
        pass
    return None


def storable(table) -> Optional[list]:
    """``table``'s JSON form where it reads back as an equal table; None where transformers' table has
    another shape than the one this module knows (it is then never stored, nor read)."""
    try:
        stored = encode(table)
        return stored if decode(stored) == table else None
    except Exception:  # noqa: BLE001 (whatever the shape, transformers' import goes on with its own table)
        return None


def store(where: str, stored: list, current: str) -> None:
    """Write the table's JSON form to ``where`` (whole or not at all: a file of its own, renamed into place)."""
    try:
        os.makedirs(os.path.dirname(where), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(where), prefix=".transformers-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"stamp": current, "table": stored}, f, separators=(",", ":"))
            os.replace(tmp, where)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:  # a read-only or full home: the next process scans again
        pass


def encode(table: dict) -> list:
    """A folder's table as JSON: a sub-folder's entry ``[name, its table]``; a set of backends' entry
    ``[backends, {module: names}]`` (a list where the table has a frozenset or a set)."""
    out = []
    for key, value in table.items():
        if isinstance(key, str):
            out.append([key, encode(value)])
        else:
            out.append([sorted(key), {module: sorted(names) for module, names in value.items()}])
    return out


def decode(stored: list) -> dict:
    """:func:`encode`'s table back; TypeError or ValueError for anything else."""
    table: dict = {}
    for key, value in stored:
        if isinstance(key, str):
            table[key] = decode(value)
        elif _strings(key) and isinstance(value, dict) and all(_strings(names) for names in value.values()):
            table[frozenset(key)] = {module: set(names) for module, names in value.items()}
        else:
            raise TypeError("not a table")
    return table


def _strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)
