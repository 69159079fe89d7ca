"""Fine-tuning with ReFusion's hybrid objective.

``refusion_loss(model, batch)`` is the loss of a padded batch;
``build_example`` turns one (prompt, response) pair into its training arrays;
``load_datasets`` reads mlx-lm's JSONL formats; ``train`` is the loop and
``fine_tune`` a whole run as ``python -m refusion_mlx.train`` does it.
"""

from .batches import Record, collate, fit_length, iterate_batches
from .dataset import load_datasets, read_jsonl, with_replay
from .examples import EPSILON, IGNORE, SLOT_SIZES, Example, build_example
from .objective import loss_from_logits, refusion_loss, token_cross_entropy
from .run import fine_tune
from .trainer import TrainArgs, TrainResult, build_optimizer, evaluate, train

__all__ = ["EPSILON", "IGNORE", "SLOT_SIZES", "Example", "Record", "TrainArgs", "TrainResult", "build_example",
           "build_optimizer", "collate", "evaluate", "fine_tune", "fit_length", "iterate_batches",
           "load_datasets", "loss_from_logits", "read_jsonl", "refusion_loss", "token_cross_entropy", "train",
           "with_replay"]
