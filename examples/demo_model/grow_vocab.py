"""Qwen3's four tool tokens and six JSON punctuation tokens for the demo model: the tokenizer files and the grown
checkpoint.

Qwen3's tokenizer (ReFusion's) has ``<tool_call>``, ``</tool_call>``,
``<tool_response>`` and ``</tool_response>`` as single added tokens that are
not special (their text stays in decoded answers, where the server's tool
parser finds it). The demo's byte-level vocabulary spells them in 10 to 13
tokens each; this adds them as ids 806-809, as Qwen3 does, then JSON's
punctuation between keys and string values (``{"``, ``": "``, ``", "``,
``"}``, ``": {"``, ``"}}``) as ids 810-815, which a larger BPE vocabulary
has merged (the shared task mix holds none of them: its rows tokenize as
before). It grows the embedding and the LM head by ten rows: each new row
starts as the mean of the rows of the pieces the old vocabulary spells the
token with, and training (``--train-embeddings``) takes it from there.

The tokenizer of phase 3 (``tool_tokenizer``) is the demo's with these
tokens and ``chat_template.jinja`` beside this file (tools in Qwen3's
format, listed as ``name(parameters)``). The bundled demo keeps its own
tokenizer until weights trained with it are installed (``retrain.py
--install`` copies both).

    python examples/demo_model/grow_vocab.py --tokenizer TOKENIZER                # phase 3's tokenizer files
    python examples/demo_model/grow_vocab.py --model OLD --save-path GROWN        # grow a checkpoint
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE / "chat_template.jinja"  # phase 3's chat template
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# JSON's punctuation between keys and string values, one token each (as a larger BPE vocabulary,
# Qwen3's among them, has merged it): without them a call is 45-52 tokens, a third of them '"',
# and decoding them in parallel, the demo wrote runs of '"' (``""""``) where keys belong
JSON_TOKENS = ('{"', '": "', '", "', '"}', '": {"', '"}}')
ADDED = TOOL_TOKENS + JSON_TOKENS
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "added_tokens.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json")


def _entry(token: str, token_id: int) -> dict:
    return {"id": token_id, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": False}


def add_tokens(folder: Path, tokens: Sequence[str] = ADDED) -> list:
    """Add ``tokens`` (not special) after the last id of ``folder``'s tokenizer files; the ids they got.

    Tokens already there keep their ids (a second run changes nothing)."""
    path = folder / "tokenizer.json"
    tok = json.loads(path.read_text())
    known = {t["content"]: t["id"] for t in tok["added_tokens"]}
    next_id = max([t["id"] for t in tok["added_tokens"]] + list(tok["model"]["vocab"].values())) + 1
    ids = []
    for token in tokens:
        if token not in known:
            tok["added_tokens"].append(_entry(token, next_id))
            known[token] = next_id
            next_id += 1
        ids.append(known[token])
    path.write_text(json.dumps(tok, indent=2, ensure_ascii=False) + "\n")
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    decoder = config.setdefault("added_tokens_decoder", {})
    added_path = folder / "added_tokens.json"
    added = json.loads(added_path.read_text()) if added_path.is_file() else {}
    for token, token_id in zip(tokens, ids):
        entry = _entry(token, token_id)
        decoder[str(token_id)] = {k: entry[k] for k in ("content", "lstrip", "normalized", "rstrip",
                                                        "single_word", "special")}
        added[token] = token_id
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    added_path.write_text(json.dumps(added, indent=2, sort_keys=True) + "\n")
    return ids


def tool_tokenizer(save_path: Path, source: Optional[Path] = None) -> Path:
    """Phase 3's tokenizer in ``save_path``: ``source``'s (default: the bundled
    demo's) tokenizer files with :data:`ADDED` and :data:`TEMPLATE`."""
    if source is None:
        from refusion_mlx.models.loading import DEMO_MODEL as source
    save_path.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, save_path / name)
    add_tokens(save_path)
    template = TEMPLATE.read_text()
    (save_path / "chat_template.jinja").write_text(template)
    config_path = save_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return save_path


def grow(model: Path, save_path: Path, tokenizer_from: Path, tokens: Sequence[str] = ADDED) -> Path:
    """``model``'s checkpoint with ``tokenizer_from``'s tokenizer, whose ``tokens`` lie past
    the model's vocabulary: one more embedding and head row each, written to ``save_path``."""
    import refusion_mlx  # noqa: F401  (before mlx.core: optimized BLAS on Linux)
    import mlx.core as mx
    from refusion_mlx.models.loading import load_tokenizer

    config = json.loads((model / "config.json").read_text())
    old_vocab = config["vocab_size"]
    old_tok, new_tok = load_tokenizer(model), load_tokenizer(tokenizer_from)
    vocab = new_tok.get_vocab()
    ids = [vocab[t] for t in tokens]
    if sorted(ids) != list(range(old_vocab, old_vocab + len(tokens))):
        raise SystemExit(f"error: {tokenizer_from}'s {list(tokens)} have ids {ids}, "
                         f"not the {len(tokens)} ids after the model's vocabulary of {old_vocab}")
    weights = mx.load(str(model / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        table = weights[name]
        rows = [None] * len(tokens)
        for token, token_id in zip(tokens, ids):
            pieces = old_tok.encode(token, add_special_tokens=False)
            rows[token_id - old_vocab] = table[mx.array(pieces)].astype(mx.float32).mean(axis=0)
        weights[name] = mx.concatenate([table, mx.stack(rows).astype(table.dtype)])
    save_path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(save_path / "model.safetensors"), weights, metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, save_path / name)
    config["vocab_size"] = old_vocab + len(tokens)
    (save_path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return save_path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, help="write phase 3's tokenizer (the demo's, the added tokens, "
                                                   "chat_template.jinja) into this folder")
    ap.add_argument("--model", type=Path, help="a checkpoint (vocabulary 806) to grow by the added tokens")
    ap.add_argument("--tokenizer-from", type=Path, help="phase 3's tokenizer (default: written beside --save-path)")
    ap.add_argument("--save-path", type=Path, help="where the grown checkpoint goes")
    args = ap.parse_args()
    if args.tokenizer:
        print(tool_tokenizer(args.tokenizer))
    if args.model:
        if not args.save_path:
            ap.error("--model needs --save-path")
        tokenizer = args.tokenizer_from or tool_tokenizer(args.save_path.parent / (args.save_path.name + "-tokenizer"))
        print(grow(args.model, args.save_path, tokenizer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
