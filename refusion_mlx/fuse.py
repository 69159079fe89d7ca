"""``python -m refusion_mlx.fuse``: fold fine-tuned adapters into the base
weights and write a standalone model folder (:func:`refusion_mlx.convert.fusion.fuse`).

    python -m refusion_mlx.fuse --model M --adapter-path adapters --save-path fused
    python -m refusion_mlx.fuse --model refusion-4bit --adapter-path adapters --save-path fused-bf16 --dequantize
"""

from __future__ import annotations

import sys
from typing import List, Optional

from .cli import OneLineParser, adapter_folder, add_model_args, run
from .cli.mlx_lm_flags import FUSE_UNSUPPORTED, refuse
from .convert.fusion import fuse
from .errors import RefusionError

__all__ = ["build_parser", "fuse", "main"]


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="python -m refusion_mlx.fuse",
                           description="Fuse fine-tuned adapters into the base model and save a standalone folder.")
    add_model_args(parser, adapters=False,
                   model_help="base model folder or hub repo id (default: the bundled demo model)",
                   dtype_help="dtype of the written floating tensors (default: the checkpoint's)")
    parser.add_argument("--adapter-path", type=adapter_folder, default="adapters",
                        help="adapter folder (default: adapters)")
    parser.add_argument("--save-path", default="fused_model", help="output folder (default: fused_model)")
    parser.add_argument("--dequantize", action="store_true", help="write plain (dequantized) weights")
    parser.add_argument("--force", action="store_true",
                        help="replace the model folder at --save-path (never a file or another folder)")
    refuse(parser, FUSE_UNSUPPORTED)  # mlx_lm.fuse's flags with no like here: one line each says why
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        try:
            out = fuse(args.model, args.adapter_path, args.save_path, args.dequantize, args.force, args.dtype)
        except OSError as e:
            raise RefusionError(f"{e.strerror or e} ({e.filename or args.save_path})") from None
        print(f"Saved the fused model to {out}")
        return 0

    return run(body)


if __name__ == "__main__":
    sys.exit(main())
