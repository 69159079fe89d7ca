"""How a decode pass runs through the network: the one place that drives a
model layer by layer (the model itself is architecture only; ``models/base.py``
lists the pieces it offers).

A decode pass writes its keys and values into committed caches (a
``KVWrite``, or a batch's ``PackedWrite``). :meth:`Runner.hidden` embeds its
tokens, rotates by their positions, calls every layer with the layer's
write, and applies the final norm; around that it makes what the machine
needs (``backend``'s table says which side does what):

* **Row groups** (CPU paths, a small model's wide passes): the pass cut in
  two, each group on its own CPU stream (:func:`row_groups`).
* **Overlap** (CPU paths): evaluation started every L/8 layers while Python
  builds the rest (:func:`overlap`).
* **BLAS threads** (CPU paths): fitted to each step's rows and groups
  (``_blas.fit_rows``); a step left computing asynchronously is waited for
  first when the count would change under it (:meth:`Runner.fit_threads`).

One runner per model (:meth:`Runner.of`): a batch's steps and a prompt-cache
prefill between them share the step it left running.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import List, Optional, Tuple

import mlx.core as mx

from .. import _blas
from ..distributed import group as distributed_group
from ..models import backend
from .packed import padded

# A decode pass of a small model (one BLAS thread, ``_blas.fit_threads``) at
# least this wide is computed as two row groups, each on its own CPU stream
# (its own worker thread) with one BLAS thread. MLX's CPU backend runs every
# op but a matmul on one thread, so one stream leaves a core idle through a
# wide pass's norms, rotations, softmaxes and SwiGLUs; two groups keep both
# busy. The split is exact: in a causal pass the first group's queries
# never see the second's rows, the second's see the first's through the
# cache, as if the two ran one after the other; in an infill pass each slot
# sees only the committed rows and its own, so whole slots go to each group;
# a batch's packed passes are cut between requests, which never see each
# other. The first group takes 55% of the rows: the second's queries see
# more keys and wait, layer by layer, for the first's keys and values. Measured on the demo model (this 2-core
# CPU, MKL): a 146-token pass 14-15 ms against 18-21 ms in one group with two
# BLAS threads; from 40 tokens on it is no slower (docs/benchmarks.md).
SPLIT_ROWS = 40
SPLIT_SHARE = 0.55

# (first row, end row, the group's write, its stream or None: the default one)
Group = Tuple[int, int, object, Optional[mx.Stream]]

# MLX's streams belong to the thread that made them (a server decodes on its
# own thread): each thread gets its pair on first use.
_local = threading.local()


def row_groups(write, rows: int) -> List[Group]:
    """How a decode pass of ``rows`` tokens writing through ``write`` runs:
    ``(first row, end row, write, stream)`` per group, in sequence order.
    One group on the default stream, unless this is a wide pass of a small
    model on the CPU paths with a second core, whose write can be cut
    (``write.split``: a causal pass after the committed rows, an infill
    pass between two slots, a batch's packed passes between two requests)."""
    whole = [(0, rows, write, None)]
    if backend.gpu_paths() or rows < SPLIT_ROWS or not _blas.small_model() or (os.cpu_count() or 1) < 2:
        return whole
    split = getattr(write, "split", None)
    halves = split(int(rows * SPLIT_SHARE)) if split is not None else None
    if halves is None:
        return whole
    cut = halves[0].tokens  # where the write could cut (an infill pass: at a slot's end)
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = (mx.default_stream(mx.cpu), mx.new_stream(mx.cpu))
    return [(0, cut, halves[0], streams[0]), (cut, rows, halves[1], streams[1])]


def on(stream: Optional[mx.Stream]):
    """The ops built inside run on ``stream`` (None: the default one)."""
    return contextlib.nullcontext() if stream is None else mx.stream(stream)


def overlap(h: List[mx.array], layer: int, layers: int) -> None:
    """Called after each layer of a decode pass with every row group's
    output. On the CPU paths, start computing them (in one call: separate
    calls serialise the groups' streams) every ``layers / 8`` layers while
    Python builds the next ones:
    ReFusion syncs at each decision, so this is where graph building can
    overlap with compute (+6% tokens/s on the demo model, CPU). On the GPU
    paths the pass stays one graph, evaluated once, unless
    ``REFUSION_MLX_OVERLAP=on`` (``backend.overlaps``)."""
    if (layer + 1) % max(1, layers // 8) == 0 and backend.overlaps():
        mx.async_eval(*h)


class Runner:
    """Runs decode passes of one model (see the module's docstring).

    A runner may stand in for its model wherever the decode side takes one
    (``Runner.of`` returns it as is): a recording runner sees every pass
    (``bench/forward_replay.py``)."""

    def __init__(self, model):
        self._model = weakref.ref(model)  # the model keeps its runner, not the other way round
        # the arrays of the last step evaluated asynchronously, with its row
        # count: nothing of the host waits on them, but a BLAS thread change
        # must not happen while they may still be computing
        self._in_flight: Optional[Tuple[int, List[mx.array]]] = None

    @classmethod
    def of(cls, model) -> "Runner":
        """The model's runner, made on first use and kept with the model."""
        if isinstance(model, Runner):
            return model
        runner = getattr(model, "_decode_runner", None)
        if runner is None:
            runner = cls(model)
            model._decode_runner = runner
        return runner

    @property
    def model(self):
        return self._model()

    def row_groups(self, write, rows: int) -> List[Group]:
        """:func:`row_groups`, or one group in a process of a distributed
        group: every rank must run the same ops in the same order."""
        if distributed_group.current() is not None:
            return [(0, rows, write, None)]
        return row_groups(write, rows)

    def fit_threads(self, rows: int, groups: List[Group]) -> bool:
        """CPU paths: the BLAS thread count for a forward of ``rows`` tokens
        in ``groups``. When it would change while a step left running may
        still be computing, wait for that step first (a blocking evaluation:
        True), so no matmul runs with a thread count other than its own
        forward's."""
        if not backend.cpu_paths():
            return False
        waited = False
        if self._in_flight is not None:
            before, arrays = self._in_flight
            if (before >= _blas.WIDE_ROWS) != (rows >= _blas.WIDE_ROWS):
                mx.eval(*arrays)
                waited = True
            self._in_flight = None
        _blas.fit_rows(rows, len(groups) > 1)
        return waited

    def left_running(self, rows: int, arrays: List[mx.array]) -> None:
        """A step of ``rows`` tokens was evaluated asynchronously: its arrays
        may still be computing when the next one fits the BLAS threads."""
        if backend.cpu_paths():
            self._in_flight = (rows, arrays)

    def hidden(self, tokens: mx.array, positions: mx.array, write, groups: Optional[List[Group]] = None
               ) -> mx.array:
        """Final-norm hidden states (T, dim) of one decode pass: tokens (T,)
        at positions (T,), writing through ``write``. ``groups``: the pass's
        :meth:`row_groups`, when the caller made them already (``run_passes``, which fits the BLAS
        threads to them); made here otherwise (a scoring pass, the speed tools), and the threads fitted.

        One sequence is kept 2-D (T, dim) throughout: every projection is then
        a plain matmul, without the reshapes a batch axis costs on each call.
        Each row group writes its rows and attends as a pass of its own."""
        model = self.model
        h = model.embed(tokens)
        T = h.shape[0]
        if groups is None:
            groups = self.row_groups(write, T)
            self.fit_threads(T, groups)
        runs = []  # per group: its rows' hidden states, rope, mask, write, stream
        for lo, hi, group_write, stream in groups:
            group_write = padded(group_write, hi - lo)  # a lone pass at bucketed shapes, where they apply
            with on(stream):
                mask = group_write.mask
                if mask is not None:  # None: a packed batch, whose requests bring their own masks
                    mask = model.attention_mask(mask, hi - lo, group_write.visible, h.dtype)
                whole = hi - lo == T
                runs.append([h if whole else h[lo:hi], model.rope(positions if whole else positions[lo:hi]),
                             mask, group_write, stream])
        layers = model.layers
        for i, layer in enumerate(layers):
            for run in runs:
                x, rope, mask, group_write, stream = run
                with on(stream):
                    run[0] = layer(x, rope, mask, group_write.layer(i))
            overlap([r[0] for r in runs], i, len(layers))
        h = runs[0][0] if len(runs) == 1 else mx.concatenate([r[0] for r in runs])
        return model.norm(h)
