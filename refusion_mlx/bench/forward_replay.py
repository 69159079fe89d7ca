"""Record the forwards a ReFusion run makes, then run the same forwards bare.

The decoder's overhead is everything it does besides the model: building
masks and positions, drafting and scoring on the logits, host round trips,
Python bookkeeping. To measure it, :class:`RecordingModel` stands in for a
model (a ``decode.runner.Runner`` whose passes it notes; the decoder calls
its ``hidden`` and ``head``) and notes each forward's shape:
tokens in, where its K/V go, how many cached rows its queries see, the mask,
and on how many rows the LM head ran. :func:`replay` then runs forwards of
exactly those shapes with plain preallocated KV stores (the decoder's own,
grown once) and one evaluation per forward -- the cost of the model alone.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..decode.kv_store import KVStorage
from ..decode.packed import PackedWrite
from ..decode.runner import Runner

PHASE_ORDER = ("prefill", "plan", "verify", "infill_draft", "infill_verify")


@dataclass
class ForwardShape:
    """One forward as the model saw it."""

    tokens: int
    start: int  # first K/V row written (contiguous writes)
    visible: int  # K/V rows the queries attend over
    rows: Optional[np.ndarray] = None  # scattered K/V rows (parallel infill)
    mask: object = "causal"  # "causal" or a boolean (tokens, visible) array
    head_rows: int = 0  # rows the LM head ran on after this forward
    phase: str = ""


class _Pending:
    """A forward recorded during the run; arrays converted only afterwards,
    so recording adds no host synchronisation."""

    def __init__(self, tokens: int, write):
        self.tokens = tokens
        self.write = write
        self.head_rows = 0

    def shape(self) -> ForwardShape:
        w = self.write
        if w is None:
            return ForwardShape(self.tokens, 0, self.tokens, None, "causal", self.head_rows)
        rows = None if w.rows is None else np.array(w.rows)
        mask = w.mask if isinstance(w.mask, str) or w.mask is None else np.array(w.mask)
        return ForwardShape(self.tokens, w.start, w.visible, rows, mask, self.head_rows)


class RecordingModel(Runner):
    """A model stand-in that records forward shapes and passes everything on."""

    def __init__(self, model):
        self._wrapped = model  # held here: the runner itself keeps only a weak reference
        super().__init__(model)
        self._pending: List[_Pending] = []

    def __getattr__(self, name):
        return getattr(self._wrapped, name)

    def hidden(self, tokens, positions, write, groups=None):
        self._pending.append(_Pending(int(tokens.shape[-1]), write))
        return super().hidden(tokens, positions, write, groups)

    def head(self, h):
        if self._pending:
            self._pending[-1].head_rows += int(np.prod(h.shape[:-1]))
        return self._wrapped.head(h)

    def shapes(self) -> List[ForwardShape]:
        out = [p.shape() for p in self._pending]
        tag_phases(out)
        return out


def tag_phases(shapes: Sequence[ForwardShape]) -> None:
    """Name each forward's decoder phase from the loop's fixed order: prompt
    chunks (no head), the first pass with a head (prefill), then plan and
    verify alternating on contiguous writes, infill draft and verify
    alternating on scattered ones."""
    seen_first, next_extend, next_infill = False, "plan", "infill_draft"
    for s in shapes:
        if s.rows is None and s.head_rows == 0:
            s.phase = "prefill"
        elif s.rows is None and not seen_first:
            s.phase, seen_first, next_extend = "prefill", True, "verify"
        elif s.rows is None:
            s.phase = next_extend
            next_extend = "verify" if next_extend == "plan" else "plan"
            next_infill = "infill_draft"
        else:
            s.phase = next_infill
            next_infill = "infill_verify" if next_infill == "infill_draft" else "infill_draft"


class BareCache:
    """The decoder's per-layer K/V stores (``decode.kv_store``), grown once
    to ``capacity`` rows and written in place, like any preallocated KV cache."""

    def __init__(self, model, capacity: int, storage: Optional[KVStorage] = None):
        spec = model.cache_spec()
        storage = storage or KVStorage()
        self.stores = [storage.new(spec) if i in spec.held else None for i in range(spec.layers)]
        for store in self.stores:
            if store is not None:
                store.grow(capacity)
        mx.eval([a for store in self.stores if store is not None for a in store.state()])


class BareWrite:
    """The KV interface the model expects, with nothing but the write."""

    def __init__(self, cache: BareCache, shape: ForwardShape):
        self.cache = cache
        self.start, self.visible = shape.start, shape.visible
        self.rows = None if shape.rows is None else mx.array(shape.rows, dtype=mx.int32)
        self.mask = shape.mask if isinstance(shape.mask, str) else mx.array(shape.mask)

    def layer(self, i: int) -> "BareWrite._Layer":
        return BareWrite._Layer(self, i)

    @property
    def tokens(self) -> int:
        return self.visible - self.start if self.rows is None else int(self.rows.shape[0])

    def split(self, at: int) -> Optional[Tuple["BareWrite", "BareWrite"]]:
        """As ``KVWrite.split``: a causal pass as its first ``at`` rows, then
        the rest (so a bare forward runs as the decoder's row groups do)."""
        if self.rows is not None or self.mask != "causal":
            return None
        first, second = copy.copy(self), copy.copy(self)
        first.visible = second.start = self.start + at
        return first, second

    class _Layer:
        __slots__ = ("w", "store")

        def __init__(self, w: "BareWrite", i: int):
            self.w, self.store = w, w.cache.stores[i]

        def update(self, k, v):
            """Write the pass's rows to the layer's store; the rows before the
            pass's first count as committed (a quantized store keeps them as
            codes, as the decoder's would)."""
            w = self.w
            self.store.set_committed(w.start)
            if w.rows is None:
                self.store.write(k, v, w.start)
            else:
                self.store.write_rows(k, v, w.rows, w.visible)

        def fetch(self, length):
            """The first ``length`` rows, as a packed batch reads them."""
            return self.store.read_padded(length)

        def attend(self, q, k, v, mask):
            """Write the pass's rows, then attend over the rows it sees."""
            self.update(k, v)
            return self.store.attend(q, mask, self.w.visible)


@dataclass
class Replay:
    """Bare forwards ready to run: inputs built and evaluated ahead of time."""

    shapes: List[ForwardShape]
    inputs: list = field(default_factory=list)
    cache: Optional[BareCache] = None


def prepare(model, shapes: List[ForwardShape], seed: int = 0, storage: Optional[KVStorage] = None) -> Replay:
    """Inputs for :func:`replay`; ``storage``: how the bare stores keep keys and values (--kv-bits)."""
    capacity = max(s.visible for s in shapes)
    cache = BareCache(model, capacity, storage)
    rng = np.random.default_rng(seed)
    vocab = model.args.vocab_size
    inputs = []
    for s in shapes:
        tokens = mx.array(rng.integers(0, vocab, (s.tokens,)), dtype=mx.int32)
        positions = mx.arange(s.start, s.start + s.tokens, dtype=mx.int32)
        write = BareWrite(cache, s)
        inputs.append((tokens, positions, write))
        mx.eval(tokens, positions, *([write.rows] if write.rows is not None else []),
                *([write.mask] if not isinstance(write.mask, str) else []))
    return Replay(shapes, inputs, cache)


def replay(model, prepared: Replay, head_chunk: Optional[int] = None) -> List[float]:
    """Run every recorded forward bare; return each one's seconds.

    ``head_chunk``: run the LM head over at most that many rows at a time,
    as the decoder does (``decode.forward.head_outputs``); None: one call."""
    times = []
    runner = Runner.of(model)
    for s, (tokens, positions, write) in zip(prepared.shapes, prepared.inputs):
        t0 = time.perf_counter()
        h = runner.hidden(tokens, positions, write)  # its row groups and BLAS threads, as the decoder's
        if s.head_rows:
            rows = h[-s.head_rows:]
            step = head_chunk or s.head_rows
            out = [model.head(rows[i:i + step]).astype(mx.float32) for i in range(0, s.head_rows, step)]
        else:
            out = h
        mx.eval(out)
        times.append(time.perf_counter() - t0)
    return times


def time_refusion(model, shapes: List[ForwardShape], head_chunk: Optional[int], storage=None) -> List[float]:
    """Seconds of each forward of ``shapes`` replayed bare, after one untimed
    forward of each phase (so a kernel compiled on first use is not timed);
    ``storage``: how the bare stores keep keys and values (--kv-bits)."""
    prepared = prepare(model, shapes, storage=storage)
    first = sorted({s.phase: i for i, s in reversed(list(enumerate(shapes)))}.values())
    warm = type(prepared)([shapes[i] for i in first], [prepared.inputs[i] for i in first], prepared.cache)
    replay(model, warm, head_chunk=head_chunk)
    return replay(model, prepared, head_chunk=head_chunk)


def split_requests(shapes: Sequence[ForwardShape]) -> List[List[ForwardShape]]:
    """A profile's forwards request by request: each request's first forward
    writes from row 0."""
    out: List[List[ForwardShape]] = []
    for s in shapes:
        if s.rows is None and s.start == 0 or not out:
            out.append([])
        out[-1].append(s)
    return out


def replay_batched(model, requests: Sequence[Sequence[ForwardShape]], head_chunk: Optional[int] = None,
                   storage: Optional[KVStorage] = None, seed: int = 0) -> List[float]:
    """The requests decoded at once, as continuous batching runs them: step i
    packs every request's i-th forward into one forward
    (``decode.packed.PackedWrite``: the weights read once, each request
    attending to its own cache), the LM head over all their head rows; each
    request has its own stores. Returns each step's seconds, after the first
    step run once untimed."""
    prepared = [prepare(model, list(req), seed + i, storage) for i, req in enumerate(requests)]
    runner = Runner.of(model)
    steps = max(len(req) for req in requests)

    def step(i: int) -> float:
        active = [(p.shapes[i], p.inputs[i]) for p in prepared if i < len(p.shapes)]
        tokens = mx.concatenate([inp[0] for _, inp in active])
        positions = mx.concatenate([inp[1] for _, inp in active])
        mx.eval(tokens, positions)
        t0 = time.perf_counter()
        write = PackedWrite([inp[2] for _, inp in active], [s.tokens for s, _ in active])
        h = runner.hidden(tokens, positions, write)
        rows = sum(s.head_rows for s, _ in active)
        step_rows = head_chunk or rows or 1
        out = [model.head(h[-rows:][j:j + step_rows]).astype(mx.float32) for j in range(0, rows, step_rows)]
        mx.eval(out or h)
        return time.perf_counter() - t0

    step(0)
    return [step(i) for i in range(steps)]


def time_batched(model, forwards: Sequence[ForwardShape], generated: Sequence[int], batch: int,
                 head_chunk: Optional[int] = None, storage: Optional[KVStorage] = None) -> dict:
    """``batch`` requests of a profile (its requests in turn; ``generated``:
    the tokens each one decodes) one at a time and all at once
    (:func:`replay_batched`): seconds and aggregate tokens/s of each."""
    reqs = split_requests(forwards)
    chosen = [reqs[i % len(reqs)] for i in range(batch)]
    tokens = sum(generated[i % len(reqs)] for i in range(batch))
    serial = sum(time_refusion(model, [s for r in chosen for s in r], head_chunk, storage))
    together = sum(replay_batched(model, chosen, head_chunk, storage))
    return {"requests": batch, "tokens": tokens, "serial_seconds": round(serial, 6),
            "batched_seconds": round(together, 6), "serial_tok_s": round(tokens / serial, 3),
            "batched_tok_s": round(tokens / together, 3), "speedup": round(serial / together, 4)}


def by_phase(shapes: Sequence[ForwardShape], seconds: Sequence[float]) -> dict:
    out = {p: 0.0 for p in PHASE_ORDER}
    for s, t in zip(shapes, seconds):
        out[s.phase] = out.get(s.phase, 0.0) + t
    return out


def count_by_phase(shapes: Sequence[ForwardShape]) -> dict:
    out = {p: 0 for p in PHASE_ORDER}
    for s in shapes:
        out[s.phase] = out.get(s.phase, 0) + 1
    return out
