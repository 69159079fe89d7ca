"""The prompt cache on disk (``--prompt-cache-dir``): one safetensors file per
entry, so that conversations and system prompts survive a restart.

A file holds an entry's committed rows (``CommittedCache.to_arrays``: each
layer's arrays as its store names them, for the float store ``keys.{layer}``
and ``values.{layer}`` of shape ``(1, kv_heads, rows, head_dim)``), its
``tokens`` and ``positions`` (int32), and in its metadata the format, the
model's fingerprint (a hash of the model's files -- config, tokenizer,
weights' headers and samples of every tensor, adapters:
``models/fingerprint.py`` -- and of the form its keys and values are
stored in, ``KVStorage.describe``: the float store's dtype) and the entry's
owner (a hash of the API key and ``user`` that made it,
:mod:`.prompt_cache`). Its name is the
fingerprint's first 16 characters, then a hash of the fingerprint, the
owner and the tokens: servers of different models (or dtypes, adapters,
quantizations) sharing a folder each read, trim and replace only their own
files, and two owners of the same tokens have two files.

The folder is private: made (or set) 0700, each file written 0600 under a
temporary name, then ``os.replace``d. Only regular files are read, opened
without following a link and without blocking (a FIFO or a device in the
folder is skipped, never opened for reading). The folder is bounded by a
byte budget: the least recently used of this model's files (oldest
modification time; a cache hit touches its file) go first. At start-up the
engine reloads them, oldest first, into the in-memory cache (whose own
budget then applies); a corrupt, foreign or non-regular file is skipped
with one warning line.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import stat
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence, Tuple

from ...models.fingerprint import model_parts

log = logging.getLogger("refusion_mlx.server")

FORMAT = "refusion-prompt-cache/2"  # /2: the owner in the metadata, the fingerprint in the name
SUFFIX = ".safetensors"
TMP = ".tmp-"  # files being written: never read, removed at start-up once stale
FULL = (errno.ENOSPC, errno.EDQUOT)  # a write that more room would let through
STALE_SECONDS = 60


def model_fingerprint(model_path, stored_as: str, adapter_path=None) -> str:
    """A short hash that changes with the model's files (``models/fingerprint.py``: config, tokenizer,
    weights, adapters) or the form its keys and values are stored in (``stored_as``:
    ``KVStorage.describe``, the dtype for the float store)."""
    parts = model_parts(model_path, adapter_path)
    return hashlib.sha256(json.dumps([FORMAT, stored_as, parts], sort_keys=True).encode()).hexdigest()[:32]


def entry_name(fingerprint: str, owner: str, tokens: Sequence[int]) -> str:
    """An entry's file name: this model's prefix, then a hash of the model, the owner and the tokens."""
    digest = hashlib.sha256(f"{fingerprint}|{owner}|{','.join(map(str, tokens))}".encode()).hexdigest()
    return f"{fingerprint[:16]}-{digest[:32]}{SUFFIX}"


class CacheDir:
    """A private folder of prompt-cache entries; this model's files (its
    fingerprint's prefix) within ``max_bytes``."""

    def __init__(self, path, max_bytes: int, fingerprint: str):
        self.path, self.max_bytes, self.fingerprint = Path(path), max_bytes, fingerprint
        self.prefix = fingerprint[:16] + "-"
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        mode = stat.S_IMODE(self.path.stat().st_mode)
        if mode != 0o700:  # the conversations in it are no one else's to read
            others = [f.name for f in self.path.iterdir() if not f.name.endswith(SUFFIX) and
                      not f.name.startswith(TMP)]
            if others:  # a shared folder (/tmp, a team's): made private, it would lock its other users out
                raise PermissionError(errno.EPERM, f"it is shared (mode {mode:o}) and holds other files, e.g. "
                                                   f"{others[0]}: give the server a folder of its own")
            os.chmod(self.path, 0o700)
            log.info("prompt cache: %s made private (0700, was %o)", self.path, mode)
        for f in self.path.glob(TMP + "*"):  # left by a process killed while writing
            try:
                if time.time() - f.lstat().st_mtime > STALE_SECONDS:
                    f.unlink()
            except OSError:
                pass

    def save(self, owner: str, tokens: Sequence[int], cache) -> None:
        """Write one entry (a compact CommittedCache), 0600, then trim the folder to the budget. A full
        disk (a budget larger than the disk's room) makes room as the budget does, by the least recently
        used of this model's files, and the entry is written once more: the newest conversations are the
        ones kept (else the first few files would be, and every later write fail)."""
        arrays = cache.to_arrays()
        size = sum(a.nbytes for a in arrays.values())
        if size > self.max_bytes:  # it would push every other file out
            return
        final = self.path / entry_name(self.fingerprint, owner, tokens)
        error = self._write(final, arrays, owner)
        if error is not None and getattr(error, "errno", None) in FULL and self._make_room(size, keep=final):
            error = self._write(final, arrays, owner)
        if error is not None:
            log.warning("prompt cache: cannot write %s: %s", final, getattr(error, "strerror", None) or error)
            return
        self.trim()

    def _write(self, final: Path, arrays: dict, owner: str) -> Optional[Exception]:
        """The entry's file, whole or not at all; the error that stopped it."""
        import mlx.core as mx

        tmp = self.path / f"{TMP}{os.getpid()}-{final.name}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
            with os.fdopen(fd, "wb") as fh:
                mx.save_safetensors(fh, arrays, metadata={"format": FORMAT, "model": self.fingerprint,
                                                          "owner": owner})
            os.replace(tmp, final)
        except (OSError, RuntimeError) as e:  # MLX reports a file it cannot write as RuntimeError
            _unlink(tmp)
            return e
        return None

    def _make_room(self, size: int, keep: Path) -> bool:
        """Delete this model's least recently used files until ``size`` bytes are free (all but ``keep``,
        if need be); whether any went."""
        freed = 0
        for _, n, f in self.files():
            if freed >= size:
                break
            if f != keep:
                _unlink(f)
                freed += n
        return freed > 0

    def remove(self, owner: str, tokens: Sequence[int]) -> None:
        _unlink(self.path / entry_name(self.fingerprint, owner, tokens))

    def touch(self, owner: str, tokens: Sequence[int]) -> None:
        """Mark an entry used (its file is evicted last)."""
        try:
            os.utime(self.path / entry_name(self.fingerprint, owner, tokens), follow_symlinks=False)
        except (OSError, NotImplementedError):
            pass

    def files(self, warn: bool = False):
        """(mtime, size, path) of this model's entry files, oldest first: regular
        files only (``warn``: one line for each other thing named as an entry, and one for the entries of
        other fingerprints, which no budget of this server counts)."""
        out, others = [], []
        try:
            entries = list(os.scandir(self.path))
        except OSError as e:
            log.warning("prompt cache: cannot list %s: %s", self.path, e.strerror or e)
            return out
        for f in entries:
            if not f.name.endswith(SUFFIX) or f.name.startswith(TMP):
                continue
            try:
                regular = f.is_file(follow_symlinks=False)
                st = f.stat(follow_symlinks=False)
            except OSError:
                continue
            if not regular:
                if warn:
                    log.warning("prompt cache: skipping %s (not a regular file)", f.name)
                continue
            if f.name.startswith(self.prefix):  # another model's files are not this server's to read or trim
                out.append((st.st_mtime, st.st_size, Path(f.path)))
            else:
                others.append(st.st_size)
        if warn and others:  # a changed model (or a new version of this server) leaves its old files behind
            log.warning("prompt cache: %d file(s), %.1f MB, in %s are for another model, dtype or --kv-bits (or an "
                        "older version): not read, not counted in --prompt-cache-dir-bytes, not removed; delete "
                        "them if no server uses them", len(others), sum(others) / 1e6, self.path)
        return sorted(out)

    def trim(self) -> None:
        files = self.files()
        total = sum(size for _, size, _ in files)
        for _, size, f in files:
            if total <= self.max_bytes:
                break
            _unlink(f)
            total -= size

    def load(self, new_cache, max_rows: int) -> Iterator[Tuple[str, list, object]]:
        """(owner, tokens, cache) of each valid file, oldest first; ``new_cache()``
        makes the empty CommittedCache a file is read into, whose layers, shape
        and stored form the file's arrays must match; an entry holds at most
        ``max_rows`` (the model's context), at positions 0, 1, ... in order,
        and finite keys and values."""
        for _, _, f in self.files(warn=True):
            try:
                entry = self._read(f, new_cache(), max_rows)
            except Exception as e:  # noqa: BLE001 - any unreadable file is skipped, whatever broke
                entry, why = None, f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
            else:
                why = None if isinstance(entry, tuple) else entry
            if why is not None:
                log.warning("prompt cache: skipping %s (%s)", f.name, why)
                continue
            yield entry

    def _read(self, f: Path, cache, max_rows: int):
        import mlx.core as mx

        # no link followed, no wait on a FIFO or a device swapped in since it was listed: a regular file or nothing
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(f, flags)
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return "not a regular file"
            arrays, meta = mx.load(fh, format="safetensors", return_metadata=True)
        if meta.get("format") != FORMAT:
            return f"not a {FORMAT} file"
        if meta.get("model") != self.fingerprint:
            return "written for another model"
        owner = meta.get("owner")
        if not isinstance(owner, str):
            return "it names no owner"
        why = _entry_problem(arrays, max_rows)
        if why is not None:
            return why
        try:
            cache.load_arrays(arrays)
        except ValueError as e:
            return f"its arrays do not fit this model's cache ({e})"
        tokens = [int(t) for t in cache.tokens]
        if f.name != entry_name(self.fingerprint, owner, tokens):  # copied or renamed: not where its key is
            return "its name does not match its model, owner and tokens"
        return owner, tokens, cache


def _entry_problem(arrays: dict, max_rows: int):
    """What makes a file's arrays no prompt-cache entry, looked at before anything is
    allocated for them: more rows than the context, positions other than 0, 1, ...,
    or keys and values that are not finite. None: fine."""
    import mlx.core as mx

    positions = arrays.get("positions")
    if positions is None or positions.ndim != 1 or not 0 < positions.shape[0] <= max_rows:
        return f"its positions are not one list of 1 to {max_rows} rows (the model's context)"
    if any(a.ndim >= 3 and a.shape[2] != positions.shape[0] for a in arrays.values()):
        return "its arrays do not hold one row per position"
    if positions.tolist() != list(range(positions.shape[0])):
        return "its positions are not 0, 1, 2, ... in order"
    floats = [mx.all(mx.isfinite(a)) for a in arrays.values() if mx.issubdtype(a.dtype, mx.floating)]
    if floats and not mx.all(mx.stack(floats)).item():
        return "its keys or values are not finite (NaN or infinity)"
    return None


def attach(prompt_cache, model, path, max_bytes: int, adapter_path=None, storage=None) -> None:
    """Back ``prompt_cache`` with the folder ``path`` (this model's files,
    ``max_bytes`` in all) and reload the entries it holds. ``storage``: how
    the caches keep keys and values (a ``decode.kv_store.KVStorage``; the float
    store by default), whose stored form is part of the fingerprint."""
    from ...decode.cache import CommittedCache
    from ...decode.kv_store import KVStorage
    from ...errors import RefusionError

    storage = storage or KVStorage()
    fingerprint = model_fingerprint(model.model_path, storage.describe(model.cache_spec()), adapter_path)
    try:
        store = CacheDir(path, max_bytes, fingerprint)
    except OSError as e:
        raise RefusionError(f"cannot use --prompt-cache-dir {path} (it must be a folder this user can make "
                            f"private, 0700): {e.strerror or e}") from None
    n = 0
    prompt_cache.store, prompt_cache.fingerprint = store, fingerprint
    for owner, tokens, cache in store.load(lambda: CommittedCache.for_model(model, storage=storage),
                                           model.args.max_position_embeddings):
        prompt_cache.restore(owner, tokens, cache)
        n += 1
    log.info("prompt cache: %d entries reloaded from %s (%d kept in memory)", n, path, len(prompt_cache))


def _unlink(f: Path) -> None:
    """Delete a file if it is there; a folder gone read-only costs disk space, not the server."""
    if not os.path.lexists(f):  # a temporary file never made (a read-only folder): nothing to say
        return
    try:
        f.unlink(missing_ok=True)
    except OSError as e:
        log.warning("prompt cache: cannot delete %s: %s", f, e.strerror or e)
