"""refusion-mlx's start-up hook: an optimized BLAS under MLX whatever the import order.

MLX's Linux CPU wheel links the reference BLAS. ``refusion_mlx._blas.preload``
binds MLX's ``cblas_*`` calls to an optimized library (system OpenBLAS, else
MKL) only if it runs before ``mlx.core`` is loaded: Python opens extension
modules with ``RTLD_NOW``, so libmlx's symbols are bound for good while
``import mlx.core`` runs, and a library loaded later never takes them over.
A program that imports ``mlx.core`` (or ``mlx_lm``) before ``refusion_mlx``
would run on the reference BLAS.

``refusion_mlx_blas.pth``, which the wheel (editable or not) puts in
site-packages beside this module, calls ``install`` when Python starts. It
only puts a finder at the front of ``sys.meta_path``; the first time anything
imports ``mlx.core``, the finder takes itself off and imports ``refusion_mlx``
(whose first act is the preload), then lets the import go on. A process that
never imports MLX loads no library. Nothing happens on macOS, with
``REFUSION_MLX_BLAS`` set to opt out, or where site-packages' ``.pth`` files are
not read (``python -S``); ``refusion_mlx.models.loading.load`` then says so in
one line when MLX runs on the reference BLAS.

The build backend (``build_backend.py``) writes ``PTH_LINE`` into the wheel.
"""

import os
import sys

PTH_NAME = "refusion_mlx_blas.pth"
# site.py runs a .pth line that starts with "import" and reports (but survives)
# any error in it; this one raises none, even with the module gone.
PTH_LINE = 'import sys; exec("try:\\n import _refusion_mlx_blas as h; h.install()\\nexcept Exception:\\n pass")\n'

ENV = "REFUSION_MLX_BLAS"
OPT_OUT = {"bundled", "reference", "off", "0", "none"}  # as refusion_mlx._blas.OPT_OUT


class BeforeMLX:
    """A meta-path finder that finds nothing: it runs the preload when
    ``mlx.core`` is about to be imported, once."""

    def find_spec(self, name, path=None, target=None):
        if name == "mlx.core":
            uninstall()
            try:
                import refusion_mlx  # noqa: F401  (its __init__ preloads the BLAS)
            except Exception:  # a broken install must not break MLX's import
                pass
        return None


def installed() -> bool:
    return any(isinstance(finder, BeforeMLX) for finder in sys.meta_path)


def install() -> bool:
    """Put the finder in place where it can help; True if it is there."""
    if sys.platform != "linux" or "mlx.core" in sys.modules:
        return False
    if os.environ.get(ENV, "").strip().lower() in OPT_OUT:
        return False
    if not installed():
        sys.meta_path.insert(0, BeforeMLX())
    return True


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, BeforeMLX)]
