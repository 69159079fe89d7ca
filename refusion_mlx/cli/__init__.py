"""The terminal side of the commands: the flags and one-line errors every
``python -m refusion_mlx.<command>`` shares (``flags``; ``unread``: flags
refused where they would not be read), and the chat's loop
(``repl``), its live slot view (``slot_view``) and its trace (``trace``);
the files a command writes (``output``); the signal handlers a command
installs, and puts back (``signals``).

The layers below it (``models``, ``decode``) never import this package: the
Python API works without it. The commands use it, and so do the layers above
it: ``convert``'s and ``train``'s commands (``train.accuracy`` too), the
server's configuration (``serve.server_config``: the flags into settings) and
engine (``cli.launch.ready``: a rank's start signal), and ``bench``.
"""

from .flags import (OneLineParser, Spelled, adapter_folder, add_adapter_arg, add_decoding_args, add_kv_args,
                    add_model_args, add_template_arg, byte_size, count, fitted, output_file, params_from_args,
                    positive_int, positive_ints, read_input, read_text, run, spelled, storage_from_args,
                    without_line_end)
from .output import check_writable, write_text
from .signals import handle_unless_ignored, handlers_kept, interrupt_once, raise_interrupt_once
from .unread import fill_defaults, refuse_unread

__all__ = ["OneLineParser", "Spelled", "adapter_folder", "add_adapter_arg", "add_decoding_args", "add_kv_args",
           "add_model_args", "add_template_arg", "byte_size", "check_writable", "count", "fitted",
           "fill_defaults", "handle_unless_ignored", "handlers_kept", "interrupt_once", "output_file",
           "params_from_args", "positive_int", "positive_ints", "raise_interrupt_once", "read_input", "read_text",
           "refuse_unread", "run", "spelled", "storage_from_args", "without_line_end", "write_text"]
