"""Prompt suites for ``python -m refusion_mlx.bench`` and how each case's
decoding parameters are resolved.

A suite is a JSON object::

    {"name": "default",
     "defaults": {"gen_length": 512, "slot_size": 4, ...},   # optional
     "prompts": [{"family": "counting", "prompt": "Count from 12 to 40.",
                  "params": {...}, "system": "..."}, ...]}     # params, system optional

Parameters are layered, later layers winning: the decoder's own defaults,
the suite's ``defaults``, the case's ``params``, ``--preset``, then explicit
flags. Naming a block count in a layer drops a block length from an earlier
one and vice versa, so a preset can override a suite's block layout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from ..decode.params import PARAM_NAMES, RefusionParams, layered, make_params
from ..decode.presets import preset
from ..errors import DecodeError, RefusionError

DEFAULT_SUITE = Path(__file__).with_name("suite.json")


class BenchError(RefusionError):
    """A suite file or benchmark setting that cannot be used."""


@dataclass
class Case:
    """One prompt of a suite, with its own decoding parameters if any."""

    family: str
    prompt: str
    params: Dict[str, Any] = field(default_factory=dict)
    system: Optional[str] = None


@dataclass
class Suite:
    name: str
    cases: List[Case]
    defaults: Dict[str, Any] = field(default_factory=dict)
    source: str = ""


def load_suite(spec: Union[str, Path, None] = "default") -> Suite:
    """The bundled suite (``"default"`` or None) or a suite JSON file."""
    path = DEFAULT_SUITE if spec in (None, "default") else Path(spec).expanduser()
    if not path.is_file():
        raise BenchError(f"no suite file at {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except ValueError as e:
        raise BenchError(f"{path} is not valid JSON: {e}") from None
    suite = parse_suite(data, source=str(path))
    if spec in (None, "default"):
        suite.source = "default (bundled suite.json)"
    return suite


def parse_suite(data: Any, source: str = "<suite>") -> Suite:
    """Check a suite's structure; every problem is one line naming the case."""
    if not isinstance(data, dict) or not isinstance(data.get("prompts"), list) or not data["prompts"]:
        raise BenchError(f"{source}: a suite is an object with a non-empty 'prompts' list")
    defaults = data.get("defaults", {})
    _check_params(defaults, f"{source}: defaults")
    cases = []
    for i, item in enumerate(data["prompts"]):
        where = f"{source}: prompts[{i}]"
        if isinstance(item, str):
            item = {"prompt": item}
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"]:
            raise BenchError(f"{where} needs a non-empty 'prompt' string")
        params = item.get("params", {})
        _check_params(params, where)
        system = item.get("system")
        if system is not None and not isinstance(system, str):
            raise BenchError(f"{where}: 'system' must be a string")
        cases.append(Case(str(item.get("family", "-")), item["prompt"], dict(params), system))
    return Suite(str(data.get("name", Path(source).stem)), cases, dict(defaults), source)


def _check_params(params: Any, where: str) -> None:
    if not isinstance(params, dict):
        raise BenchError(f"{where}: decoding parameters must be an object")
    unknown = sorted(set(params) - set(PARAM_NAMES))
    if unknown:
        raise BenchError(f"{where}: unknown decoding parameter(s) {', '.join(unknown)}; "
                         f"known: {', '.join(PARAM_NAMES)}")


def resolve_params(suite: Suite, case: Optional[Case], preset_name: Optional[str] = None,
                   overrides: Optional[Dict[str, Any]] = None) -> RefusionParams:
    """A case's RefusionParams: suite defaults < case < preset < overrides
    (``decode.params.layered``). ``case`` None: the suite's defaults alone, for
    prompts from elsewhere (``--layouts --data``)."""
    values = layered(suite.defaults, case.params if case else {})
    if preset_name:  # at a budget the overrides set, the preset's block length (decode/presets.py)
        values = layered(values, preset(preset_name, (overrides or {}).get("gen_length")))
    values = layered(values, overrides or {})
    try:
        params = make_params(**values)
    except TypeError as e:
        raise DecodeError(str(e)) from None
    params.layout()  # one-line DecodeError on a bad combination
    return params
