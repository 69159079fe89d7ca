"""Training options: command-line flags over a YAML file over the defaults.

YAML keys are the flag names with underscores (``learning_rate: 1e-4``),
plus mlx-lm's nested blocks ``lora_parameters`` (rank, scale, dropout,
keys), ``lr_schedule`` (mlx-lm's ``build_schedule`` format) and
``optimizer_config`` (per-optimizer keyword arguments), and mlx-lm's options
it has no use for at their off values (``report_to: null`` ...:
``MLX_LM_OFF``). An unknown key is an error, and so is a value of the wrong
type or out of range.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from ..errors import RefusionError
from ..models.adapters import FINE_TUNE_TYPES, LORA_DEFAULTS, lora_parameters


class OptionError(RefusionError):
    """A bad option value, from a flag or the YAML file (a usage error: exit 2)."""


@dataclass(frozen=True)
class Option:
    kind: type          # int, float, str or bool
    default: Any
    help: str
    choices: Tuple[str, ...] = ()
    yaml_only: bool = False


# learning rate: mlx-lm's 1e-5 barely moves LoRA weights on the demo in a few
# hundred steps; 1e-4 (LoRA scale 20, Adam) trains it steadily without spikes
DEFAULT_LR = 1e-4
DEFAULT_NUM_LAYERS = 16
OPTIMIZERS = ("adam", "adamw", "sgd", "adafactor", "muon")  # mlx-lm's, of mlx.optimizers
# replayed rows per training row: beyond 100 the new rows are under 1% of what trains (the documented
# recipes replay 1 or 2), and the draw's size is what a huge ratio turns into memory
MAX_REPLAY_RATIO = 100.0

OPTIONS: Dict[str, Option] = {
    "model": Option(str, None, "model folder or hub repo id (default: the bundled demo model)"),
    "data": Option(str, None, "folder with train.jsonl and valid.jsonl (test.jsonl for --test)"),
    "adapter_path": Option(str, "adapters", "folder the adapters are saved to (default: adapters)"),
    "fine_tune_type": Option(str, "lora", "lora, dora or full (default: lora)", FINE_TUNE_TYPES),
    "optimizer": Option(str, "adam", "adam, adamw, sgd, adafactor or muon, as mlx-lm (default: adam)", OPTIMIZERS),
    "num_layers": Option(int, None, f"blocks to fine-tune, counted from the last; -1: all "
                                    f"(default: {DEFAULT_NUM_LAYERS}, or all of a smaller model)"),
    "train_embeddings": Option(bool, False, "also train the token embedding, final norm and LM head (new "
                                            "tokens and formats learn several times faster on small models; "
                                            "unquantized only)"),
    "replay_data": Option(str, None, "rows of the tasks the model already knows (a data folder's train.jsonl "
                                     "or a JSONL file), mixed into training so they are not forgotten"),
    "replay_ratio": Option(float, 1.0, "replayed rows per training row with --replay-data (default: 1.0)"),
    "rank": Option(int, LORA_DEFAULTS["rank"], "LoRA/DoRA rank (default: 8)"),
    "batch_size": Option(int, 4, "sequences per step (default: 4)"),
    "iters": Option(int, 1000, "training steps (default: 1000; 0 with --test only evaluates)"),
    "grad_accumulation_steps": Option(int, 1, "steps whose gradients are summed into one update, as mlx-lm "
                                              "(default: 1)"),
    "val_batches": Option(int, 25, "validation batches, -1: the whole valid.jsonl (default: 25)"),
    "learning_rate": Option(float, DEFAULT_LR, f"Adam learning rate (default: {DEFAULT_LR:g})"),
    "steps_per_report": Option(int, 10, "steps between training-loss reports (default: 10)"),
    "steps_per_eval": Option(int, 200, "steps between validations (default: 200)"),
    "save_every": Option(int, 100, "save the adapters every N steps (default: 100)"),
    "resume_adapter_file": Option(str, None, "adapters.safetensors to start from"),
    "max_seq_length": Option(int, 2048, "longest sequence; longer responses are cut (default: 2048)"),
    "grad_checkpoint": Option(bool, False, "recompute activations in the backward pass (less memory)"),
    "slot_sizes": Option(str, "4,8,16,32", "slot sizes the objective draws from, comma-separated (YAML: a list; "
                                           "default: the paper's 4,8,16,32; smaller slots put more masks right "
                                           "after written tokens, as slot infill drafts them)"),
    "draft_fraction": Option(float, 0.0, "share of examples that teach drafting each response token from the "
                                         "written tokens before it, as decoding drafts (this project's addition; "
                                         "default: 0, the paper's objective alone)"),
    "draft_run": Option(int, 1, "masks of a drafting example come in runs of this many, each seeing the "
                                "text before its run and the run's masks before it, as the plan pass drafts "
                                "a block (default: 1, each mask sees only written tokens)"),
    "batch_order": Option(str, "length", "length: batches of rows of about one length, as mlx-lm (least "
                                         "padding); random: rows dealt into new batches every pass (rows of "
                                         "one length share where their answer ends) (default: length)",
                          ("length", "random")),
    "ar_weight": Option(float, 1.0, "multiplies the loss's AR term, the mean cross-entropy over the batch's "
                                    "next-token labels (default: 1, the paper's loss)"),
    "seed": Option(int, 0, "seed of the data order, the corruption draws and the LoRA init (default: 0)"),
    "train": Option(bool, False, "mlx-lm's flag to train: what this command does anyway, but that --test "
                                 "without --train or --iters only tests the adapters in --adapter-path, as mlx-lm "
                                 "does"),
    "mask_prompt": Option(bool, False, "mlx-lm's flag: accepted; the objective never learns the prompt here "
                                       "(the prompt carries no label: docs/training.md, The objective)"),
    "test": Option(bool, False, "evaluate on test.jsonl after training"),
    "test_batches": Option(int, 500, "test batches, -1: the whole test.jsonl (default: 500)"),
    "quantized_matmul": Option(str, "auto", "how quantized layers multiply while training: kernel "
                                            "(mx.quantized_matmul), dequantize (then a plain matmul) or auto "
                                            "(dequantize on the CPU, where it is ~25x faster; default)",
                               ("auto", "kernel", "dequantize")),
    "dtype": Option(str, None, "compute dtype (default: float32 on CPU, the checkpoint's on GPU)",
                    ("float32", "float16", "bfloat16")),
    # mlx-lm's names of a row's keys (its create_dataset's), YAML only as there
    "prompt_feature": Option(str, "prompt", "", yaml_only=True),
    "completion_feature": Option(str, "completion", "", yaml_only=True),
    "text_feature": Option(str, "text", "", yaml_only=True),
    "chat_feature": Option(str, "messages", "", yaml_only=True),
    "lora_parameters": Option(dict, None, "", yaml_only=True),
    "lr_schedule": Option(dict, None, "", yaml_only=True),
    "optimizer_config": Option(dict, None, "", yaml_only=True),
}

# mlx-lm's options (its CONFIG_DEFAULTS) this trainer has no use for: a YAML file may set them to mlx-lm's
# default, their off value (a config written from mlx-lm's defaults carries them); any other value is refused
# with the reason. As flags they are unknown (exit 2).
MLX_LM_OFF: Dict[str, Tuple[Any, str]] = {
    "report_to": (None, "reporting to wandb or swanlab is not supported here"),
    "project_name": (None, "it names the project reports would go to, and reporting is not supported here"),
    "clear_cache_threshold": (0, "clearing MLX's cache while training is not supported here"),
    "trust_remote_code": (False, "a ReFusion model needs no code of its own"),
    "config": (None, "a config file cannot name another; give its options here or as flags"),
}


def check_off(key: str, value: Any, source: str) -> None:
    """An OptionError unless ``value`` is the off value of mlx-lm's option ``key`` (MLX_LM_OFF)."""
    off, reason = MLX_LM_OFF[key]
    if value != off or isinstance(value, bool) != isinstance(off, bool):  # 0 is not false, nor false 0
        shown = json.dumps(value) if isinstance(value, bool) else repr(value)  # as YAML writes it
        raise OptionError(f"{source}: {key}: {shown} is refused: {reason} "
                          f"(mlx-lm's default, {json.dumps(off)}, is accepted)")


def check_data(value, name: str = "--data") -> None:
    """mlx-lm's Hugging Face dataset id as ``--data`` (no such folder here): a usage error saying what to give;
    ``name``: the option's (``named``)."""
    if value is not None and not Path(value).expanduser().exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", str(value)):
        raise OptionError(f"{name} {value}: no such folder; Hugging Face datasets are not read here: write the "
                          "rows to train.jsonl and valid.jsonl in a folder (mlx-lm's formats)")


def check_replay_ratio(ratio: float, name: str = "--replay-ratio") -> None:
    """An OptionError unless 0 <= ``ratio`` <= MAX_REPLAY_RATIO (a NaN or an infinity is neither)."""
    if not 0 <= ratio <= MAX_REPLAY_RATIO:
        raise OptionError(f"{name} must be between 0 and {MAX_REPLAY_RATIO:g} (replayed rows per "
                          f"training row), got {ratio}")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def named(name: str, given: Optional[Dict[str, Optional[str]]] = None, lead: bool = True) -> str:
    """How an error names option ``name``: by the YAML file and its key where the file set it
    (``--config c.yaml: batch_size``; within a sentence, ``lead`` false: ``batch_size``), else by its flag
    (a flag, a fine_tune keyword, the default); ``given``: merge's, each name with the file that set it."""
    source = (given or {}).get(name)
    if not source:
        return flag(name)
    return f"{source}: {name}" if lead else name


def add_flags(parser) -> None:
    """Every option as a flag defaulting to None (so a YAML value can fill it)."""
    for name, opt in OPTIONS.items():
        if opt.yaml_only:
            continue
        if opt.kind is bool:
            parser.add_argument(flag(name), action="store_true", default=None, help=opt.help)
        else:
            kwargs = {"choices": opt.choices} if opt.choices else {}
            parser.add_argument(flag(name), type=opt.kind, default=None, help=opt.help, **kwargs)
    parser.add_argument("-c", "--config", help="YAML file of options (flags win over it)")


def read_yaml(path: str) -> Dict[str, Any]:
    import yaml

    p = Path(path).expanduser()
    if not p.is_file():
        raise OptionError(f"--config {path}: no such file")
    loader = type("Loader", (yaml.SafeLoader,), {})
    # YAML 1.1 reads 1e-4 as a string; mlx-lm adds the same resolver for floats
    loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+"
                   r"|\.[0-9_]+(?:[eE][-+]?[0-9]+)?|\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
        list("-+0123456789."))
    try:
        data = yaml.load(p.read_text(), Loader=loader)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        detail = " ".join(str(e).split())
        raise OptionError(f"--config {path} is not valid YAML: {detail}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise OptionError(f"--config {path} must be a mapping of option names to values")
    return data


def _typed(name: str, value: Any, source: str) -> Any:
    opt = OPTIONS[name]
    if value is None:
        return None
    if isinstance(value, os.PathLike) and opt.kind is str:  # a Path, where the API takes a folder or file
        value = os.fspath(value)
    if name == "slot_sizes" and isinstance(value, (list, tuple)):
        return slot_sizes(value, source)
    kind = opt.kind
    ok = (isinstance(value, bool) if kind is bool else
          isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else
          isinstance(value, int) and not isinstance(value, bool) if kind is int else
          isinstance(value, kind))
    if not ok:
        raise OptionError(f"{source}: {name} must be {kind.__name__ if kind is not dict else 'a mapping'}, "
                          f"got {value!r}")
    if opt.choices and value not in opt.choices:
        raise OptionError(f"{source}: {name} must be one of {', '.join(opt.choices)}, got {value!r}")
    if name == "lora_parameters":
        lora_block(value, source)
    return float(value) if kind is float else value


def lora_block(value: Dict[str, Any], source: str) -> None:
    """An OptionError naming ``source`` and the key (``lora_parameters.rank``) unless every key of a
    ``lora_parameters`` block is known and its value valid."""
    unknown = sorted(set(value) - {*LORA_DEFAULTS, "keys"})
    if unknown:
        raise OptionError(f"{source}: lora_parameters: unknown key {unknown[0]!r} (rank, scale, dropout, keys)")
    try:
        lora_parameters(**{**LORA_DEFAULTS, **value})
    except RefusionError as e:
        raise OptionError(f"{source}: {e}") from None


def slot_sizes(value: Any, source: str) -> Tuple[int, ...]:
    """``"4,8,16,32"`` or ``[4, 8, 16, 32]`` -> (4, 8, 16, 32); each at least 1."""
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        sizes = tuple(int(x) if not isinstance(x, (bool, float)) else None for x in items)
    except (TypeError, ValueError):
        sizes = (None,)
    if not sizes or any(s is None or s < 1 for s in sizes):
        raise OptionError(f"{source}: slot_sizes must be positive integers (like 4,8,16,32), got {value!r}")
    return tuple(sorted(set(sizes)))


def merge(cli: Dict[str, Any], yaml_path: Optional[str] = None) -> Dict[str, Any]:
    """Options: a flag given on the command line, else the YAML value, else the
    default; ``given``: the names set by either, each with the YAML file that set it
    (None: a flag or keyword), so an error names what the user wrote (``named``)."""
    values = {name: opt.default for name, opt in OPTIONS.items()}
    rank_given, given = cli.get("rank") is not None, {}
    if yaml_path:
        source = f"--config {yaml_path}"
        data = read_yaml(yaml_path)
        rank_given = rank_given or data.get("rank") is not None
        for key, value in data.items():
            if key in MLX_LM_OFF:
                check_off(key, value, source)
                continue
            if key not in OPTIONS:
                raise OptionError(f"{source}: unknown option {key!r}")
            values[key] = _typed(key, value, source)
            given[key] = source
    for key, value in cli.items():  # a YAML-only key here is a fine_tune keyword: it has no flag
        if key in OPTIONS and value is not None:
            values[key] = _typed(key, value, "fine_tune" if OPTIONS[key].yaml_only else flag(key))
            given[key] = None
    return {**check(values, rank_given, given), "given": given}


def check(v: Dict[str, Any], rank_given: bool = True, given: Optional[Dict[str, Optional[str]]] = None
          ) -> Dict[str, Any]:
    """Range checks, each naming the option as the user gave it (``named``), and the LoRA block: ``rank``
    over ``lora_parameters.rank``."""

    def name(key: str, lead: bool = True) -> str:
        return named(key, given, lead)

    minimum = {"batch_size": 1, "iters": 0, "steps_per_report": 1, "steps_per_eval": 1, "save_every": 1,
               "max_seq_length": 2, "rank": 1, "draft_run": 1, "grad_accumulation_steps": 1}
    for key, low in minimum.items():
        if v[key] < low:
            raise OptionError(f"{name(key)} must be at least {low}, got {v[key]}")
    if v["draft_run"] > v["max_seq_length"]:  # no response is longer: a longer run changes nothing
        raise OptionError(f"{name('draft_run')} must be at most {name('max_seq_length', False)} "
                          f"({v['max_seq_length']}), got {v['draft_run']}")
    for key in ("val_batches", "test_batches"):
        if v[key] < -1:
            raise OptionError(f"{name(key)} must be -1 (all) or at least 0, got {v[key]}")
    if v["test"] and v["test_batches"] == 0:  # it reported a loss of 0 (perplexity 1): a perfect model
        raise OptionError(f"{name('test_batches')} 0 tests nothing; give -1 (all of test.jsonl) or a count")
    v["slot_sizes"] = slot_sizes(v["slot_sizes"], (given or {}).get("slot_sizes") or flag("slot_sizes"))
    if not 0 <= v["draft_fraction"] <= 1:
        raise OptionError(f"{name('draft_fraction')} must be between 0 and 1, got {v['draft_fraction']}")
    if not 0 < v["ar_weight"] < math.inf:
        raise OptionError(f"{name('ar_weight')} must be positive and finite, got {v['ar_weight']}")
    if not 0 <= v["seed"] < 2 ** 32:  # numpy's seed too
        raise OptionError(f"{name('seed')} must be within [0, 2**32), got {v['seed']}")
    check_replay_ratio(v["replay_ratio"], name("replay_ratio"))
    if not 0 < v["learning_rate"] < math.inf:
        raise OptionError(f"{name('learning_rate')} must be positive and finite, got {v['learning_rate']}")
    for key in ("adapter_path", "resume_adapter_file"):
        if v.get(key) is not None and not str(v[key]).strip():
            raise OptionError(f"{name(key)} must name a {'folder' if key == 'adapter_path' else 'file'}"
                              ", not an empty string")
    if v["num_layers"] is not None and not (v["num_layers"] == -1 or v["num_layers"] >= 1):
        raise OptionError(f"{name('num_layers')} must be -1 (all) or at least 1, got {v['num_layers']}")
    block = v.get("lora_parameters") or {}  # checked where it was read (lora_block)
    lp = {**LORA_DEFAULTS, **block}
    if rank_given or "rank" not in block:
        lp["rank"] = v["rank"]
    v["lora_parameters"] = lora_parameters(**lp)
    v["rank"] = v["lora_parameters"]["rank"]
    for key in ("lr_schedule", "optimizer_config"):
        if v[key] is not None and not isinstance(v[key], dict):
            raise OptionError(f"{key} must be a mapping")
    return v
