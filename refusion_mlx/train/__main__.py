"""``python -m refusion_mlx.train``: fine-tune a ReFusion model with its hybrid
objective (LoRA, DoRA, full; QLoRA on a quantized model), mlx-lm's flags.
Ctrl-C or SIGTERM saves the adapters of the last completed step (exit 130, 143)."""

from __future__ import annotations

import signal
import sys
from typing import List, Optional

from ..cli import OneLineParser, run
from ..cli.mlx_lm_flags import refuse
from ..errors import PendingStop, RefusionError, Terminated
from .config import MLX_LM_OFF, add_flags, check_data, flag, merge, named


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="python -m refusion_mlx.train",
        description="Fine-tune a ReFusion model with the paper's hybrid objective (AR within unmasked slots, "
                    "MDM on masked slots); adapters in mlx-lm's format.")
    add_flags(parser)
    # mlx_lm.lora's flags this trainer has no use for (a YAML file may hold their off values): one line says why
    refuse(parser, {(flag(k),): not isinstance(off, bool) for k, (off, _) in MLX_LM_OFF.items() if k != "config"},
           {k: reason for k, (_, reason) in MLX_LM_OFF.items()})
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    try:
        options = merge(args, args.get("config"))  # bad values are usage errors, before anything loads
        check_data(options["data"], named("data", options["given"]))
        check_optimizer(options)
    except RefusionError as e:
        parser.error(str(e))
    if options["data"] is None:
        parser.error("--data is required (a folder with train.jsonl and valid.jsonl)")

    def body() -> int:
        from .run import fine_tune

        fine_tune(**args)
        return 0

    # SIGTERM (a supervisor, `kill`, a closing session) saves the adapters of the last step, as Ctrl-C does;
    # both are kept pending too, for the loop to see if Python dropped the raise (errors.PendingStop)
    previous = signal.signal(signal.SIGTERM, _terminate)
    previous_int = signal.getsignal(signal.SIGINT)
    if previous_int is signal.default_int_handler:  # not where it is ignored (a shell's background job)
        signal.signal(signal.SIGINT, _interrupt)
    try:
        return run(body)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if signal.getsignal(signal.SIGINT) is _interrupt:
            signal.signal(signal.SIGINT, previous_int)
        PendingStop.pending = None


def check_optimizer(options: dict) -> None:
    """A bad ``lr_schedule`` or ``optimizer_config`` (YAML) is a usage error, found before the model loads."""
    if options["lr_schedule"] or options["optimizer_config"]:
        from .trainer import build_optimizer

        build_optimizer(options["optimizer"], options["learning_rate"], options["lr_schedule"],
                        options["optimizer_config"], options["iters"])


def _terminate(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends at once
    PendingStop.raise_(Terminated())


def _interrupt(signum, frame):
    PendingStop.raise_(KeyboardInterrupt())


if __name__ == "__main__":
    sys.exit(main())
