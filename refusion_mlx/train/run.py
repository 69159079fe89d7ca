"""A whole fine-tuning run, as ``python -m refusion_mlx.train`` does it:
check the inputs, load the model and the data, add the adapters, train,
save, optionally evaluate on the test set."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .._blas import reference_warning
from ..errors import RefusionError
from ..models.adapters import ADAPTER_CONFIG, ADAPTER_FILE, add_adapters, read_weights
from ..models.backend import wired_limit
from ..models.loading import load
from .batches import fit_length
from .config import DEFAULT_NUM_LAYERS, OPTIONS, check_data, merge, named
from .dataset import Features, load_datasets, replay_records, with_replay
from .examples import EPSILON
from .trainer import TrainArgs, TrainResult, build_optimizer, evaluate, train


def resolve_num_layers(requested: Optional[int], total: int, name: str = "--num-layers") -> int:
    if requested is None:
        return min(DEFAULT_NUM_LAYERS, total)
    if requested > total:
        raise RefusionError(f"{name} {requested} is more than the model's {total} layers")
    return requested


def load_resume(model, path: str) -> None:
    """Start from saved adapter weights: each must be a trainable parameter of that shape."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise RefusionError(f"--resume-adapter-file {path}: no such file")
    weights = read_weights(file, f"--resume-adapter-file {path}", RefusionError)
    trainable = dict(tree_flatten(model.trainable_parameters()))
    for name, value in weights.items():
        if name not in trainable:
            raise RefusionError(f"--resume-adapter-file {path}: {name} is not a trainable parameter of this "
                                "run (another --fine-tune-type, --num-layers or LoRA keys?)")
        if value.shape != trainable[name].shape:
            raise RefusionError(f"--resume-adapter-file {path}: {name} has shape {tuple(value.shape)}, this run "
                                f"trains {tuple(trainable[name].shape)} (another --rank?)")
    missing = sorted(set(trainable) - set(weights))
    if missing:
        raise RefusionError(f"--resume-adapter-file {path} lacks {missing[0]}"
                            + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    model.load_weights(list(weights.items()), strict=False)


def writable_folder(folder: Path) -> None:
    """A RefusionError now, before the model loads, unless ``folder`` (or where it would be made) takes files."""
    made = [p for p in [folder, *folder.parents] if not p.exists()]
    probe = folder / f".write-check-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise RefusionError(f"--adapter-path {folder}: cannot write there ({e.strerror or e})") from None
    finally:  # made when the first weights are saved: a run that fails before leaves no folder
        for p in made:
            try:
                p.rmdir()
            except OSError:
                pass


def parameter_count(model) -> int:
    from mlx_lm.utils import get_total_parameters

    return get_total_parameters(model)


def adapter_config(o: Dict, num_layers: int) -> dict:
    """adapter_config.json as mlx-lm writes it (its loader reads fine_tune_type,
    num_layers, lora_parameters), plus this run's options and the objective."""
    config = {k: v for k, v in o.items() if k not in ("config", "given")}
    config["num_layers"] = num_layers
    if o["fine_tune_type"] == "full":
        config["lora_parameters"] = None
    config["slot_sizes"] = list(o["slot_sizes"])
    config["objective"] = {"name": "refusion-hybrid", "slot_sizes": list(o["slot_sizes"]), "epsilon": EPSILON,
                           "draft_fraction": o["draft_fraction"], "draft_run": o["draft_run"],
                           "ar_weight": o["ar_weight"]}
    return config


def fine_tune(report: Callable[[str], None] = print, progress: bool = True,
              **options) -> Tuple[object, object, Optional[TrainResult]]:
    """Fine-tune as the CLI does; ``options`` are the CLI's (underscored names,
    ``config`` a YAML file). Returns ``(model, tokenizer, result)``: the model
    with its trained adapters (in eval mode) and the training result (None when
    ``iters`` is 0)."""
    unknown = sorted(set(options) - set(OPTIONS) - {"config"})
    if unknown:
        raise TypeError(f"fine_tune() got unknown option(s): {', '.join(unknown)}")
    report = report or (lambda line: None)
    o = merge(options, options.get("config"))

    def name(key: str, lead: bool = True) -> str:  # as the user gave it: a flag, or the YAML file's key
        return named(key, o["given"], lead)

    if o["data"] is None:
        raise RefusionError("--data is required: a folder with train.jsonl and valid.jsonl")
    # mlx-lm's --test without --train tests the saved adapters; so does --iters 0 --test, and a config's
    # explicit `train: false` (mlx-lm's test-only config: it never trains over the folder's adapters)
    refused = "train" in o["given"] and not o["train"]
    training = o["iters"] > 0 and not refused and not (o["test"] and not o["train"] and "iters" not in o["given"])
    if not training and not o["test"]:
        raise RefusionError("train is false: nothing to do; add --test to only evaluate" if refused else
                            f"{name('iters')} 0 trains nothing; add --test to only evaluate")
    data = Path(o["data"]).expanduser()
    check_data(o["data"], name("data"))
    if not data.is_dir():
        raise RefusionError(f"{name('data')} {o['data']} is a file; give the folder holding train.jsonl and "
                            "valid.jsonl" if data.exists() else f"{name('data')} {o['data']}: no such folder")
    for split in (["train"] if training else []) + (["test"] if o["test"] else []):
        if not (data / f"{split}.jsonl").is_file():
            raise RefusionError(f"{name('data')} {o['data']} has no {split}.jsonl")
    validating = training and o["val_batches"] != 0 and (data / "valid.jsonl").is_file()
    adapter_dir = Path(o["adapter_path"]).expanduser()
    if adapter_dir.exists() and not adapter_dir.is_dir():
        raise RefusionError(f"{name('adapter_path')} {o['adapter_path']} is a file; give a folder")
    if training:
        if (adapter_dir / "config.json").is_file():  # trained adapters would sit among a model's files
            raise RefusionError(f"{name('adapter_path')} {o['adapter_path']} is a model folder (it has "
                                "config.json); give the adapters a folder of their own")
        writable_folder(adapter_dir)
        # a bad lr_schedule or optimizer_config is found before the model loads
        optimizer = build_optimizer(o["optimizer"], o["learning_rate"], o["lr_schedule"], o["optimizer_config"],
                                    o["iters"])
    if o["resume_adapter_file"] and not Path(o["resume_adapter_file"]).expanduser().is_file():
        raise RefusionError(f"{name('resume_adapter_file')} {o['resume_adapter_file']}: no such file")
    saved = (not training and not o["resume_adapter_file"] and (adapter_dir / ADAPTER_CONFIG).is_file()
             and (adapter_dir / ADAPTER_FILE).is_file())

    report("Loading pretrained model")
    model, tokenizer = load(o["model"], dtype=o["dtype"], join_projections=False,
                            adapter_path=adapter_dir if saved else None)
    if reference_warning():
        report(f"[WARNING] {reference_warning()}")
    num_layers = resolve_num_layers(o["num_layers"], len(model.layers), name("num_layers"))
    report("Loading datasets")
    if training and o["val_batches"] != 0 and not validating:
        report(f"[WARNING] {data} has no valid.jsonl: training without validation")
    keys = Features(o["prompt_feature"], o["completion_feature"], o["text_feature"], o["chat_feature"])
    train_set, valid_set, test_set = load_datasets(data, tokenizer, test=o["test"], train=training,
                                                   valid=validating, keys=keys)
    if o["replay_data"] and training:
        before = len(train_set)
        train_set = with_replay(train_set, replay_records(o["replay_data"], tokenizer, keys), o["replay_ratio"],
                                o["seed"])
        report(f"Replaying {len(train_set) - before} rows of {o['replay_data']} among {before} training rows")
    cut = sum(fit_length(s, o["max_seq_length"]) for s in (train_set, valid_set, test_set) if s)
    if cut:
        report(f"[WARNING] {cut} responses were cut to fit --max-seq-length {o['max_seq_length']}")
    bs = o["batch_size"]
    for part, split, used in (("train", train_set, training), ("valid", valid_set, validating),
                              ("test", test_set, o["test"])):
        if used and len(split) < bs:
            raise RefusionError(f"{part}.jsonl has {len(split)} examples, fewer than {name('batch_size', False)} "
                                f"{bs}")

    mx.random.seed(o["seed"])
    np.random.seed(o["seed"])
    if saved:
        report(f"Testing the adapters in {adapter_dir} (nothing is trained: --test without --train or --iters)")
    elif not training and not o["resume_adapter_file"]:
        report(f"Testing the base model: {adapter_dir} holds no adapters")
    if not saved:
        add_adapters(model, o["fine_tune_type"], num_layers, o["lora_parameters"], o["train_embeddings"])
    if o["resume_adapter_file"]:
        report(f"Loading fine-tuned weights from {o['resume_adapter_file']}")
        load_resume(model, o["resume_adapter_file"])
    if saved:  # a loaded adapter is not frozen apart from its base: its own tensors are what was trained
        trainable = sum(v.size for v in mx.load(str(adapter_dir / ADAPTER_FILE)).values())
    else:
        trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    total = parameter_count(model)
    report(f"Trainable parameters: {100 * trainable / total:.3f}% ({trainable / 1e6:.3f}M/{total / 1e6:.3f}M)")
    mask_id, pad_id = model.args.mask_token_id, int(tokenizer.eos_token_id)
    result = None
    if training:
        args = TrainArgs(batch_size=bs, iters=o["iters"], val_batches=o["val_batches"] if validating else 0,
                         grad_accumulation_steps=o["grad_accumulation_steps"],
                         steps_per_report=o["steps_per_report"], steps_per_eval=o["steps_per_eval"],
                         save_every=o["save_every"], max_seq_length=o["max_seq_length"],
                         grad_checkpoint=o["grad_checkpoint"], seed=o["seed"],
                         quantized_matmul=o["quantized_matmul"], slot_sizes=o["slot_sizes"],
                         draft_fraction=o["draft_fraction"], ar_weight=o["ar_weight"],
                         draft_run=o["draft_run"], by_length=o["batch_order"] == "length",
                         adapter_config=adapter_config(o, num_layers))
        report("Training")
        with wired_limit(model):  # Metal: keep the weights resident while training
            result = train(model, optimizer, train_set, valid_set, args, adapter_dir, mask_id, pad_id,
                           report=report, progress=progress)
        report(f"Trained {result.iterations} iterations: {result.tokens_per_second:.1f} tokens/s, "
               f"{result.iterations_per_second:.3f} it/s, peak memory {result.peak_memory_gb:.3f} GB")
    if o["test"]:
        report("Testing")
        batches = len(test_set) // bs
        if o["test_batches"] != -1:
            batches = min(batches, o["test_batches"])
        with wired_limit(model):
            loss = evaluate(model, test_set, bs, batches, mask_id, o["max_seq_length"], o["seed"], pad_id,
                            quantized_matmul=o["quantized_matmul"], slot_sizes=o["slot_sizes"],
                            draft_fraction=o["draft_fraction"], ar_weight=o["ar_weight"],
                            draft_run=o["draft_run"])
        report(f"Test loss {loss:.3f}, Test ppl {math.exp(min(loss, 700.0)):.3f}.")
    model.eval()
    return model, tokenizer, result
