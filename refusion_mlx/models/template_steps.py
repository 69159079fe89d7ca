"""Limits on chat templates: a model folder's template is code, and one that
loops for ever or builds a string of gigabytes must fail its render (the
request, or the command, in one line), not hold the server or the machine.

transformers renders chat templates in jinja's sandbox, which bounds each
``range`` to 100,000 items, but not loops inside loops (over ranges or over
strings), nor ``"x" * 10**10``, ``lipsum(10**7)`` or ``center(10**10)``.
Within :func:`step_limit`:

* every line the compiled template runs counts against a per-render budget
  of :data:`TEMPLATE_STEPS` (a trace function on the rendering thread, which
  looks at the template's own frames only), and a rendering ends after
  :data:`TEMPLATE_SECONDS` (checked there and at every Python call, jinja's
  filters and generators included: a line may do much work);
* what could make a string, list or number past :data:`MAX_ITEMS` items (or
  :data:`MAX_BITS` bits) is checked before it runs: the operators ``*``,
  ``**``, ``+``, ``%`` and ``~``; every call the template makes (an integer
  argument, ``join``, ``replace``, ``str.format``'s widths); the filters of
  :data:`FILTER_LIMITS` (``slice``, ``batch``: the parts they make; ``join``,
  ``sum``, ``wordwrap``, ``string``...: what they would make) and ``lipsum``;
  a value written out (``{{ x }}``, ``~``, ``%``) is measured first (``[l] *
  4000000`` is short but writes out long); all those operations make at most
  :data:`MAX_MADE` in all, and a rendering writes at most :data:`MAX_OUTPUT`;
* nothing of the template runs while it compiles (jinja folds constant
  expressions then, past every check: ``"x" * 10**10`` took 24 GB);
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
import re
import sys
import threading
import time
from typing import Optional

TEMPLATE_STEPS = 1_000_000  # template lines one rendering may run (a real template: a few thousand)
TEMPLATE_SECONDS = 10.0  # how long one rendering may run (a real template: milliseconds; 6,000 turns: a second)
MAX_MADE = 1 << 27  # characters or items one rendering may make with those operations, all told
MAX_PARTS = 1 << 16  # lists one ``slice`` may make (each a list of its own)
MAX_ITEMS = 1 << 22  # characters or items a template may make with one operation
MAX_BITS = 1 << 16  # bits of an integer a template may make with **
MAX_LIPSUM = 1000  # lipsum's paragraphs, and words in one
MAX_INDENT = 64  # tojson's indent
MAX_OUTPUT = 1 << 26  # characters one rendering may write (a context of 1M tokens is some 5M)
_PRINTF = re.compile(r"%[-+ #0]*(\d+)?(?:\.(\d+))?")
_BRACES = re.compile(r"\{[^{}]*?:([^{}]*)\}")
MAX_TEMPLATE_CHARS = 1 << 20  # a template's own text (a real one: a few KB)
TEMPLATE_FILE = "<template>"  # the file name jinja gives a template compiled from a string

_budget = threading.local()
_installed, _lock = set(), threading.Lock()  # the templates whose filters are checked, and its lock


def _refuse(message: str):
    from jinja2.exceptions import SecurityError

    raise SecurityError(f"the chat template {message}")


def _size(value) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else 0


def _text_size(value, limit: int = MAX_ITEMS) -> int:
    """About how many characters ``value`` writes out (a list of one list
    repeated counts that list each time), counted until past ``limit``."""
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, dict):
            total += 2 + 4 * len(item)
            stack += [*item.keys(), *item.values()] if total <= limit else []
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(item)
            stack += item if total <= limit else []
        else:  # jinja's namespace() writes out its dict
            total += 8
            stack += [object.__getattribute__(item, "_Namespace__attrs")] if type(item).__name__ == "Namespace" else []
    return total


def _check_text(value, what: str = "wrote out"):
    if _text_size(value) > MAX_ITEMS:
        _refuse(f"{what} a value of over {MAX_ITEMS} characters")
    return value


def _made(size: int) -> None:
    """Count ``size`` items made against the rendering's MAX_MADE (2,000 distinct strings of 4M are 8 GB)."""
    _budget.made = getattr(_budget, "made", 0) + size
    if _budget.made > MAX_MADE:
        _refuse(f"made over {MAX_MADE} characters or items in all")


def _check_format(fmt: str) -> None:
    """A printf or ``str.format`` string whose widths or precisions would make more than MAX_ITEMS."""
    specs = [m.groups() for m in _PRINTF.finditer(fmt)]
    specs += [re.findall(r"\d+", m.group(1)) for m in _BRACES.finditer(fmt)]
    for number in (n for spec in specs for n in spec if n):
        if int(number) > MAX_ITEMS:
            _refuse(f"formats a field {number} wide (the most is {MAX_ITEMS})")


def _bounded_binop(context, op: str, left, right):
    """jinja's sandbox hook for the intercepted operators: ``*``, ``**``, ``+`` and ``%`` checked first."""
    if op == "+" and _size(left) and _size(right):
        if _size(left) + _size(right) > MAX_ITEMS:
            _refuse(f"made a sequence of {_size(left) + _size(right)} items (the most is {MAX_ITEMS})")
        _made(_size(left) + _size(right))
    if op == "%" and isinstance(left, str):
        _check_format(left)
        _check_text(right, "formatted")
    if op == "*":
        count = right if isinstance(right, int) else left if isinstance(left, int) else None
        size = max(_size(left), _size(right))
        if count is not None and size and count * size > MAX_ITEMS:
            _refuse(f"made a sequence of {count * size} items (the most is {MAX_ITEMS})")
        _made(count * size if count is not None and size else 0)
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


def _checked_call(obj, args: tuple, kwargs: dict) -> tuple:
    """The arguments of a call the template makes, checked against what it
    would make: no integer past MAX_ITEMS (``"a".ljust(10**10)``), no join or
    replace past it. A join's items come back as a list (a generator is read once)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_ITEMS:
            _refuse(f"called {getattr(obj, '__name__', 'a function')} with {value} (the most is {MAX_ITEMS})")
    target, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if isinstance(target, str) and name == "join" and args:
        items = list(args[0])
        size = len(target) * max(len(items) - 1, 0) + sum(len(i) if isinstance(i, str) else 0 for i in items)
        if size > MAX_ITEMS:
            _refuse(f"joined {size} characters (the most is {MAX_ITEMS})")
        args = (items, *args[1:])
    if isinstance(target, str) and name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        old, new = args[:2]
        size = len(target) + (target.count(old) if old else len(target) + 1) * (len(new) - len(old))
        if size > MAX_ITEMS:
            _refuse(f"replaced into {size} characters (the most is {MAX_ITEMS})")
    return args, kwargs


def _bounded_join(join, most: int = MAX_ITEMS):
    """jinja's ``str_join`` / ``markup_join`` (the ``~`` operator) held to
    ``most`` characters; its ``concat`` (a rendering's, a macro's output) to MAX_OUTPUT."""
    def bounded(seq):
        parts = list(seq)
        size = _text_size(parts, most)
        if size > most:
            _refuse(f"joined over {most} characters" + (" with ~" if most == MAX_ITEMS else ""))
        _made(size if most == MAX_ITEMS else 0)
        return join(parts)
    return bounded


def _checked_str(value=""):
    """``str`` as the compiled template calls it: what a value writes out, measured first."""
    return str(_check_text(value))


def _bounded_output(render):
    """A template's render function whose output stops at MAX_OUTPUT characters."""
    def bounded(context):
        total = 0
        for piece in render(context):
            total += len(piece)
            _tick()
            if total > MAX_OUTPUT:
                _refuse(f"wrote over {MAX_OUTPUT} characters")
            yield piece
    return bounded


def _checked(base: type) -> type:
    """jinja's sandbox with ``*``, ``**``, ``+`` and ``%`` intercepted: checked
    when they run, and never folded when the template compiles (``"x" *
    10**10`` would be); calls and ``str.format`` checked before they run."""
    class CheckedSandbox(base):
        intercepted_binops = frozenset(["*", "**", "+", "%"])

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.optimized = False  # nothing of the template runs as it compiles (folded filters would, unchecked)
            self.filters = _CheckedFilters(self.filters)

        def call_binop(self, context, op, left, right):
            return _bounded_binop(context, op, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
            args, kwargs = _checked_call(__obj, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value):
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            fmt = getattr(value, "__self__", "")

            def checked(*args, **kwargs):
                _check_format(fmt if isinstance(fmt, str) else "")
                _check_text([args, kwargs], "formatted")
                return wrapped(*args, **kwargs)
            return checked

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
            env.__class__ = _checked(type(env))  # the same environment (its filters and globals), checked
            env.optimized, env.filters = False, _CheckedFilters(env.filters)
            compiled.__dict__.update(env.from_string(template).__dict__)
        names = compiled.root_render_func.__globals__  # the compiled template's own namespace
        for name in ("str_join", "markup_join"):
            if name in names:
                names[name] = _bounded_join(names[name])
        names["str"] = _checked_str  # what ``{{ x }}`` writes out
        env.concat = _bounded_join(env.concat, MAX_OUTPUT)  # a macro's or a block set's output
        compiled.root_render_func = _bounded_output(compiled.root_render_func)
        env.globals["lipsum"] = _bounded("lipsum", env.globals["lipsum"], MAX_LIPSUM, 0, 2, 3)  # paragraphs, words
        _installed.add(template)


def _join_size(value, d="", attribute=None):
    items = list(value)
    if len(str(d)) * max(len(items) - 1, 0) + _text_size(items) > MAX_ITEMS:
        _refuse(f"joined over {MAX_ITEMS} characters")
    return items


def _sum_size(value, attribute=None, start=0):
    items = list(value)
    if isinstance(start, (list, tuple)):
        size = len(start) + sum(_text_size(i) for i in items)  # what the items are, or hold
        if size > MAX_ITEMS:
            _refuse(f"summed over {MAX_ITEMS} items")
    return items


def _wrap_size(value, width=79, break_long_words=True, wrapstring=None, *rest, **kwargs):
    if len(str(_check_text(value))) * (1 + len(str(wrapstring or ""))) > MAX_ITEMS:  # a line a character at most
        _refuse(f"wrapped into over {MAX_ITEMS} characters")
    return value


# the filters checked before they run: the most their integer arguments may be, and where those stand
# (among all jinja hands them: an eval context or environment first, for slice and wordwrap too)
FILTER_LIMITS = {"format": (MAX_ITEMS, ()), "center": (MAX_ITEMS, (1,)), "indent": (MAX_ITEMS, (1,)),
                 "tojson": (MAX_INDENT, (2,)), "replace": (MAX_ITEMS, (3,)), "slice": (MAX_PARTS, (2,)),
                 "batch": (MAX_ITEMS, (1,)), "join": (MAX_ITEMS, ()), "sum": (MAX_ITEMS, ()),
                 "wordwrap": (MAX_ITEMS, (2,)), "string": (MAX_ITEMS, ()), "pprint": (MAX_ITEMS, ())}
# those whose value (and arguments) are measured first: each gives the value back (a generator read once)
_VALUE_SIZES = {"join": _join_size, "sum": _sum_size, "wordwrap": _wrap_size,
                "string": lambda value: _check_text(value), "pprint": lambda value: _check_text(value),
                "tojson": lambda value, *_, **__: _check_text(value),
                "format": lambda value, *args, **kwargs: (_check_text([args, kwargs], "formatted"), value)[1]}


def _checked_filter(name: str, fn):
    """Filter ``name`` with its arguments checked before it runs (``format``:
    its widths). It takes the context, so the compiler never runs it on
    constants while compiling, where nothing would check it."""
    from jinja2 import pass_context
    from jinja2.utils import _PassArg

    most, positions = FILTER_LIMITS[name]
    sized = _bounded(name, fn, most, *positions)
    takes = _PassArg.from_obj(fn)  # what jinja hands the filter first, if anything

    @pass_context
    def checked(context, value, *args, **kwargs):
        if name == "format" and isinstance(value, str):
            _check_format(value)
        if name == "replace" and len(args) >= 2:
            _checked_call(str(value).replace, args[:2], {})
        if name in _VALUE_SIZES:
            value = _VALUE_SIZES[name](value, *args, **kwargs)
        first = {_PassArg.context: (context,), _PassArg.eval_context: (context.eval_ctx,),
                 _PassArg.environment: (context.environment,)}.get(takes, ())
        return sized(*first, value, *args, **kwargs)
    checked.refusion_checked = True
    return checked


class _CheckedFilters(dict):
    """A sandbox's filters, those of FILTER_LIMITS checked, whenever they are set."""

    def __init__(self, filters):
        super().__init__()
        for name, fn in filters.items():
            self[name] = fn

    def __setitem__(self, name, fn):
        if name in FILTER_LIMITS and not getattr(fn, "refusion_checked", False):
            fn = _checked_filter(name, fn)
        super().__setitem__(name, fn)


def _tick() -> None:
    """A rendering past its time fails (the clock read every 1024 ticks; a render outside step_limit has none)."""
    _budget.ticks = getattr(_budget, "ticks", 1024) - 1
    if _budget.ticks <= 0:
        _budget.ticks = 1024
        if time.monotonic() > getattr(_budget, "deadline", math.inf):
            from jinja2.exceptions import TemplateError

            raise TemplateError(f"the chat template ran past {_budget.seconds:g} seconds")


def _trace(frame, event, arg):
    _budget.ticks -= 1  # every Python call ticks, jinja's own too (a filter's loop); inline: it runs per call
    if _budget.ticks <= 0:
        _tick()
    if frame.f_code.co_filename != TEMPLATE_FILE:
        return None
    return _count


def _count(frame, event, arg):
    if event == "line":
        _budget.left -= 1
        _tick()
        if _budget.left < 0:
            from jinja2.exceptions import TemplateError

            raise TemplateError(f"the chat template ran past {_budget.steps} steps")
    return _count


@contextlib.contextmanager
def step_limit(tokenizer, steps: int = TEMPLATE_STEPS, seconds: Optional[float] = None):
    """Within the block, renderings of ``tokenizer``'s chat template run at
    most ``steps`` template lines and ``seconds`` (TEMPLATE_SECONDS), and make nothing past the sizes
    above. A trace function already set on the thread (a debugger, coverage) is left alone: then only
    the sizes are checked."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        if len(template) > MAX_TEMPLATE_CHARS:
            from jinja2.exceptions import TemplateError

            raise TemplateError(f"the chat template is {len(template)} characters long (the most is "
                                f"{MAX_TEMPLATE_CHARS})")
        _install(template)
    traced = sys.gettrace() is None
    _budget.left, _budget.steps, _budget.ticks, _budget.made = steps, steps, 1, 0
    _budget.seconds = TEMPLATE_SECONDS if seconds is None else seconds
    _budget.deadline = time.monotonic() + _budget.seconds
    if traced:
        sys.settrace(_trace)
    try:
        yield
    finally:
        _budget.deadline = math.inf
        if traced:
            sys.settrace(None)
