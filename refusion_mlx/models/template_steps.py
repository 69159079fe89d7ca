"""Limits on chat templates: a model folder's template is code, and one that
loops for ever or builds a string of gigabytes must fail its render (the
request, or the command, in one line), not hold the server or the machine.

transformers renders chat templates in jinja's sandbox, which bounds each
``range`` to 100,000 items, but not loops inside loops (over ranges or over
strings), nor ``"x" * 10**10``, ``lipsum(10**7)`` or ``center(10**10)``.
Within :func:`step_limit`:

* every line the compiled template runs counts against a per-render budget
  of :data:`TEMPLATE_STEPS` (a trace function on the rendering thread, which
  looks at the template's own frames only);
* the template's ``*`` and ``**`` are checked before they run: a string or
  list of more than :data:`MAX_ITEMS` items, a number of more than
  :data:`MAX_BITS` bits, is refused; so are ``lipsum``, ``center`` and
  ``indent`` past those sizes;
* a template of more than :data:`MAX_TEMPLATE_CHARS` characters is refused
  before it is compiled.

Past a limit, rendering raises jinja's ``TemplateError``, which the caller
reports as the request's error (``decode.stream.render_chat``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
import sys
import threading

TEMPLATE_STEPS = 1_000_000  # template lines one rendering may run (a real template: a few thousand)
MAX_ITEMS = 1 << 22  # characters or items a template may make with one operation
MAX_BITS = 1 << 16  # bits of an integer a template may make with **
MAX_LIPSUM = 1000  # lipsum's paragraphs, and words in one
MAX_TEMPLATE_CHARS = 1 << 20  # a template's own text (a real one: a few KB)
TEMPLATE_FILE = "<template>"  # the file name jinja gives a template compiled from a string

_budget = threading.local()
_installed: set = set()
_lock = threading.Lock()


def _refuse(message: str):
    from jinja2.exceptions import SecurityError

    raise SecurityError(f"the chat template {message}")


def _size(value) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else 0


def _bounded_binop(context, op: str, left, right):
    """jinja's sandbox hook for the intercepted operators: ``*`` and ``**`` checked first."""
    if op == "*":
        count = right if isinstance(right, int) else left if isinstance(left, int) else None
        size = max(_size(left), _size(right))
        if count is not None and size and count * size > MAX_ITEMS:
            _refuse(f"made a sequence of {count * size} items (the most is {MAX_ITEMS})")
        return operator.mul(left, right)
    if op == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0 \
                and right * math.log2(abs(left)) > MAX_BITS:
            _refuse(f"made a number of over {MAX_BITS} bits")
        return operator.pow(left, right)
    return context.environment.binop_table[op](left, right)


def _bounded(name: str, fn, most: int, *positions: int):
    """``fn`` (a global or filter) with its integer arguments (at ``positions``, or named) held to ``most``."""
    @functools.wraps(fn)  # keeps jinja's pass_* marks
    def call(*args, **kwargs):
        given = [args[i] for i in positions if i < len(args)] + list(kwargs.values())
        for value in given:
            if isinstance(value, int) and not isinstance(value, bool) and value > most:
                _refuse(f"asked {name} for {value} (the most is {most})")
        return fn(*args, **kwargs)
    return call


def _checked(base: type) -> type:
    """jinja's sandbox with ``*`` and ``**`` intercepted: checked when they run,
    and never folded when the template compiles (``"x" * 10**10`` would be)."""
    class CheckedSandbox(base):
        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context, op, left, right):
            return _bounded_binop(context, op, left, right)

    return CheckedSandbox


def _install(template: str) -> None:
    """Compile ``template`` in transformers' cache (one per text) with the checked sandbox, sizes and globals."""
    with _lock:
        if template in _installed:
            return
        try:
            from transformers.utils import chat_template_utils as ctu
        except ImportError:  # pragma: no cover - another transformers: the step budget alone
            return
        base = ctu.ImmutableSandboxedEnvironment
        ctu.ImmutableSandboxedEnvironment = _checked(base)  # what its compile makes the environment of
        try:
            compiled = ctu._compile_jinja_template(template)
        finally:
            ctu.ImmutableSandboxedEnvironment = base
        env = compiled.environment
        if "*" not in env.intercepted_binops:  # compiled before (its constants folded): compiled again
            env.intercepted_binops = frozenset(["*", "**"])
            env.call_binop = lambda context, op, left, right: _bounded_binop(context, op, left, right)
            compiled.__dict__.update(env.from_string(template).__dict__)
        env.globals["lipsum"] = _bounded("lipsum", env.globals["lipsum"], MAX_LIPSUM, 0, 2, 3)  # paragraphs, words
        for name in ("center", "indent"):  # their width
            if name in env.filters:
                env.filters[name] = _bounded(name, env.filters[name], MAX_ITEMS, 1)
        _installed.add(template)


def _trace(frame, event, arg):
    if frame.f_code.co_filename != TEMPLATE_FILE:
        return None
    return _count


def _count(frame, event, arg):
    if event == "line":
        _budget.left -= 1
        if _budget.left < 0:
            from jinja2.exceptions import TemplateError

            raise TemplateError(f"the chat template ran past {_budget.steps} steps")
    return _count


@contextlib.contextmanager
def step_limit(tokenizer, steps: int = TEMPLATE_STEPS):
    """Within the block, renderings of ``tokenizer``'s chat template run at
    most ``steps`` template lines and make nothing past the sizes above. A
    trace function already set on the thread (a debugger, coverage) is left
    alone: then only the sizes are checked."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        if len(template) > MAX_TEMPLATE_CHARS:
            from jinja2.exceptions import TemplateError

            raise TemplateError(f"the chat template is {len(template)} characters long (the most is "
                                f"{MAX_TEMPLATE_CHARS})")
        _install(template)
    traced = sys.gettrace() is None
    _budget.left, _budget.steps = steps, steps
    if traced:
        sys.settrace(_trace)
    try:
        yield
    finally:
        if traced:
            sys.settrace(None)
