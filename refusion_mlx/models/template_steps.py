"""A step limit on chat templates: a model folder's template is code, and
one that loops for ever (nested ``range(100000)`` loops, say) must fail its
request, not hold the server.

transformers renders chat templates in jinja's sandbox, which bounds each
``range`` to 100,000 items but not loops inside loops. :func:`step_limit`
gives the tokenizer's compiled template a ``range`` whose iterations count
against a per-render budget (per thread): past it, rendering raises a
``TemplateError`` ("ran past N steps"), which the caller reports as the
request's error. Outside a ``step_limit`` block the count is not kept.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Iterator

TEMPLATE_STEPS = 1_000_000  # range iterations one rendering may take (a real template: a few hundred)
MAX_RANGE = 100_000  # jinja's sandbox bound on one range, kept

_budget = threading.local()
_installed: set = set()


class _CountedRange(Sequence):
    """A range whose iteration spends the thread's budget."""

    def __init__(self, r: range):
        self.r = r

    def __len__(self) -> int:
        return len(self.r)

    def __getitem__(self, i):
        return self.r[i]

    def __iter__(self) -> Iterator[int]:
        for value in self.r:
            left = getattr(_budget, "left", None)
            if left is not None:
                if left <= 0:
                    from jinja2.exceptions import TemplateError

                    raise TemplateError(f"the chat template ran past {_budget.steps} steps")
                _budget.left = left - 1
            yield value


def counted_range(*args: int) -> _CountedRange:
    r = range(*args)
    if len(r) > MAX_RANGE:
        from jinja2.exceptions import SecurityError

        raise SecurityError(f"range too big: {len(r)} items (the most is {MAX_RANGE})")
    return _CountedRange(r)


def _install(template: str) -> None:
    """Give transformers' compiled ``template`` (it caches one per text) the counted range."""
    if template in _installed:
        return
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # pragma: no cover - another transformers: no step limit, jinja's own bounds stay
        return
    _compile_jinja_template(template).environment.globals["range"] = counted_range
    _installed.add(template)


@contextlib.contextmanager
def step_limit(tokenizer, steps: int = TEMPLATE_STEPS):
    """Within the block, renderings of ``tokenizer``'s chat template take at most ``steps`` range iterations."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        _install(template)
    _budget.left, _budget.steps = steps, steps
    try:
        yield
    finally:
        _budget.left = None
