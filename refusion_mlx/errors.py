"""Errors that reach a user as one line (CLI: non-zero exit; server: HTTP 4xx)."""

from typing import Optional


class RefusionError(ValueError):
    """A problem with the user's input or files."""


class ConfigError(RefusionError):
    """A config.json this runtime cannot run."""


class LoadError(RefusionError):
    """A model folder or hub id that cannot be loaded."""


class DecodeError(RefusionError):
    """Invalid decoding parameters or prompt."""


class GrammarLimit(DecodeError):
    """A request's constraint past the grammar engine's limits, found while
    decoding under it (a schema whose alternatives grow a parser row past
    its bound): the request's fault, not the decoder's. ``param``: the
    constraint's name (its field)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class Terminated(KeyboardInterrupt):
    """SIGTERM raised as the KeyboardInterrupt Ctrl-C raises, so that a command
    which saves its work on Ctrl-C (``train``) saves it on SIGTERM too; the
    command line then exits 143 (128 + SIGTERM) instead of 130."""


class PendingStop:
    """The Ctrl-C or SIGTERM a command's signal handler raised (:meth:`raise_`), kept until the loop it
    stops has seen it: Python drops an exception that a handler raises while a ``__del__`` or a weakref
    callback runs (it prints "Exception ignored" and goes on), and the training went on for good after
    its SIGTERM. ``train``'s loop stops at its next step while one is pending."""

    pending: Optional[KeyboardInterrupt] = None

    @classmethod
    def raise_(cls, interrupt: KeyboardInterrupt):
        cls.pending = interrupt
        raise interrupt


def brief(e: BaseException) -> str:
    """An exception in one line, as a log or an error message shows the runtime's own: its type and its
    first 300 characters."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"

