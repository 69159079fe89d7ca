"""``python -m refusion_mlx COMMAND [FLAGS]``: the same as ``python -m refusion_mlx.COMMAND [FLAGS]``
(as ``python -m mlx_lm generate`` is mlx-lm's ``python -m mlx_lm.generate``)."""

import runpy
import sys

from ._startup import COMMANDS


def main() -> int:
    usage = f"usage: python -m refusion_mlx {{{','.join(COMMANDS)}}} [FLAGS]"
    name = sys.argv[1] if len(sys.argv) > 1 else None
    if name in ("-h", "--help"):
        print(f"{usage}\n\nEach command's flags: python -m refusion_mlx COMMAND --help")
        return 0
    if name not in COMMANDS:
        said = "a command is missing" if name is None else f"unknown command {name!r}"
        print(f"python -m refusion_mlx: error: {said}: give one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    sys.argv = [f"refusion_mlx.{name}", *sys.argv[2:]]
    runpy.run_module(f"refusion_mlx.{name}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
