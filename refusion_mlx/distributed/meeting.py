"""The ranks' way to ready: where they meet before decoding, and what a rank
that fails on the way does.

From joining the group (``group.init``) to the barrier after loading
(``cli/launch.py: ready``) the ranks meet twice, each time in a
:func:`checkpoint` (a :func:`~.broadcast.gather` under the loading's limit,
``watchdog.loading``): the model check (:func:`same_model`) and the barrier.
A rank that fails before then (no model folder, a bad prompts file, heads
that do not divide) meets the others where they wait with its message
instead (:func:`meet`, from ``group.say_error``), so every rank hears of
every failure and rank 0 alone says it, each distinct message once as the
line of the rank it is from (``group.Agreed``): all ranks failing alike is
one line, a follower failing alone is its own line, said by rank 0. A rank
that cannot reach the others (a lost link) says its own.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import mlx.core as mx

from .._version import __version__
from . import watchdog
from .broadcast import gather
from .group import Agreed, Distributed


def checkpoint(dist: Distributed, payload: Any = None) -> list:
    """Every rank's ``payload``, in rank order; or, when a rank met the
    others here with its failure (:func:`meet`), :class:`~.group.Agreed`
    naming the failures, raised on every rank that did not fail."""
    try:
        with watchdog.loading():  # another rank may still be downloading or reading the model
            everyone = gather(dist, (True, payload))
    except BaseException:  # a lost link (whoever reports it, wrapped or not): nobody left to meet
        dist.meeting = False
        raise
    said = _failures(everyone)
    if said:
        dist.meeting = False
        raise Agreed(said)
    return [p for _, p in everyone]


def meet(dist: Distributed, message: str) -> List[Tuple[int, str]]:
    """This rank failed on its way to ready: it meets the others at the
    checkpoint they wait in, with ``message``. What it says then: on rank 0
    every rank's failure (each distinct message once, as its rank's), on the
    others nothing; its own alone when the others cannot be reached."""
    dist.meeting = False
    try:
        with watchdog.loading():
            everyone = gather(dist, (False, message))
    except Exception:  # the others are gone (a lost link): this rank's own line
        return [(dist.rank, message)]
    return _failures(everyone) if dist.leader else []


def _failures(everyone: list) -> List[Tuple[int, str]]:
    seen: set = set()
    return [(rank, message) for rank, (ok, message) in enumerate(everyone)
            if not ok and message not in seen and not seen.add(message)]


def same_model(dist: Distributed, parts: Dict[str, str]) -> None:
    """Every rank loads what rank 0 loads, under the same refusion-mlx and MLX:
    ``parts``, a hash per file of its model (``models/fingerprint.py``) and
    its settings (``--dtype``, the device paths); or every rank raises one
    :class:`~.group.Agreed` naming the ranks that differ and what (rank 0
    says it). Mismatched ranks decoded other text unsaid, or failed later at
    a collective, as a lost rank."""
    everyone = checkpoint(dist, {**parts, "refusion-mlx version": __version__, "MLX version": mx.__version__})
    lead = everyone[0]
    differ = {rank: {k for k in {*lead, *mine} if lead.get(k) != mine.get(k)}
              for rank, mine in enumerate(everyone) if mine != lead}
    if differ:
        many, what = len(differ) > 1, sorted(set().union(*differ.values()))
        dist.meeting = False
        raise Agreed([(0, f"rank{'s' if many else ''} {', '.join(map(str, differ))} loaded another model than "
                          f"rank 0 ({'their' if many else 'its'} {', '.join(what)} "
                          f"differ{'' if len(what) > 1 else 's'}): give every rank the same")])
