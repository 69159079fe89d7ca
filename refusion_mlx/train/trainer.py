"""The training loop: mlx-lm's recipe (value_and_grad, a compiled step over
model and optimizer state, its report lines) with ReFusion's objective.

Every step draws fresh examples (slot size, masks, slot order) for its batch,
computes :func:`refusion_loss` and its gradient with ``nn.value_and_grad``
and applies the optimizer, inside one ``mx.compile``d function (not with
gradient checkpointing: compiled, the step keeps what checkpointing frees).
Batch lengths are padded to multiples of 32, so the step is traced once per
distinct length (a handful), not once per batch. Adapters are written
atomically (``models.adapter_files.save_adapters``): ``adapters.safetensors``
every ``save_every`` steps (with a numbered copy,
``0000100_adapters.safetensors``), at the end, and on Ctrl-C (the weights
of the last completed step).
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map

from .. import _blas
from ..errors import PendingStop, RefusionError
from ..models.adapter_files import numbered_adapter_file, save_adapters
from ..models.adapters import ADAPTER_FILE, trainable_weights
from .batches import Record, batch_tokens, iterate_batches
from .examples import SLOT_SIZES
from .objective import refusion_loss


@dataclass
class TrainArgs:
    """What the loop needs (the CLI's options, resolved)."""

    batch_size: int = 4
    iters: int = 1000
    grad_accumulation_steps: int = 1  # steps whose gradients are summed into one update (mlx-lm's)
    val_batches: int = 25
    steps_per_report: int = 10
    steps_per_eval: int = 200
    save_every: int = 100
    max_seq_length: int = 2048
    grad_checkpoint: bool = False
    seed: int = 0
    slot_sizes: Tuple[int, ...] = SLOT_SIZES  # the objective's slot-size draw
    draft_fraction: float = 0.0  # share of drafting examples (build_draft_example)
    draft_run: int = 1  # their masks in runs of this many (1: each mask sees only written tokens)
    ar_weight: float = 1.0  # multiplies the loss's AR mean (1: the paper's loss)
    by_length: bool = True  # batches of one length (mlx-lm's); False: rows dealt at random each pass
    # mx.compile the step; None: unless grad_checkpoint (a compiled step keeps
    # what checkpointing would free: 0.6B QLoRA peaks at 4.0 GB compiled, 1.8 GB not)
    compile: Optional[bool] = None
    # quantized layers: "kernel" (mx.quantized_matmul), "dequantize" (dequantize, then a
    # plain matmul) or "auto" (dequantize on the CPU, whose quantized matmul is slow)
    quantized_matmul: str = "auto"
    # adapter_config.json, written with the first weights saved: a run that fails before
    # any step leaves an existing adapter folder's config as it was
    adapter_config: Optional[dict] = None


@dataclass
class TrainResult:
    """Where the loop got to, and what it measured."""

    iterations: int = 0
    train_losses: List[float] = field(default_factory=list)   # one per report
    val_losses: List[float] = field(default_factory=list)     # one per validation
    tokens_per_second: float = 0.0                              # over all steps
    iterations_per_second: float = 0.0
    trained_tokens: int = 0
    peak_memory_gb: float = 0.0
    adapter_file: Optional[Path] = None
    interrupted: bool = False


def build_optimizer(name: str, learning_rate: float, lr_schedule: Optional[dict] = None,
                    optimizer_config: Optional[dict] = None, iters: int = 0):
    """mlx-lm's optimizers (mlx.optimizers); ``lr_schedule`` in mlx-lm's format
    replaces the fixed rate, checked over the run's ``iters`` steps: a rate
    that is negative or not finite at any of them is an error."""
    import mlx.optimizers as optim

    classes = {"adam": optim.Adam, "adamw": optim.AdamW, "sgd": optim.SGD, "adafactor": optim.Adafactor,
               "muon": optim.Muon}
    if name not in classes:
        raise RefusionError(f"optimizer must be one of {', '.join(classes)}, got {name!r}")
    lr = learning_rate
    if lr_schedule:
        from mlx_lm.tuner.utils import build_schedule

        try:
            lr = build_schedule(lr_schedule)
            rates = np.array(lr(mx.arange(iters + 1)), dtype=np.float64).reshape(-1)
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
            raise RefusionError(f"lr_schedule is not valid ({type(e).__name__}: {e}); expected "
                                "{name: cosine_decay, arguments: [1e-4, 1000], warmup: 100}") from None
        bad = np.flatnonzero(~np.isfinite(rates) | (rates < 0))
        if bad.size:
            raise RefusionError(f"lr_schedule gives a learning rate of {rates[bad[0]]:g} at step {bad[0]}; "
                                "a rate must be at least 0 and finite")
    kwargs = (optimizer_config or {}).get(name, {}) or {}
    try:
        return classes[name](learning_rate=lr, **kwargs)
    except TypeError as e:
        raise RefusionError(f"optimizer_config.{name}: {e}") from None


def enable_grad_checkpoint(model) -> Callable[[], None]:
    """mlx-lm's ``grad_checkpoint`` on this model's blocks only; returns the undo.

    The helper patches the ``__call__`` of the block's class, so the blocks get
    a private subclass first: other models in the process are not touched.
    """
    from mlx_lm.tuner.trainer import grad_checkpoint

    block = type(model.layers[0])
    checkpointed = type(f"Checkpointed{block.__name__}", (block,), {})
    for layer in model.layers:
        layer.__class__ = checkpointed
    grad_checkpoint(model.layers[0])

    def undo():
        for layer in model.layers:
            layer.__class__ = block
    return undo


class _DequantizingLinear(nn.QuantizedLinear):
    """A quantized layer that multiplies by its dequantized weight (same parameters)."""

    def __call__(self, x):
        w = mx.dequantize(self["weight"], self["scales"], self.get("biases"), group_size=self.group_size,
                          bits=self.bits, mode=self.mode)
        y = x @ w.astype(x.dtype).T
        return y + self["bias"] if "bias" in self else y


class _DequantizingEmbedding(nn.QuantizedEmbedding):
    """A quantized embedding whose ``as_linear`` (a tied head) dequantizes first."""

    def as_linear(self, x):
        w = mx.dequantize(self["weight"], self["scales"], self.get("biases"), group_size=self.group_size,
                          bits=self.bits, mode=self.mode)
        return x @ w.astype(x.dtype).T


def dequantizing_matmuls(model, mode: str = "auto") -> Callable[[], None]:
    """Let the quantized layers compute through dequantize + matmul; returns the undo.

    The stored weights stay quantized and frozen; only the product changes
    (the same values, summed in another order). MLX's CPU quantized matmul
    runs at about 2 GFLOP/s where a dequantize plus BLAS matmul runs ~25x
    faster, so "auto" does this on the CPU only. The cost: the dequantized
    weights of a layer live until its backward (use --grad-checkpoint to
    bound that to one block).
    """
    if mode not in ("auto", "kernel", "dequantize"):
        raise RefusionError(f"quantized_matmul must be auto, kernel or dequantize, got {mode!r}")
    if mode == "kernel" or (mode == "auto" and mx.default_device() != mx.cpu):
        return lambda: None
    swapped = []
    for _, module in model.named_modules():
        for base, replacement in ((nn.QuantizedLinear, _DequantizingLinear),
                                  (nn.QuantizedEmbedding, _DequantizingEmbedding)):
            if type(module) is base:
                swapped.append((module, base))
                module.__class__ = replacement

    def undo():
        for module, base in swapped:
            module.__class__ = base
    return undo


def to_mx(batch: Dict[str, np.ndarray]) -> Dict[str, mx.array]:
    """A collated batch on the device, the BLAS's threads fitted to it first: a small model's load leaves one
    thread (``_blas.fit_threads``, for its narrow decode passes), while a batch's rows (every token of
    every row) are a wide product's, which takes every core (``_blas.fit_rows``). Called between steps,
    each of which ends in a blocking evaluation, so no matmul runs while the count changes."""
    _blas.fit_rows(int(batch["input_ids"].size))
    return {k: mx.array(v) for k, v in batch.items()}


def evaluate(model, records: Sequence[Record], batch_size: int, num_batches: int, mask_id: int,
             max_seq_length: int, seed: int = 0, pad_id: int = 0,
             progress: Optional[Callable[[], None]] = None, quantized_matmul: str = "auto",
             slot_sizes: Sequence[int] = SLOT_SIZES, draft_fraction: float = 0.0,
             ar_weight: float = 1.0, draft_run: int = 1) -> float:
    """Mean batch loss over ``num_batches`` batches (-1: all), with fixed
    draws (``seed``), so evaluations compare.

    As in mlx-lm the batches (of about one length each) come in a random
    order, so a few batches sample rows of every length; the order is drawn
    from ``seed`` anew at each call, so every evaluation of a run sees the
    same batches with the same corruption draws."""
    was_training = model.training
    undo = dequantizing_matmuls(model, quantized_matmul)
    model.eval()
    rng = np.random.default_rng(seed)
    batches = iterate_batches(records, batch_size, mask_id, rng, max_seq_length, slot_sizes=slot_sizes,
                              pad_id=pad_id, draft_fraction=draft_fraction, draft_run=draft_run)
    total, count = 0.0, 0
    try:
        for batch in itertools.islice(batches, None if num_batches == -1 else num_batches):
            loss = refusion_loss(model, to_mx(batch), ar_weight)
            mx.eval(loss)
            total += loss.item()
            count += 1
            if progress is not None:
                progress()
    finally:
        undo()
        model.train(was_training)
    return total / max(count, 1)


def train(model, optimizer, train_set: Sequence[Record], valid_set: Optional[Sequence[Record]],
          args: TrainArgs, adapter_dir: Path, mask_id: int, pad_id: int = 0,
          report: Callable[[str], None] = print, progress: bool = True) -> TrainResult:
    """Train the model's trainable parameters in place; save into ``adapter_dir``.

    On Ctrl-C the adapters of the last completed step are saved, then
    KeyboardInterrupt propagates (``result`` is attached to it).
    """
    from tqdm import tqdm

    adapter_dir = Path(adapter_dir)  # made by the first save (a run that fails before leaves no folder)
    config_due = args.adapter_config is not None

    def save(weights, folder: Path, iteration: Optional[int] = None) -> Path:
        nonlocal config_due
        path = save_adapters(weights, folder, iteration, args.adapter_config if config_due else None)
        config_due = False  # written with the first weights: a failed save leaves the folder as it was
        return path

    rng = np.random.default_rng(args.seed)
    batches = iterate_batches(train_set, args.batch_size, mask_id, rng, args.max_seq_length, loop=True,
                              slot_sizes=args.slot_sizes, pad_id=pad_id, draft_fraction=args.draft_fraction,
                              by_length=args.by_length, draft_run=args.draft_run)
    undo_checkpoint = enable_grad_checkpoint(model) if args.grad_checkpoint else (lambda: None)
    undo_dequantize = dequantizing_matmuls(model, args.quantized_matmul)
    loss_and_grad = nn.value_and_grad(model, partial(refusion_loss, ar_weight=args.ar_weight))
    state = [model.state, optimizer.state, mx.random.state]
    accumulate = args.grad_accumulation_steps

    def step(batch, summed, count: int):  # mlx-lm's: gradients summed over steps, averaged at the update
        loss, grads = loss_and_grad(model, batch)  # count: the steps summed, at an update (else 0)
        if summed is not None:
            grads = tree_map(mx.add, grads, summed)
        if count:
            if count > 1:
                grads = tree_map(lambda g: g / count, grads)
            optimizer.update(model, grads)
            grads = None
        return loss, grads

    if args.compile or (args.compile is None and not args.grad_checkpoint):
        step = partial(mx.compile, inputs=state, outputs=state)(step)

    result = TrainResult()
    val_batches = 0
    if valid_set is not None and args.val_batches != 0:
        full = len(valid_set) // args.batch_size
        val_batches = full if args.val_batches == -1 else min(full, args.val_batches)

    def validate(it: int) -> None:
        if not val_batches:
            return
        tic = time.perf_counter()
        with tqdm(total=val_batches, desc="Validating", leave=False, file=sys.stderr,
                  disable=not progress, dynamic_ncols=True) as bar:
            loss = evaluate(model, valid_set, args.batch_size, val_batches, mask_id, args.max_seq_length,
                            args.seed, pad_id, progress=bar.update, quantized_matmul=args.quantized_matmul,
                            slot_sizes=args.slot_sizes, draft_fraction=args.draft_fraction,
                            ar_weight=args.ar_weight, draft_run=args.draft_run)
        result.val_losses.append(loss)
        say(f"Iter {it}: Val loss {loss:.3f}, Val took {time.perf_counter() - tic:.3f}s")

    bar = tqdm(total=args.iters, desc="Training", unit="it", file=sys.stderr, disable=not progress,
               dynamic_ncols=True)

    def say(line: str) -> None:
        if progress and report is print:  # above the bar, which lives on stderr
            tqdm.write(line, file=sys.stdout)
            sys.stdout.flush()
        else:
            report(line)

    mx.reset_peak_memory()
    model.train()
    last_good = trainable_weights(model)
    window_loss, window_steps, window_tokens, window_time = 0.0, 0, 0, 0.0
    total_time, it, summed = 0.0, 0, None
    try:
        validate(0)
        for it in range(1, args.iters + 1):
            if PendingStop.pending is not None:  # a Ctrl-C or SIGTERM whose raise Python dropped
                raise PendingStop.pending
            batch = next(batches)
            tokens = batch_tokens(batch)
            tic = time.perf_counter()
            due = it % accumulate == 0 or it == args.iters  # a last group short of accumulate: its own mean
            loss, summed = step(to_mx(batch), summed, (it - 1) % accumulate + 1 if due else 0)
            mx.eval(state, loss, summed)
            elapsed = time.perf_counter() - tic
            value = loss.item()
            if not math.isfinite(value):  # the adapters saved so far are kept as they are
                raise RefusionError(f"the training loss became {value} at iteration {it}; "
                                    "lower --learning-rate")
            last_good = trainable_weights(model)
            result.iterations = it
            window_loss += value
            window_steps += 1
            window_tokens += tokens
            window_time += elapsed
            total_time += elapsed
            result.trained_tokens += tokens
            bar.update(1)
            if it % args.steps_per_report == 0 or it == args.iters:
                lr = optimizer.learning_rate
                lr = lr.item() if isinstance(lr, mx.array) else float(lr)
                peak = mx.get_peak_memory() / 1e9
                result.train_losses.append(window_loss / window_steps)
                result.peak_memory_gb = max(result.peak_memory_gb, peak)
                say(f"Iter {it}: Train loss {window_loss / window_steps:.3f}, Learning Rate {lr:.3e}, "
                    f"It/sec {window_steps / window_time:.3f}, Tokens/sec {window_tokens / window_time:.1f}, "
                    f"Trained Tokens {result.trained_tokens}, Peak mem {peak:.3f} GB")
                window_loss, window_steps, window_tokens, window_time = 0.0, 0, 0, 0.0
            if it % args.steps_per_eval == 0 or it == args.iters:
                validate(it)
            if it % args.save_every == 0:
                save(last_good, adapter_dir, it)
                say(f"Iter {it}: Saved adapter weights to {adapter_dir / ADAPTER_FILE} and "
                    f"{adapter_dir / numbered_adapter_file(it)}.")
    except KeyboardInterrupt as interrupt:
        PendingStop.pending = None  # seen
        bar.close()
        result.interrupted = True
        if result.iterations:
            result.adapter_file = save(last_good, adapter_dir)
            print(f"Interrupted after iteration {result.iterations}: saved the adapters of the last "
                  f"completed step to {result.adapter_file}", file=sys.stderr)
        else:  # nothing trained: what the folder held stays
            print(f"Interrupted before the first step: nothing saved ({adapter_dir} is as it was)", file=sys.stderr)
        interrupt.result = result
        raise
    finally:
        bar.close()
        undo_checkpoint()
        undo_dequantize()
        model.eval()
    result.adapter_file = save(last_good, adapter_dir)
    if total_time > 0:
        result.tokens_per_second = result.trained_tokens / total_time
        result.iterations_per_second = result.iterations / total_time
    result.peak_memory_gb = max(result.peak_memory_gb, mx.get_peak_memory() / 1e9)
    say(f"Saved final weights to {result.adapter_file}.")
    return result
