"""One step: a forward pass over the next pass of every active request.

Each request asks for a :class:`Pass`: the tokens it feeds, their positions,
where its keys and values go in *its own* committed cache (a ``KVWrite``) and
what it needs from the LM head. :func:`run_passes` packs the passes of many
requests into one sequence, so every weight is read once per step, while
attention stays per request (:class:`~.packed.PackedWrite`: on the GPU paths
one padded batch, one kernel call per layer): each request's queries see its
own committed rows and its own pass, exactly as if it ran alone
(REFUSION.md §3-§4). The LM head runs once over the rows every request needs,
in chunks that bound the vocabulary-sized working set (on the GPU paths one
chunk, reading the head weight once, while the logits fit a budget from the
device's memory: ``backend.logits_budget``), and one evaluation then serves
the whole batch: one host synchronisation per step -- none for a step whose
passes all keep their values on the device (infill drafts), which is
evaluated asynchronously (:func:`run_passes`). How the forward itself runs
(row groups, CPU streams, BLAS threads) is the model's
:class:`~.runner.Runner`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..models import backend
from .cache import KVWrite
from .matcher import allowed_rows
from .packed import PackedWrite
from .penalties import repeat_penalised
from .probs import LOGITS_BUDGET_BYTES, Drafting, row_statistics, top_logprobs
from .runner import Runner


@dataclass
class HeadOutput:
    """Per head row of one pass: the draft token and its probability, and the
    probability of the pass's ``follow`` token (device arrays)."""

    draft: Optional[mx.array]
    p_draft: Optional[mx.array]
    p_follow: Optional[mx.array]
    top_ids: Optional[mx.array] = None  # (rows, k): the k most likely tokens, when the pass asks ``top``
    top_logprobs: Optional[mx.array] = None


# derive(head) -> (values fetched to the host, values kept on the device)
Derive = Callable[[HeadOutput], Tuple[Dict[str, mx.array], Dict[str, mx.array]]]


@dataclass
class Pass:
    """What one request feeds to the next forward, and what it wants back.

    ``head_rows``: how many of the last rows go through the LM head (0: none,
    e.g. a prefill chunk). ``drafting``: how drafts are drawn on those rows
    (None: no drafts wanted). ``follow``: for each head row, the token whose
    probability it should give (verification), or None. ``derive`` turns
    the head's rows into the values the request's decision needs.
    ``masks``: a constrained request's grammar (``constrain.py``): a host
    function giving each head row's bitmask of allowed tokens ((head_rows,
    words) int32), called while the device runs the layers; the head's
    drafts and probabilities are then those of the allowed tokens only.
    """

    phase: str
    tokens: mx.array
    positions: mx.array
    write: KVWrite
    head_rows: int = 0
    drafting: Optional[Drafting] = None
    follow: Optional[mx.array] = None
    derive: Optional[Derive] = None
    masks: Optional[Callable[[], np.ndarray]] = None
    top: int = 0  # the most likely tokens each head row also gives (generated tokens' top_logprobs)
    bias: Optional[mx.array] = None  # (vocab,) added to each head row's logits (``penalties.py``)
    repeat: Optional[mx.array] = None  # (vocab,) each head row's repetition penalty by token (``penalties.py``)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class PassResult:
    """A pass's derived values: numpy arrays for the host, mx arrays kept.
    ``synced``: the pass ended in a blocking evaluation (a host
    synchronisation), whether or not it brought values to the host."""

    host: Dict[str, np.ndarray] = field(default_factory=dict)
    device: Dict[str, mx.array] = field(default_factory=dict)
    synced: bool = False

    def __getitem__(self, name: str):
        return self.host[name] if name in self.host else self.device[name]


def step_write(passes: Sequence[Pass]):
    """Where a step's passes write: the one pass's own write, or all of them packed."""
    return passes[0].write if len(passes) == 1 else PackedWrite([p.write for p in passes],
                                                                [len(p) for p in passes])


def forward(model, passes: Sequence[Pass], write=None, groups=None) -> mx.array:
    """Hidden states (N, dim) of all passes, packed in order (``write``:
    their ``step_write``, and ``groups``: its ``Runner.row_groups``, if
    already made)."""
    tokens = passes[0].tokens if len(passes) == 1 else mx.concatenate([p.tokens for p in passes])
    positions = passes[0].positions if len(passes) == 1 else mx.concatenate([p.positions for p in passes])
    write = step_write(passes) if write is None else write
    return Runner.of(model).hidden(tokens.astype(mx.int32), positions.astype(mx.int32), write, groups)


def head_chunk_rows(vocab: int) -> int:
    """Head rows per LM-head matmul. CPU paths: ``LOGITS_BUDGET_BYTES`` of
    float32 logits (~55 rows of a 151,671-token vocabulary), which keeps the
    working set in cache. GPU paths: every chunk re-reads the whole head
    weight, so as many rows as ``backend.logits_budget()`` (1/16 of the
    device's memory) holds -- in practice all of a step's head rows at once."""
    budget = backend.logits_budget() if backend.gpu_paths() else LOGITS_BUDGET_BYTES
    return max(1, budget // (4 * vocab))


def head_outputs(model, hidden: mx.array, passes: Sequence[Pass],
                 masks: Optional[Sequence[Optional[np.ndarray]]] = None) -> List[Optional[HeadOutput]]:
    """The LM head over every pass's head rows, in chunks; split back per pass.
    ``masks``: per pass, its head rows' grammar bitmasks or None (a step
    without a constrained pass gives none at all, and its head is unchanged)."""
    spans, start = [], 0
    for p in passes:
        end = start + len(p)
        spans.append((end - p.head_rows, end) if p.head_rows else None)
        start = end
    wanted = [(p, s) for p, s in zip(passes, spans) if s is not None]
    if not wanted:
        return [None] * len(passes)
    rows = [s for _, s in wanted]
    if len(rows) == 1:
        head_hidden = hidden[rows[0][0]:rows[0][1]]
    else:
        head_hidden = mx.concatenate([hidden[a:b] for a, b in rows])
    want_draft = any(p.drafting is not None for p, _ in wanted)
    want_follow = any(p.follow is not None for p, _ in wanted)
    drafting = [(p.drafting, p.head_rows) for p, _ in wanted]
    follow = None
    if want_follow:
        follow = mx.concatenate([p.follow if p.follow is not None else mx.zeros((p.head_rows,), mx.int32)
                                 for p, _ in wanted]) if len(wanted) > 1 else wanted[0][0].follow
    vocab = model.args.vocab_size
    allowed = None
    if masks is not None and any(m is not None for m in masks):
        by_pass = [m for m, s in zip(masks, spans) if s is not None]
        allowed = mx.concatenate([allowed_rows(m, vocab) if m is not None else mx.ones((p.head_rows, vocab), mx.bool_)
                                  for m, (p, _) in zip(by_pass, wanted)])
    per_chunk = head_chunk_rows(vocab)
    total = head_hidden.shape[0]
    top = max(p.top for p, _ in wanted)
    bias = row_vectors([p.bias for p, _ in wanted], [p.head_rows for p, _ in wanted], 0.0)
    repeat = row_vectors([p.repeat for p, _ in wanted], [p.head_rows for p, _ in wanted], 1.0)
    parts = []
    for i in range(0, total, per_chunk):
        logits = model.head(head_hidden[i:i + per_chunk])
        if logits.dtype != mx.float32:
            logits = logits.astype(mx.float32)
        if repeat is not None:
            logits = repeat_penalised(logits, repeat(i, logits.shape[0]))
        if bias is not None:
            logits = logits + bias(i, logits.shape[0])
        parts.append(row_statistics(logits, i, drafting if want_draft else None,
                                    None if follow is None else follow[i:i + per_chunk],
                                    None if allowed is None else allowed[i:i + per_chunk])
                     + (top_logprobs(logits, top) if top else (None, None)))
    draft, p_draft, p_follow, top_ids, top_values = (
        (mx.concatenate(col) if len(col) > 1 else col[0]) if col[0] is not None else None
        for col in zip(*parts))
    out: List[Optional[HeadOutput]] = []
    at = 0
    for p, s in zip(passes, spans):
        if s is None:
            out.append(None)
            continue
        n = s[1] - s[0]
        pick = (lambda a: None if a is None else a[at:at + n])
        tops = (lambda a: None if a is None or not p.top else a[at:at + n, :p.top])  # the pass's own top
        out.append(HeadOutput(pick(draft), pick(p_draft), pick(p_follow), tops(top_ids), tops(top_values)))
        at += n
    return out


def row_vectors(vectors: Sequence[Optional[mx.array]], rows: Sequence[int],
                neutral: float) -> Optional[Callable[[int, int], mx.array]]:
    """The passes' (vocab,) vectors (a bias, a repetition penalty's divisors; None: a pass without) for a
    chunk of ``n`` head rows from row ``first``: the one vector, broadcast, where every pass has the same (a
    request alone), else each row's gathered from a table whose row 0 is ``neutral`` (the passes without
    one). None when no pass has one: the head is then unchanged."""
    given = [v for v in vectors if v is not None]
    if not given:
        return None
    if len(given) == len(vectors) and all(v is given[0] for v in given):
        return lambda first, n: given[0]
    index, k = [], 0
    for v, n in zip(vectors, rows):
        k += v is not None
        index += [k if v is not None else 0] * n
    table = mx.stack([mx.full(given[0].shape, neutral, given[0].dtype), *given])
    index = mx.array(index, dtype=mx.int32)
    return lambda first, n: table[index[first:first + n]]


def device_only(derived: Sequence[Tuple[Dict[str, mx.array], Dict[str, mx.array]]],
                passes: Sequence[Pass]) -> bool:
    """Whether no host decision waits on this step: every pass derives
    values (no prefill chunk) and none of them is for the host. In a batch,
    one pass that needs the host makes the whole forward blocking."""
    return all(p.derive is not None and not host for p, (host, _) in zip(passes, derived))


def run_passes(model, passes: Sequence[Pass]) -> List[PassResult]:
    """One forward over all passes, the head, and one evaluation for all.

    Returns each pass's derived values; host values are numpy arrays (the
    one host synchronisation of the step), device values stay on the device.

    A step that needs no host value (every pass's ``derive`` returns an empty
    host dict, e.g. a batch of infill draft passes) ends in ``mx.async_eval``
    instead: the host goes on building the next pass while the device works,
    and ``PassResult.synced`` is False. Its device values are still being
    materialised, in order, before anything that reads them runs (the next
    pass takes them as inputs), so at most one step runs ahead of the host
    and what it was computed from is freed once it is done. Otherwise the step
    blocks on one ``mx.eval`` (prefill chunks included): ``synced`` is True.
    """
    runner = Runner.of(model)
    rows = sum(len(p) for p in passes)
    write = step_write(passes)
    groups = runner.row_groups(write, rows)  # made once: the BLAS threads and the forward follow them
    waited = runner.fit_threads(rows, groups)
    hidden = forward(runner, passes, write, groups)
    masks = None
    if any(p.masks is not None for p in passes):  # a constrained request: its grammar masks are
        mx.async_eval(hidden)  # computed on the host while the device runs the layers (no sync)
        masks = [p.masks() if p.masks is not None else None for p in passes]
    heads = head_outputs(model, hidden, passes, masks)
    derived = []
    for p, h in zip(passes, heads):
        derived.append(p.derive(h) if p.derive is not None else ({}, {}))
    to_eval = [a for host, device in derived for a in (*host.values(), *device.values())]
    if to_eval and device_only(derived, passes):
        mx.async_eval(*to_eval)  # no host synchronisation: the host builds the next pass meanwhile
        runner.left_running(rows, to_eval)
        return [PassResult({}, device, waited) for _, device in derived]
    for p in passes:
        if p.derive is None:  # a prefill chunk: materialise its cache's new rows now
            to_eval += p.write.cache.state()
    if getattr(model, "layer_range", None) is not None and not any(h or d for h, d in derived):
        # a pipeline rank's step with no output (prefill chunks, a constrained answer's last known tokens):
        # its cache rows need none of its sends, which the next rank's wait for (it hung there), so its
        # forward runs now, on every rank alike
        to_eval.append(hidden)
    mx.eval(*to_eval)  # blocks: the step's one host synchronisation, prefill chunks' included
    synced = bool(to_eval) or waited
    return [PassResult({k: np.array(v) for k, v in host.items()}, device, synced) for host, device in derived]
