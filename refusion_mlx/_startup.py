"""A command's start: until its flags are parsed (the imports of MLX and the
rest take a second), Ctrl-C ends it with "interrupted" and exit 130, not a
traceback from inside an import; :func:`started` hands Ctrl-C back to the
command (KeyboardInterrupt, which each command turns into the same line).
A command starts as ``python -m refusion_mlx.<command>`` or as its console
script (``refusion-<command>``, pyproject.toml's ``[project.scripts]``)."""

from __future__ import annotations

import os
import signal
import sys
from typing import Optional

# the console scripts pip installs (pyproject.toml's [project.scripts]): refusion-<command>
SCRIPTS = ("refusion-generate", "refusion-convert", "refusion-chat", "refusion-server", "refusion-bench",
           "refusion-train", "refusion-fuse")
COMMANDS = tuple(script.removeprefix("refusion-") for script in SCRIPTS)  # python -m refusion_mlx COMMAND


def console_script() -> Optional[str]:
    """The name of the console script this process runs (``refusion-chat``), or None: its ``argv[0]`` is
    the script's path (on Windows with ``.exe`` or ``-script.py`` until pip's launcher takes them off)."""
    name = os.path.basename(sys.argv[0]) if sys.argv and isinstance(sys.argv[0], str) else ""
    for suffix in (".exe", "-script.pyw", "-script.py"):
        name = name.removesuffix(suffix)
    return name if name in SCRIPTS else None


def starting() -> bool:
    """Whether the process is one of the commands, starting: ``python -m refusion_mlx.<command>`` imports
    the package (its ``argv[0]`` is ``-m`` until the module runs), or a console script does. A user's
    ``python -m theirs`` that imports the package is not (its Ctrl-C stays its own)."""
    if console_script() is not None:
        return True
    return sys.argv[:1] == ["-m"] and (command() or "").startswith("refusion_mlx.")


def command() -> Optional[str]:
    """The module this process runs as a command (``refusion_mlx.generate`` for ``python -m
    refusion_mlx.generate`` or ``refusion-generate``), or None: read from ``sys.orig_argv``, since
    ``sys.argv`` is ``-m`` while the package imports."""
    script = console_script()
    if script is not None:
        return "refusion_mlx." + script.removeprefix("refusion-")
    args = iter(getattr(sys, "orig_argv", [])[1:])
    for arg in args:
        if arg == "--check-hash-based-pycs":
            next(args, None)  # the option's value
        elif arg == "-" or not arg.startswith("-"):
            return None  # a script: not one of our commands
        elif not arg.startswith("--"):  # short flags, bundled as CPython takes them: -um mod, -Wignore, -mmod
            for i, flag in enumerate(arg[1:], 1):
                if flag in "mcWX":  # the last of a bundle: its value is the rest or the next argument
                    value = arg[i + 1:] or next(args, None)
                    if flag == "m" and value in ("refusion_mlx", "refusion_mlx.__main__"):  # -m refusion_mlx generate
                        given = next(args, None)
                        return f"refusion_mlx.{given}" if given in COMMANDS else value
                    if flag in "mc":
                        return value if flag == "m" else None
                    break
    return None


def leave_out_torch() -> None:
    """A command that never runs PyTorch (all but ``refusion_mlx.convert``, which reads .bin
    checkpoints) keeps transformers from importing it where it is installed: the tokenizer's load
    imports transformers, which imports torch whenever it can (the demo's ``generate`` took 3.0 s
    and 330 MB with it, 1.2 s and 150 MB without). ``None`` in ``sys.modules`` is Python's way to
    say a module is not there: ``importlib.util.find_spec`` answers None, as transformers asks."""
    name = command() or ""
    if name.startswith("refusion_mlx.") and not name.startswith("refusion_mlx.convert") and "torch" not in sys.modules:
        sys.modules["torch"] = None


def _interrupted(signum, frame):
    """Ctrl-C before the command runs: nothing has begun that needs cleaning up, so the process ends here,
    at once. An exception raised from here lands inside whatever import is running, where Python may wrap
    it (3.11 turns one raised in a class's ``__set_name__``, as a dataclass field's, into a RuntimeError:
    a traceback and exit 1)."""
    try:
        sys.stderr.write("interrupted\n")
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):  # no standard error, or a closed one: the exit still says it
        pass
    os._exit(130)


def quiet_interrupts() -> None:
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted)


def started() -> None:
    """The command runs: Ctrl-C is KeyboardInterrupt again."""
    if signal.getsignal(signal.SIGINT) is _interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def freeze_imports(*modules: str) -> None:
    """Import ``modules`` now, then take every object alive (the imports' modules, classes and functions:
    ~110k objects in the server) out of the cyclic garbage collector's scans (``gc.freeze``): a full
    collection, which Python runs now and then and which holds the GIL (the HTTP side and the engine wait),
    took 95 ms in the server, 4 ms after. What is frozen is never collected as a cycle, so it runs before
    anything that may later become one (a model, a request): plain reference counting frees it as ever. A
    module that fails to import is left to whatever imports it later, to say so in its own words."""
    import gc
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 (a broken install is the tokenizer's load's to report, in one line)
            pass
    gc.collect()
    gc.freeze()
