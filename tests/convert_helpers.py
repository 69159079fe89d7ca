"""Helpers of the converter tests: golden runs, malformed checkpoints, CLI runs."""

import json
import os
from pathlib import Path
from typing import List

import refusion_mlx  # noqa: F401  (before mlx.core: optimized BLAS on Linux)
import mlx.core as mx
import numpy as np

from refusion_mlx.convert import main
from refusion_mlx.decode.batch import batch_generate
from refusion_mlx.decode.params import RefusionParams

FIXTURES = Path(__file__).parent / "fixtures"
MASK = "<|mask|>"


def golden_results(model, tokenizer, cases) -> List[bool]:
    """Whether each golden case's response is reproduced token for token, all decoded in one batch
    (token-exact with each decoded alone, tests/test_batch.py: ~40% less time)."""
    params = [RefusionParams(gen_length=case["gen_length"], slot_size=case["slot_size"],
                             serial_num_blocks=case["serial_num_blocks"], slot_threshold=case["slot_threshold"],
                             token_threshold=case["token_threshold"]) for case in cases]
    results = batch_generate(model, tokenizer, [case["prompt_ids"] for case in cases], params, max_batch=len(cases))
    return [r.output_ids == case["output_ids"] for r, case in zip(results, cases)]


def golden_results_of(folder: str, dequantize: bool = False) -> List[bool]:
    """``golden_results`` for a converted folder, loaded in float32."""
    from refusion_mlx.models.loading import load

    model, tokenizer = load(folder, dtype="float32")
    if dequantize:  # dense matmuls of the dequantized weights: MLX's CPU quantized kernels are slow
        from mlx_lm.utils import dequantize_model

        dequantize_model(model)
    cases = json.loads((FIXTURES / "golden_outputs.json").read_text())
    return golden_results(model, tokenizer, cases)


def top1_agreement(model, golden_logits) -> float:
    """Share of positions whose argmax matches the PyTorch logits (plain and slotted passes)."""
    agree = total = 0
    for kind in ("plain", "slots"):
        ids = mx.array(golden_logits[f"{kind}_input_ids"])[None]
        pos = mx.array(golden_logits[f"{kind}_position_ids"])
        logits = np.array(model(ids, pos)[0].astype(mx.float32))
        ref = golden_logits[f"{kind}_logits"]
        agree += int((logits.argmax(-1) == ref.argmax(-1)).sum())
        total += len(ref)
    return agree / total


def run_cli(capsys, *argv) -> tuple:
    """(exit code, stderr lines, stdout) of ``python -m refusion_mlx.convert`` run in-process."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, [l for l in out.err.splitlines() if l.strip()], out.out


def leftovers(dst: Path) -> list:
    """The destination and any staging folder of it."""
    return [p.name for p in dst.parent.iterdir() if p.name == dst.name or p.name.startswith(f".{dst.name}.")]


# --------------------------------------------------------------------------
# Malformed checkpoints (each edits a valid one in place)


def read_st(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def write_st(path: Path, tensors: dict) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))


def strip_mask_token(folder: Path) -> None:
    """A tokenizer without <|mask|> (and a config without mask_token_id)."""
    edit_config(folder, mask_token_id=None)
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["content"] != MASK]
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    added = json.loads((folder / "added_tokens.json").read_text())
    added.pop(MASK, None)
    (folder / "added_tokens.json").write_text(json.dumps(added))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"] = {k: v for k, v in cfg["added_tokens_decoder"].items() if v["content"] != MASK}
    cfg["additional_special_tokens"] = [t for t in cfg.get("additional_special_tokens", []) if t != MASK]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    special = json.loads((folder / "special_tokens_map.json").read_text())
    special["additional_special_tokens"] = [t for t in special.get("additional_special_tokens", [])
                                            if (t if isinstance(t, str) else t.get("content")) != MASK]
    (folder / "special_tokens_map.json").write_text(json.dumps(special))


def truncate(folder: Path) -> None:
    f = folder / "model.safetensors"
    os.truncate(f, f.stat().st_size - 1000)


def corrupt_header_length(folder: Path) -> None:
    with open(folder / "model.safetensors", "r+b") as f:
        f.write((1 << 40).to_bytes(8, "little"))


def corrupt_header_json(folder: Path) -> None:
    with open(folder / "model.safetensors", "r+b") as f:
        f.seek(8)
        f.write(b"{\"model.embed_tokens.weight\": \x00\x00garbage")


def remove_shard(folder: Path) -> None:
    (folder / "model-00002-of-00003.safetensors").unlink()


def reshape_tensor(folder: Path) -> None:
    tensors = read_st(folder / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:100]
    write_st(folder / "model.safetensors", tensors)


def drop_tensor(folder: Path) -> None:
    tensors = read_st(folder / "model.safetensors")
    del tensors["model.norm.weight"]
    write_st(folder / "model.safetensors", tensors)


def add_tensor(folder: Path) -> None:
    tensors = read_st(folder / "model.safetensors")
    tensors["model.layers.0.mlp.extra_proj.weight"] = tensors["model.norm.weight"].clone()
    write_st(folder / "model.safetensors", tensors)


class RunsCode:
    """Pickles to a call of os.system: what a weights-only loader must refuse."""

    marker = ""

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def evil_bin(folder: Path) -> None:
    import torch

    tensors = read_st(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    RunsCode.marker = str(folder / "PWNED")
    tensors["model.norm.weight"] = RunsCode()
    torch.save(tensors, folder / "pytorch_model.bin")


def garbage_bin(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not a pickle at all" * 10)


def bare_model(folder: Path) -> None:
    """A Qwen3Model body: no lm_head, names without ``model.``."""
    tensors = read_st(folder / "model.safetensors")
    write_st(folder / "model.safetensors", {k.removeprefix("model."): v for k, v in tensors.items()
                                            if k != "lm_head.weight"})
    edit_config(folder, architectures=["Qwen3Model"])


def rewrite_header(folder: Path, edit) -> None:
    """``model.safetensors`` with ``edit(header)`` applied to its JSON header, its data unchanged."""
    f = folder / "model.safetensors"
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    f.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:])


def overlap_offsets(folder: Path) -> None:
    """v_proj pointing at k_proj's bytes (the same size)."""
    layer = "model.layers.0.self_attn."
    rewrite_header(folder, lambda h: h[layer + "v_proj.weight"].update(
        data_offsets=h[layer + "k_proj.weight"]["data_offsets"]))
