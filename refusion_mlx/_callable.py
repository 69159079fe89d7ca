"""Modules that are also the function they are named after.

``refusion_mlx.generate`` and ``refusion_mlx.convert`` are importable from
the top as functions, but importing the submodule of the same name rebinds
the package attribute to the module. Making the module forward calls to its
function keeps ``rm.generate(...)`` and ``rm.convert(...)`` working either
way, as ``mlx_lm.generate`` does.
"""

import sys
import types
from typing import Callable


def make_callable(module_name: str, function: Callable) -> None:
    """Let the module ``module_name`` be called as ``function``."""

    class CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return function(*args, **kwargs)

    sys.modules[module_name].__class__ = CallableModule
