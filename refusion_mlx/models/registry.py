"""Model families by ``model_type``, chosen as mlx-lm's ``_get_classes`` does.

One line per family: config.json's ``model_type`` -> the module of this
package that defines its ``ModelArgs`` and ``Model`` (``base.py`` says what
they must provide). Loading, conversion, the quantization plan, sharding
and the bench's ``--shape`` ask here; none of them names a family.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Dict

from ..errors import ConfigError

FAMILIES = {
    "qwen3": "qwen3",
    "llama": "llama",
}


def family(model_type: Any) -> ModuleType:
    """The module of ``model_type``'s family; ConfigError (one line naming
    the known ones) for any other."""
    name = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if name is None:
        raise ConfigError(f"config.json: model_type is {model_type!r}, which refusion-mlx cannot run "
                          f"(known: {', '.join(sorted(FAMILIES))})")
    return importlib.import_module(f"{__package__}.{name}")


def family_args(config: Dict[str, Any]):
    """The family's ``ModelArgs`` from a config dict (ConfigError, one line)."""
    args_class = family(config.get("model_type")).ModelArgs
    try:
        return args_class.from_dict(config)
    except TypeError as e:
        raise ConfigError(f"config.json: {e}") from None


def build(args):
    """The family's ``Model`` for ``args`` (its layers hold lazy initial values)."""
    return family(args.model_type).Model(args)
