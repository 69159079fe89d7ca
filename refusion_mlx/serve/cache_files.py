"""The prompt cache on disk (``--prompt-cache-dir``): one safetensors file per
entry, so that conversations and system prompts survive a restart.

A file holds an entry's committed rows (``CommittedCache.to_arrays``: each
layer's arrays as its store names them, for the float store ``keys.{layer}``
and ``values.{layer}`` of shape ``(1, kv_heads, rows, head_dim)``), its
``tokens`` and ``positions`` (int32), and in its metadata the format and the
model's fingerprint (a hash of the model's config, the form its keys and
values are stored in (``Storage.describe``: the float store's dtype), and
the size, head and tail of its weight and adapter files): a file of another
model, another stored form, or another format, is skipped.
Files are written atomically (a temporary file, then ``os.replace``) and are
bounded by a byte budget: the least recently used (oldest modification time;
a cache hit touches its file) go first. At start-up the engine reloads them,
oldest first, into the in-memory cache (whose own budget then applies); a
corrupt or foreign file is skipped with one warning line.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Iterator, Sequence, Tuple

log = logging.getLogger("refusion_mlx.server")

FORMAT = "refusion-prompt-cache/1"
SUFFIX = ".safetensors"
TMP = ".tmp-"  # files being written: never read, removed at start-up once stale
STALE_SECONDS = 60
_SAMPLE = 1 << 20  # bytes hashed at each end of a weight file


def model_fingerprint(model_path, stored_as: str, adapter_path=None) -> str:
    """A short hash that changes with the model's config, weights or adapters,
    or the form its keys and values are stored in (``stored_as``:
    ``Storage.describe``, the dtype for the float store)."""
    h = hashlib.sha256(f"{FORMAT}|{stored_as}".encode())
    for folder in (model_path, adapter_path):
        if folder is None:
            continue
        folder = Path(folder)
        for f in sorted(folder.glob("*.json")) + sorted(folder.glob("*.safetensors")):
            size = f.stat().st_size
            h.update(f"|{f.name}|{size}|".encode())
            with open(f, "rb") as fh:
                h.update(fh.read(_SAMPLE))
                if size > 2 * _SAMPLE:
                    fh.seek(size - _SAMPLE)
                    h.update(fh.read(_SAMPLE))
    return h.hexdigest()[:32]


def entry_name(tokens: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()[:32] + SUFFIX


class CacheDir:
    """A folder of prompt-cache entries for one model, within ``max_bytes``."""

    def __init__(self, path, max_bytes: int, fingerprint: str):
        self.path, self.max_bytes, self.fingerprint = Path(path), max_bytes, fingerprint
        self.path.mkdir(parents=True, exist_ok=True)
        for f in self.path.glob(TMP + "*"):  # left by a process killed while writing
            try:
                if time.time() - f.stat().st_mtime > STALE_SECONDS:
                    f.unlink()
            except OSError:
                pass

    def save(self, tokens: Sequence[int], cache) -> None:
        """Write one entry (a compact CommittedCache), then trim the folder to the budget."""
        import mlx.core as mx

        arrays = cache.to_arrays()
        final = self.path / entry_name(tokens)
        tmp = self.path / f"{TMP}{os.getpid()}-{final.name}"
        try:
            mx.save_safetensors(str(tmp), arrays, metadata={"format": FORMAT, "model": self.fingerprint})
            os.replace(tmp, final)
        except (OSError, RuntimeError) as e:  # MLX reports a file it cannot write as RuntimeError
            log.warning("prompt cache: cannot write %s: %s", final, getattr(e, "strerror", None) or e)
            _unlink(tmp)
            return
        self.trim()

    def remove(self, tokens: Sequence[int]) -> None:
        _unlink(self.path / entry_name(tokens))

    def touch(self, tokens: Sequence[int]) -> None:
        """Mark an entry used (its file is evicted last)."""
        try:
            os.utime(self.path / entry_name(tokens))
        except OSError:
            pass

    def files(self):
        """(mtime, size, path) of the entry files, oldest first."""
        out = []
        for f in self.path.glob("*" + SUFFIX):
            if f.name.startswith(TMP):
                continue
            try:
                st = f.stat()
            except OSError:
                continue
            out.append((st.st_mtime, st.st_size, f))
        return sorted(out)

    def trim(self) -> None:
        files = self.files()
        total = sum(size for _, size, _ in files)
        for _, size, f in files:
            if total <= self.max_bytes:
                break
            _unlink(f)
            total -= size

    def load(self, new_cache) -> Iterator[Tuple[list, object]]:
        """(tokens, cache) of each valid file, oldest first; ``new_cache()`` makes the
        empty CommittedCache a file is read into, whose layers, shape and stored
        form the file's arrays must match."""
        for _, _, f in self.files():
            try:
                entry = self._read(f, new_cache())
            except Exception as e:  # noqa: BLE001 - any unreadable file is skipped, whatever broke
                entry, why = None, f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
            else:
                why = None if isinstance(entry, tuple) else entry
            if why is not None:
                log.warning("prompt cache: skipping %s (%s)", f.name, why)
                continue
            yield entry

    def _read(self, f: Path, cache):
        import mlx.core as mx

        arrays, meta = mx.load(str(f), return_metadata=True)
        if meta.get("format") != FORMAT:
            return f"not a {FORMAT} file"
        if meta.get("model") != self.fingerprint:
            return "written for another model"
        try:
            cache.load_arrays(arrays)
        except ValueError as e:
            return f"its arrays do not fit this model's cache ({e})"
        return list(cache.tokens), cache


def attach(prompt_cache, model, path, max_bytes: int, adapter_path=None, storage=None) -> None:
    """Back ``prompt_cache`` with the folder ``path`` (this model's files,
    ``max_bytes`` in all) and reload the entries it holds. ``storage``: how
    the caches keep keys and values (a ``decode.kv_store.Storage``; the float
    store by default), whose stored form is part of the fingerprint."""
    from ..decode.cache import CommittedCache
    from ..decode.kv_store import Storage
    from ..errors import RefusionError

    storage = storage or Storage()
    fingerprint = model_fingerprint(model.model_path, storage.describe(model.cache_spec()), adapter_path)
    try:
        store = CacheDir(path, max_bytes, fingerprint)
    except OSError as e:
        raise RefusionError(f"cannot use --prompt-cache-dir {path}: {e.strerror or e}") from None
    n = 0
    prompt_cache.store = store
    for tokens, cache in store.load(lambda: CommittedCache.for_model(model, storage=storage)):
        prompt_cache.restore(tokens, cache)
        n += 1
    log.info("prompt cache: %d entries reloaded from %s (%d kept in memory)", n, path, len(prompt_cache))


def _unlink(f: Path) -> None:
    """Delete a file if it is there; a folder gone read-only costs disk space, not the server."""
    try:
        f.unlink(missing_ok=True)
    except OSError as e:
        log.warning("prompt cache: cannot delete %s: %s", f, e.strerror or e)
