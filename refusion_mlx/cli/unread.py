"""Flags a command parses but would not read: refused in one line (argparse's
error, exit 2), never ignored. A flag of one mode given without it
(``generate --batch-size`` without ``--prompts-file``, ``chat --frame-time``
without ``--visualize``, ``bench --budgets`` without ``--layouts``), or one
that a mode does not read given with it (``bench --repeat`` with
``--layouts``), would otherwise run as if it were not there."""

from __future__ import annotations

import argparse
from typing import Any, Mapping, Sequence


def refuse_unread(parser: argparse.ArgumentParser, args: argparse.Namespace,
                  goes_with: Mapping[str, Sequence[str]], unread: Mapping[str, Sequence[str]] = {}) -> None:
    """``parser.error`` for a flag of ``goes_with[mode]`` given without
    ``mode``, or one of ``unread[mode]`` given with it (each by its ``dest``).
    A flag is given when its value is neither None nor False: such a flag's
    parser default is None, and the command fills its default in after
    (:func:`fill_defaults`)."""
    spelled = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    given = {name for name, value in vars(args).items() if value is not None and value is not False}
    for mode, flags in goes_with.items():
        for flag in flags:
            if flag in given and not getattr(args, mode):
                parser.error(f"{spelled[flag]} goes with {spelled[mode]}")
    for mode, flags in unread.items():
        for flag in flags:
            if flag in given and getattr(args, mode):
                parser.error(f"{spelled[flag]} does not go with {spelled[mode]} (it does not read it)")


def fill_defaults(args: argparse.Namespace, defaults: Mapping[str, Any]) -> None:
    """The defaults of the flags :func:`refuse_unread` checked (None in the parser: not given)."""
    for flag, default in defaults.items():
        if getattr(args, flag) is None:
            setattr(args, flag, default)
