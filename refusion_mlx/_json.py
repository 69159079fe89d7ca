"""Reading the small JSON files users hand us (config.json, adapter configs,
benchmark suites): every way one can be broken is one line, never a traceback."""

import json
from pathlib import Path
from typing import Any, Dict, List, Type

from .errors import LoadError, RefusionError


def lines(text: str) -> List[str]:
    """A text file's lines as JSONL writers and readers count them: cut at "\n" alone ("\r\n" too), never
    at the other breaks ``str.splitlines`` knows (U+2028, U+2029, NEL), which ``json.dumps(ensure_ascii=False)``
    writes raw inside strings."""
    out = [line.removesuffix("\r") for line in text.split("\n")]
    return out[:-1] if out and out[-1] == "" else out


def read_json(path: Path, error: Type[RefusionError] = LoadError) -> Any:
    """The JSON value in ``path``; ``error`` for unreadable or invalid files."""
    try:
        return json.loads(Path(path).read_text())
    except ValueError as e:  # not JSON, not UTF-8, or a number past Python's 4300 digits
        raise error(f"{path} is not valid JSON: {' '.join(str(e).split())}") from None
    except RecursionError:
        raise error(f"{path} is nested too deeply to read as JSON") from None
    except OSError as e:
        raise error(f"cannot read {path}: {e.strerror or e}") from None


def read_json_object(path: Path, error: Type[RefusionError] = LoadError) -> Dict[str, Any]:
    """The JSON object in ``path``; ``error`` for unreadable, invalid or non-object files."""
    data = read_json(path, error)
    if not isinstance(data, dict):
        raise error(f"{path} is not a JSON object")
    return data
