"""What a device run measured, stamped into its folder before it starts:

    python -m benchmarks.run_stamp OUT      # benchmarks/gpu_record.sh runs it: OUT/run.json

``run.json`` holds ``date`` (the run's UTC day), ``started`` (UTC, to the
second), ``tree`` and ``commit``. ``tree`` is a sha256 over the path and git
blob id of every file under ``refusion_mlx/`` and ``benchmarks/`` (the
records and caches left out), computed from the files themselves: a lent
GPU's copy of the checkout has no ``.git``. ``commit`` is the commit of this
checkout whose files have that id, where git works (else null).
``python -m benchmarks.gpu_record`` finds the commit again from ``tree``.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional

from refusion_mlx.cli import OneLineParser, run
from refusion_mlx.errors import RefusionError

CHECKOUT = Path(__file__).resolve().parents[1]
SOURCES = ("refusion_mlx", "benchmarks")
SKIPPED = {"__pycache__", ".pytest_cache", "bench_out", "build", "dist"}  # as .gitignore has them
DEPTH = 300  # the commits searched for a tree, newest first


def kept(path: str) -> bool:
    """Whether the file at ``path`` (relative, with /) is part of the tree measured."""
    parts = path.split("/")
    return (parts[0] in SOURCES and parts[:2] != ["benchmarks", "records"] and not path.endswith(".pyc")
            and not any(p in SKIPPED or p.endswith(".egg-info") for p in parts[:-1]))


def blob_id(data: bytes) -> str:
    """Git's id of a file holding ``data``."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def tree_id(blobs: Dict[str, str]) -> str:
    return hashlib.sha256("".join(f"{p} {b}\n" for p, b in sorted(blobs.items())).encode()).hexdigest()


def files_tree(root: Path) -> str:
    """The id of the files under ``root`` as they are."""
    blobs = {}
    for folder in SOURCES:
        for path in (root / folder).rglob("*"):
            rel = path.relative_to(root).as_posix()
            if path.is_file() and kept(rel):
                blobs[rel] = blob_id(path.read_bytes())
    return tree_id(blobs)


def _git(root: Path, *args: str) -> Optional[str]:
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def commit_tree(root: Path, commit: str) -> Optional[str]:
    """The id of ``commit``'s files (git's blob ids: nothing read)."""
    listing = _git(root, "ls-tree", "-r", "-z", commit, "--", *SOURCES)
    if listing is None:
        return None
    blobs = {}
    for entry in filter(None, listing.split("\0")):
        meta, path = entry.split("\t", 1)
        if meta.split()[1] == "blob" and kept(path):
            blobs[path] = meta.split()[2]
    return tree_id(blobs)


def tree_commit(tree: str, root: Path = CHECKOUT, commits: Optional[Iterable[str]] = None) -> Optional[str]:
    """The newest of this checkout's last :data:`DEPTH` commits whose files have id ``tree``, or None."""
    if commits is None:
        listed = _git(root, "rev-list", f"--max-count={DEPTH}", "HEAD")
        commits = listed.split() if listed else []
    return next((c for c in commits if commit_tree(root, c) == tree), None)


def stamp(root: Path = CHECKOUT) -> dict:
    now = datetime.datetime.now(datetime.timezone.utc)
    tree = files_tree(root)
    head = (_git(root, "rev-parse", "HEAD") or "").strip()
    return {"date": now.date().isoformat(), "started": now.strftime("%Y-%m-%dT%H:%M:%SZ"), "tree": tree,
            "commit": tree_commit(tree, root, [head] if head else [])}


def main(argv: Optional[List[str]] = None) -> int:
    parser = OneLineParser(prog="python -m benchmarks.run_stamp",
                           description="Stamp a device run's folder with its date and the tree it measures.")
    parser.add_argument("out", help="the run's folder: run.json is written there")
    args = parser.parse_args(argv)

    def body() -> int:
        out = Path(args.out)
        if not out.is_dir():
            raise RefusionError(f"{out}: no such folder")
        record = stamp()
        (out / "run.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"run: {record['started']}, tree {record['tree'][:12]}, commit {record['commit'] or 'unknown here'}")
        return 0

    return run(body)


if __name__ == "__main__":
    sys.exit(main())
