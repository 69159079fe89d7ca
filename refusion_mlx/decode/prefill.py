"""Prompt prefill: prompt tokens fed into a CommittedCache in chunks.

The one home of chunked prefill. The decoder yields these passes from its
loop, so they batch with other requests' (``RefusionDecoder._prefill_head``:
it leaves the prompt's last chunk to its first planning pass; the server's
requests that share a prefix wait for the first to land it, so it is
prefilled once and a chunk a step); ``prefill`` runs them alone (a cache
filled outside any batch: the benchmarks, the tests).
Chunks bound the attention scores a long prompt materialises (a 2048-token
prompt on the 0.6B shape: 3.04 GB peak in chunks of 512, 3.41 GB in one pass).
"""

from __future__ import annotations

from typing import Generator, Iterator, List, Sequence, Tuple

import mlx.core as mx

from .cache import CommittedCache
from .forward import Pass, run_passes

PREFILL_CHUNK = 512  # tokens per prefill pass


def chunks(tokens: Sequence[int], first_position: int, chunk: int = PREFILL_CHUNK,
           leave: int = 0) -> Iterator[Tuple[List[int], List[int]]]:
    """(tokens, positions) of the chunks of ``tokens``, at most ``chunk`` each,
    at positions from ``first_position``, until at most ``leave`` are left."""
    done = 0
    while len(tokens) - done > leave:
        part = [int(t) for t in tokens[done:done + chunk]]
        yield part, list(range(first_position + done, first_position + done + len(part)))
        done += len(part)


def passes(cache: CommittedCache, tokens: Sequence[int], first_position: int, chunk: int = PREFILL_CHUNK,
           leave: int = 0) -> Generator[Pass, object, int]:
    """The prefill passes of ``tokens`` into ``cache``, each committed once the
    next is asked for (or the generator ends); returns how many were fed."""
    done = 0
    for part, positions in chunks(tokens, first_position, chunk, leave):
        yield Pass("prefill", mx.array(part, dtype=mx.int32), mx.array(positions, dtype=mx.int32),
                   cache.extend(len(part), settled=len(part)))
        cache.commit(part, positions)
        done += len(part)
    return done


def prefill(model, cache: CommittedCache, ids: Sequence[int], chunk: int = PREFILL_CHUNK) -> None:
    """Append ``ids`` (positions after the cache's) to ``cache`` as committed rows."""
    for p in passes(cache, ids, len(cache), chunk):
        run_passes(model, [p])
