"""python -m refusion_mlx.convert: golden parity of converted folders, every input format,
quantization, one-line errors with no destination left, and atomic output."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import refusion_mlx  # noqa: F401  (before mlx.core: optimized BLAS on Linux)
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from tests import convert_helpers as h
from tests.helpers import FIXTURE_MODEL
from convert.make_checkpoint import make_checkpoint
from refusion_mlx.convert import converter as conv
from refusion_mlx.errors import LoadError, RefusionError
from refusion_mlx.models.loading import load

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def golden_cases():
    return json.loads((h.FIXTURES / "golden_outputs.json").read_text())


@pytest.fixture(scope="module")
def golden_logits():
    return dict(np.load(h.FIXTURES / "golden_logits.npz"))


@pytest.fixture(scope="module")
def demo_out(tmp_path_factory):
    """The demo checkpoint converted once per variant (each takes milliseconds)."""
    root = tmp_path_factory.mktemp("demo")
    variants = {"f32": dict(dtype="float32"), "bf16": dict(dtype="bfloat16"), "fp16": dict(dtype="float16"),
                "q8": dict(quantize=True, q_bits=8), "q4": dict(quantize=True, q_bits=4)}
    return {name: conv.convert(FIXTURE_MODEL, root / name, progress=False, **kw)
            for name, kw in variants.items()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny random checkpoints (padded vocabulary: 1024 rows, 816 tokens) in every input format."""
    root = tmp_path_factory.mktemp("tiny")
    made = {fmt: make_checkpoint(root / fmt, "tiny", fmt) for fmt in
            ("safetensors", "sharded-safetensors", "bin", "sharded-bin")}
    made["tied-sharded-bin"] = make_checkpoint(root / "tied", "tiny", "sharded-bin", tie_word_embeddings=True)
    return made


@pytest.fixture(scope="module")
def q8_golden(demo_out):
    """The 8-bit golden run, in this process: a spawned worker re-imported MLX, transformers and
    PyTorch (~4 s of CPU) to save wall time the suite's other worker uses anyway."""
    return h.golden_results_of(str(demo_out["q8"].path), True)


# --------------------------------------------------------------------------
# The demo model, converted: golden cases and PyTorch logits


def test_float32_conversion_reproduces_every_golden_case(demo_out, golden_cases):
    model, tokenizer = load(demo_out["f32"].path, dtype="float32")
    results = h.golden_results(model, tokenizer, golden_cases)
    assert len(results) == 32 and all(results), [i for i, ok in enumerate(results) if not ok]


def test_float32_conversion_is_bit_exact(demo_out):
    converted, _ = load(demo_out["f32"].path, dtype="float32")
    original, _ = load(FIXTURE_MODEL, dtype="float32")
    a, b = dict(tree_flatten(converted.parameters())), dict(tree_flatten(original.parameters()))
    assert a.keys() == b.keys()
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)


@pytest.mark.parametrize("variant,dtype", [("bf16", "bfloat16"), ("fp16", "float16")])
def test_half_precision_keeps_top1_with_pytorch(demo_out, golden_logits, variant, dtype):
    model, _ = load(demo_out[variant].path, dtype=dtype)  # computed in the stored half type
    assert model.model.norm.weight.dtype == getattr(mx, dtype)
    assert h.top1_agreement(model, golden_logits) >= 0.99  # measured: 166/166 for both


def test_8bit_reproduces_95_percent_of_golden_cases(demo_out, golden_cases, golden_logits, q8_golden):
    """The 8-bit weights decode the golden cases dequantized by mlx-lm's helper, on dense
    matmuls (MLX's CPU quantized kernels are ~10x slower; they score the same 31/32, see README)."""
    model, _ = load(demo_out["q8"].path, dtype="float32")
    assert isinstance(model.model.layers[0].mlp.down_proj, nn.QuantizedLinear)
    assert h.top1_agreement(model, golden_logits) >= 0.99  # the quantized kernels themselves
    results = q8_golden
    assert len(results) == len(golden_cases) == 32
    assert sum(results) >= math.ceil(0.95 * len(golden_cases)), sum(results)


def test_4bit_is_measured_and_close(demo_out, golden_logits):
    s = demo_out["q4"]
    assert 4.4 < s.bits_per_weight < 4.6 and s.bytes_after < s.bytes_before / 3
    model, _ = load(s.path, dtype="float32")
    assert h.top1_agreement(model, golden_logits) >= 0.95  # measured: 162/166


# --------------------------------------------------------------------------
# Input formats, tied embeddings, padded vocabulary; both runtimes load the output


def source_tensors(folder: Path) -> dict:
    import torch

    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(h.read_st(f))
    for f in sorted(folder.glob("*.bin")):
        tensors.update(torch.load(f, weights_only=True))
    return {k: v.float().numpy() for k, v in tensors.items()}


@pytest.mark.parametrize("fmt", ["safetensors", "sharded-safetensors", "bin", "sharded-bin", "tied-sharded-bin"])
def test_every_input_format_converts_losslessly(tiny, tmp_path, fmt):
    src = tiny[fmt]
    summary = conv.convert(src, tmp_path / "out", dtype="float32", progress=False)
    out = {}
    for f in (tmp_path / "out").glob("model*.safetensors"):
        out.update(mx.load(str(f)))
    expected = source_tensors(src)
    assert out.keys() == expected.keys()
    assert all(np.array_equal(np.array(out[k]), expected[k]) for k in expected)
    assert ("lm_head.weight" in out) == (fmt != "tied-sharded-bin")
    assert summary.parameters == sum(v.size for v in expected.values())


def test_legacy_non_zip_bin_converts(tiny, tmp_path):
    import shutil

    import torch

    src = tmp_path / "legacy"
    shutil.copytree(tiny["bin"], src)
    state = torch.load(src / "pytorch_model.bin", weights_only=True)
    torch.save(state, src / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    conv.convert(src, tmp_path / "out", dtype="float32", progress=False)
    out = mx.load(str(tmp_path / "out" / "model.safetensors"))
    assert all(np.array_equal(np.array(out[k]), v.float().numpy()) for k, v in state.items())


def test_output_loads_in_both_runtimes_with_the_same_logits(tiny, tmp_path):
    import mlx_lm

    for name, kwargs in (("f32", dict(dtype="float32")), ("q4", dict(quantize=True))):
        dst = tmp_path / name
        conv.convert(tiny["tied-sharded-bin"], dst, progress=False, **kwargs)
        ours, tok = load(dst, dtype="float32")
        theirs, tok2 = mlx_lm.load(str(dst))
        theirs.set_dtype(mx.float32)
        assert ours.args.mask_token_id == 805 and tok2.eos_token_id == tok.eos_token_id == 801
        ids = mx.array(np.random.default_rng(0).integers(0, 806, 40))[None]
        a = ours(ids, mx.arange(40))
        b = theirs(ids)
        assert np.allclose(np.array(a), np.array(b), atol=2e-3), float(mx.abs(a - b).max())


def test_tied_checkpoint_with_a_stray_lm_head_drops_it(tiny, tmp_path, capsys):
    src = tmp_path / "src"
    make_checkpoint(src, "tiny", "safetensors", tie_word_embeddings=True)
    tensors = h.read_st(src / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    h.write_st(src / "model.safetensors", tensors)
    summary = conv.convert(src, tmp_path / "out", progress=False)
    assert any("lm_head.weight dropped" in n for n in summary.notes)
    assert "lm_head.weight" not in mx.load(str(tmp_path / "out" / "model.safetensors"))


def test_a_checkpoint_of_a_real_vocabulary_converts_and_loads(tmp_path):
    """make_checkpoint at ReFusion's 151,671 rows grows the demo tokenizer to them: the loader refuses a
    tokenizer under half the embedding (its vocabulary files missing), so the docs' real-shape commands
    (the 0.6B QLoRA example, the benchmarks) need it whole."""
    from refusion_mlx.models.loading import load

    src = make_checkpoint(tmp_path / "src", "tiny", "safetensors", vocab_size=151671, mask_token_id=151670,
                          tie_word_embeddings=True)
    conv.convert(src, tmp_path / "out", progress=False)
    model, tokenizer = load(tmp_path / "out")
    assert len(tokenizer._tokenizer) == 151671 and tokenizer.encode("Who is Sven?") == \
        load(FIXTURE_MODEL)[1].encode("Who is Sven?")  # the demo's text encodes as before
    # the tokenizer's <|mask|> is the config's mask id, and its other tokens kept their ids (they were
    # numbered after the padding: <|mask|> 151660, EOS 151656 against the config's 801)
    assert tokenizer.get_vocab()["<|mask|>"] == model.args.mask_token_id == 151670
    assert tokenizer.eos_token_id == 801 and tokenizer.encode("<tool_call>") == [806]


# --------------------------------------------------------------------------
# Output folder, quantization recipes, sharding


def test_mlx_lm_dequantizes_a_converted_folder_into_one_that_loads(demo_out, golden_logits, tmp_path):
    """docs/convert.md sends users of mlx-lm's -d (not offered here) to mlx-lm itself."""
    from mlx_lm.convert import convert as mlx_lm_convert

    mlx_lm_convert(str(demo_out["q8"].path), str(tmp_path / "plain"), dequantize=True)
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert "quantization" not in config and config["mask_token_id"] == 805
    model, _ = load(tmp_path / "plain", dtype="float32")
    assert isinstance(model.model.layers[0].mlp.down_proj, nn.Linear)
    assert h.top1_agreement(model, golden_logits) >= 0.99


def test_output_folder_contents(demo_out):
    dst = demo_out["q4"].path
    config = json.loads((dst / "config.json").read_text())
    assert config["mask_token_id"] == 805 and config["model_type"] == "qwen3"
    assert {k: config["quantization"][k] for k in ("group_size", "bits", "mode")} == \
        {"group_size": 64, "bits": 4, "mode": "affine"}
    assert config["quantization_config"] == config["quantization"]
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
              "README.md", "model.safetensors", "model.safetensors.index.json"):
        assert (dst / f).is_file(), f
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    assert index["metadata"]["total_size"] == demo_out["q4"].bytes_after
    assert "mlx" in (dst / "README.md").read_text()
    assert not [p for p in dst.parent.iterdir() if ".partial-" in p.name]


def test_recipes_keep_embeddings_and_head_at_higher_precision(tmp_path):
    import mlx_lm

    s = conv.convert(FIXTURE_MODEL, tmp_path / "e8", quant_predicate="embed_8", progress=False)
    config = json.loads((tmp_path / "e8" / "config.json").read_text())["quantization"]
    assert config["model.embed_tokens"]["bits"] == config["lm_head"]["bits"] == 8 and config["bits"] == 4
    model, _ = load(tmp_path / "e8", join_projections=False)
    assert model.lm_head.bits == 8 and model.model.layers[0].self_attn.q_proj.bits == 4
    assert mlx_lm.load(str(tmp_path / "e8"))[0].model.embed_tokens.bits == 8
    conv.convert(FIXTURE_MODEL, tmp_path / "fp", quant_predicate="embed_fp", progress=False)
    model, _ = load(tmp_path / "fp", join_projections=False)
    assert isinstance(model.lm_head, nn.Linear) and isinstance(model.model.embed_tokens, nn.Embedding)
    assert isinstance(model.model.layers[0].mlp.up_proj, nn.QuantizedLinear)
    m46 = conv.convert(FIXTURE_MODEL, tmp_path / "m46", quant_predicate="mixed_4_6", progress=False)
    assert load(tmp_path / "m46")[0].lm_head.bits == 6
    # the summary and the model card say the layers' bits, not the top-level setting alone
    assert "4/6-bit affine by layer" in conv.format_summary(m46) and "4/8-bit" in conv.format_summary(s)
    assert "4/6-bit affine by layer" in (tmp_path / "m46" / "README.md").read_text()
    assert s.bits_per_weight > 4.6  # 8-bit edges cost more than uniform 4-bit's 4.5


def test_layers_not_divisible_by_the_group_size_stay_unquantized(tmp_path):
    src = make_checkpoint(tmp_path / "src", "tiny", "safetensors", intermediate_size=96)
    s = conv.convert(src, tmp_path / "out", quantize=True, progress=False)
    assert any("mlp.down_proj (96)" in n for n in s.notes)
    weights = mx.load(str(tmp_path / "out" / "model.safetensors"))
    assert "model.layers.0.mlp.down_proj.scales" not in weights
    assert "model.layers.0.mlp.up_proj.scales" in weights
    model, _ = load(tmp_path / "out")
    assert isinstance(model.model.layers[0].mlp.down_proj, nn.Linear)


def test_shards_are_split_and_indexed(tmp_path, monkeypatch):
    import mlx_lm

    monkeypatch.setattr(conv, "MAX_SHARD_GB", 0)  # every tensor in a shard of its own
    conv.convert(FIXTURE_MODEL, tmp_path / "out", quantize=True, q_bits=8, progress=False)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 40 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(p.name for p in (tmp_path / "out").glob("model-*.safetensors")) == shards
    model, _ = load(tmp_path / "out")
    assert model.model.layers[3].mlp.down_proj.bits == 8
    mlx_lm.load(str(tmp_path / "out"))


def test_other_quantization_modes(tmp_path):
    conv.convert(FIXTURE_MODEL, tmp_path / "mx", q_mode="mxfp4", progress=False)
    model, _ = load(tmp_path / "mx", dtype="float32")
    assert model.lm_head.mode == "mxfp4"
    out = model(mx.array([[800, 265, 198]]), mx.arange(3))
    assert out.shape == (1, 3, 806) and bool(mx.isfinite(out).all())


def test_5_bit_converts_loads_and_decodes(tmp_path, capsys):
    """MLX packs 5 bits, mlx_lm convert writes them and the loader reads them: the converter refused them."""
    import mlx_lm
    import refusion_mlx as rm

    code, err, out = h.run_cli(capsys, "--hf-path", FIXTURE_MODEL, "--mlx-path", tmp_path / "q5", "--q-bits", "5")
    assert code == 0 and "5-bit affine (group size 64)" in out, err
    model, tokenizer = load(tmp_path / "q5")
    assert model.lm_head.bits == 5 and model.model.layers[0].mlp.down_proj.bits == 5
    text = rm.generate(model, tokenizer, rm.chat_prompt(tokenizer, "Count from 1 to 5."), max_tokens=16)
    assert text.strip(), text
    mlx_lm.load(str(tmp_path / "q5"))


# --------------------------------------------------------------------------
# Bad inputs: one line on stderr, exit != 0, nothing at the destination


MALFORMED = {
    "truncated": ("safetensors", h.truncate, "truncated"),
    "header-length": ("safetensors", h.corrupt_header_length, "corrupted safetensors header"),
    "header-json": ("safetensors", h.corrupt_header_json, "corrupted safetensors header"),
    "overlapping-offsets": ("safetensors", h.overlap_offsets, "corrupted safetensors header (model.layers.0."
                            "self_attn.v_proj.weight overlaps model.layers.0.self_attn.k_proj.weight)"),
    "trailing-bytes": ("safetensors", lambda f: f.joinpath("model.safetensors").open("ab").write(b"\0" * 8),
                       "corrupted safetensors header (8 bytes after the last tensor belong to none)"),
    "missing-shard": ("sharded-safetensors", h.remove_shard, "missing shard model-00002-of-00003"),
    "wrong-shape": ("safetensors", h.reshape_tensor, "model.layers.1.mlp.up_proj.weight is [100, 64]"),
    "missing-tensor": ("safetensors", h.drop_tensor, "missing tensors: model.norm.weight"),
    "unexpected-tensor": ("safetensors", h.add_tensor, "unexpected tensors: model.layers.0.mlp.extra_proj"),
    "no-mask-id": ("safetensors", h.strip_mask_token, "no mask token"),
    "mask-outside": ("safetensors", lambda f: h.edit_config(f, mask_token_id=5000), "outside the vocabulary"),
    "mask-is-eos": ("safetensors", lambda f: h.edit_config(f, mask_token_id=801),
                    "config.json: mask_token_id 801 is an end (EOS) token id, not a mask token (the tokenizer's "
                    "<|mask|> is 805)"),
    "mask-not-the-tokenizers": ("safetensors", lambda f: h.edit_config(f, mask_token_id=17),
                                "config.json: mask_token_id 17 is not the tokenizer's <|mask|>, which is 805"),
    "eos-outside": ("safetensors", lambda f: h.edit_config(f, eos_token_id=9999), "eos token id 9999 is outside"),
    "no-vocabulary": ("safetensors", lambda f: [(f / n).unlink() for n in ("tokenizer.json", "vocab.json",
                                                                            "merges.txt") if (f / n).exists()],
                      "are its vocabulary files"),
    "pickle-runs-code": ("safetensors", h.evil_bin, "would run code"),
    "not-a-pickle": ("safetensors", h.garbage_bin, "pytorch_model.bin is not a PyTorch checkpoint (neither a zip "
                                                   "archive nor a valid pickle)"),
    "unknown-model-type": ("safetensors", lambda f: h.edit_config(f, model_type="gpt2", architectures=None),
                           "model_type is 'gpt2'"),
    "dtype-auto": ("safetensors", lambda f: h.edit_config(f, torch_dtype="auto"),
                   "config.json: torch_dtype is 'auto', which is not a dtype"),
    "bare-model": ("safetensors", h.bare_model, "the weights have no 'model.' prefix"),
    "qwen3-moe": ("safetensors", lambda f: h.edit_config(f, architectures=["Qwen3MoeForCausalLM"]),
                  "Qwen3ForCausalLM"),
    "small-embedding": ("safetensors", None, "the embedding has 700 rows but the tokenizer has 816"),
    "already-quantized": ("safetensors", lambda f: h.edit_config(f, quantization_config={"bits": 4}),
                          "already quantized"),
    "bad-index": ("sharded-safetensors", lambda f: (f / "model.safetensors.index.json").write_text("{"),
                  "model.safetensors.index.json is malformed"),
    "no-weights": ("safetensors", lambda f: (f / "model.safetensors").unlink(), "has no weights"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_checkpoint_one_line_error_and_no_destination(tmp_path, capsys, case):
    fmt, corrupt, message = MALFORMED[case]
    extra = {"vocab_size": 700} if case == "small-embedding" else {}
    src = make_checkpoint(tmp_path / "src", "tiny", fmt, **extra)
    if corrupt:
        corrupt(src)
    dst = tmp_path / "out" / "model"
    code, err, _ = h.run_cli(capsys, "--hf-path", src, "--mlx-path", dst, "-q")
    assert code == 1 and len(err) == 1 and message in err[0], err
    assert err[0].startswith("error: ")
    assert not dst.exists() and (not dst.parent.exists() or not any(dst.parent.iterdir()))
    assert not (src / "PWNED").exists()


@pytest.mark.parametrize("flags", [["--q-bits", "7"], ["--q-group-size", "48"], ["--dtype", "int8"],
                                   ["--q-mode", "nvfp4", "--q-group-size", "64"],
                                   ["--quant-predicate", "nonsense"], ["--q-mode", "mxfp4", "--quant-predicate", "mixed_3_6"],
                                   ["--quant-predicate", "mixed_2_6", "--q-bits", "8"]])  # its summary said 8-bit
def test_invalid_flags_exit_2_in_one_line(tmp_path, capsys, flags):
    code, err, _ = h.run_cli(capsys, "--hf-path", FIXTURE_MODEL, "--mlx-path", tmp_path / "out", *flags)
    assert code == 2 and len(err) == 1 and "error:" in err[0], err
    assert not (tmp_path / "out").exists()


def test_a_config_without_architectures_is_read_by_its_model_type(tmp_path):
    """As docs/convert.md says: architectures is checked where the config lists any."""
    src = shutil.copytree(FIXTURE_MODEL, tmp_path / "src")
    h.edit_config(src, architectures=None)
    conv.convert(src, tmp_path / "out", progress=False)
    assert load(tmp_path / "out")[0].args.model_type == "qwen3"


def test_pytorch_bin_without_torch_names_the_extra(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    code, err, _ = h.run_cli(capsys, "--hf-path", tiny["bin"], "--mlx-path", tmp_path / "out")
    assert code == 1 and len(err) == 1 and "refusion-mlx[torch]" in err[0], err
    assert not (tmp_path / "out").exists()


def test_uncached_hub_id_offline_is_one_line(tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    code, err, _ = h.run_cli(capsys, "--hf-path", "nobody/no-such-refusion", "--mlx-path", tmp_path / "out")
    assert code == 1 and len(err) == 1 and "offline and not cached" in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt,fetches", [("safetensors", 1), ("bin", 2)])
def test_hub_source_fetches_bin_files_only_when_there_are_no_safetensors(tiny, monkeypatch, fmt, fetches):
    asked = []

    def snapshot(repo, allow_patterns=None):
        asked.append(allow_patterns)
        return tiny[fmt]

    monkeypatch.setattr(conv, "resolve_model_path", snapshot)
    assert conv.resolve_source("org/refusion") == tiny[fmt]
    assert len(asked) == fetches and "model*.safetensors" in asked[0] and "config.json" in asked[0]
    assert ("pytorch_model*.bin" in asked[-1]) == (fmt == "bin") and "pytorch_model*.bin" not in asked[0]
    assert not any(p.endswith((".md", ".msgpack", ".h5", ".onnx")) for p in asked[-1])


def test_existing_destination_needs_force(tmp_path, capsys):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    code, err, _ = h.run_cli(capsys, "--hf-path", FIXTURE_MODEL, "--mlx-path", dst)
    assert code == 1 and len(err) == 1 and "--force" in err[0]
    assert (dst / "keep.txt").read_text() == "mine"
    import refusion_mlx as rm  # the Python function's words name its parameter too

    with pytest.raises(RefusionError, match=r"force=True"):
        rm.convert(FIXTURE_MODEL, dst)
    code, err, _ = h.run_cli(capsys, "--hf-path", FIXTURE_MODEL, "--mlx-path", dst, "--force", "-q")
    assert code == 1 and "not a model folder" in err[0]  # --force never deletes a folder of other files
    assert (dst / "keep.txt").read_text() == "mine"
    (dst / "config.json").write_text("{}")  # an earlier model there: --force replaces it
    code, _, out = h.run_cli(capsys, "--hf-path", FIXTURE_MODEL, "--mlx-path", dst, "--force", "-q")
    assert code == 0 and "bits per weight" in out
    assert not (dst / "keep.txt").exists() and (dst / "config.json").is_file()
    data = tmp_path / "data.jsonl"
    data.write_text("{}\n")
    code, err, _ = h.run_cli(capsys, "--hf-path", FIXTURE_MODEL, "--mlx-path", data, "--force")
    assert code == 1 and "is a file" in err[0] and data.read_text() == "{}\n"
    code, err, _ = h.run_cli(capsys, "--hf-path", FIXTURE_MODEL, "--mlx-path", data / "sub" / "model")
    assert code == 1 and err == [f"error: {data}/sub/model: {data} is a file, not a folder"], err
    code, err, _ = h.run_cli(capsys, "--hf-path", dst, "--mlx-path", dst, "--force")
    assert code == 1 and "would replace the source" in err[0]
    assert (dst / "config.json").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert h.run_cli(capsys, "--hf-path", FIXTURE_MODEL, "--mlx-path", empty)[0] == 0


def test_a_link_or_the_current_folder_is_refused_before_converting(tmp_path, capsys, monkeypatch):
    """Each passed the checks, was converted, then failed ("appeared during the conversion", "Device or
    resource busy", a traceback once the current folder was gone), or --force replaced a link by a folder."""
    conv.convert(FIXTURE_MODEL, tmp_path / "model", progress=False)
    for link, target in (("out", "empty"), ("dangling", "nowhere"), ("model-link", "model")):
        (tmp_path / link).symlink_to(target)
    (tmp_path / "empty").mkdir()
    sub = tmp_path / "here" / "sub"
    sub.mkdir(parents=True)
    link = "is a symbolic link (to {}); give the folder it points to, or a new path"
    current = "is the current folder, which the model would replace; give a new path, such as {}/model"
    cases = [(tmp_path, "out", [], tmp_path / "out", link.format("empty")),
             (tmp_path, "dangling", [], tmp_path / "dangling", link.format("nowhere")),
             (tmp_path, "model-link", ["--force"], tmp_path / "model-link", link.format("model")),
             (tmp_path / "model", ".", ["--force"], tmp_path / "model", current.format(tmp_path / "model")),
             (sub, ".", [], sub, current.format(sub)), (sub, "../sub", [], sub, current.format(sub)),
             (sub, "..", ["--force"], sub.parent, "holds the current folder, which replacing it would remove; "
                                                  "give another path")]
    for cwd, given, flags, dst, message in cases:
        monkeypatch.chdir(cwd)
        code, err, _ = h.run_cli(capsys, "--hf-path", FIXTURE_MODEL, "--mlx-path", given, "-q", *flags)
        assert code == 1 and err == [f"error: {dst} {message}"], (given, err)
    assert [(tmp_path / n).readlink().name for n in ("out", "dangling", "model-link")] == ["empty", "nowhere", "model"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "empty", "here", "model", "model-link", "out"]
    assert not any((tmp_path / "empty").iterdir()) and not any((tmp_path / "here" / "sub").iterdir())
    assert not is_quantized(tmp_path / "model")


def test_failed_force_keeps_the_old_destination(tmp_path, capsys):
    dst = tmp_path / "out"
    conv.convert(FIXTURE_MODEL, dst, progress=False)
    src = make_checkpoint(tmp_path / "bad", "tiny", "safetensors")
    h.truncate(src)
    code, _, _ = h.run_cli(capsys, "--hf-path", src, "--mlx-path", dst, "--force")
    assert code == 1 and load(dst)[0].args.mask_token_id == 805


# --------------------------------------------------------------------------
# Interrupted conversions leave nothing loadable behind


@pytest.mark.parametrize("failure,code,message", [
    (KeyboardInterrupt(), 130, "interrupted"),
    (OSError(28, "No space left on device"), 1, "No space left on device"),
    (RuntimeError("a bug"), 1, "unexpected RuntimeError: a bug"),
])
def test_failure_mid_write_leaves_no_destination(tmp_path, capsys, monkeypatch, failure, code, message):
    from refusion_mlx.convert.shards import ShardWriter

    written = []
    original = ShardWriter.write

    def write_then_fail(self, name, array):
        original(self, name, array)
        written.append(name)
        if len(written) == 5:
            raise failure

    monkeypatch.setattr(ShardWriter, "write", write_then_fail)
    dst = tmp_path / "out"
    rc, err, _ = h.run_cli(capsys, "--hf-path", FIXTURE_MODEL, "--mlx-path", dst)
    assert rc == code and message in err[-1] and len(written) == 5, err
    assert h.leftovers(dst) == []


SLOW_CONVERTER = """
import sys, time
sys.modules["torch"] = None  # the demo is safetensors: PyTorch, which mlx-lm's transformers imports, is ~3.5 s of CPU
import refusion_mlx
from refusion_mlx import convert
from refusion_mlx.convert import shards
write = shards.ShardWriter.write
def slow_write(self, name, array):
    write(self, name, array)
    self.file.flush()
    time.sleep(0.05)
shards.ShardWriter.write = slow_write
sys.exit(convert.main(sys.argv[1:]))
"""


def slow_conversion(dst: Path, **popen) -> subprocess.Popen:
    """A conversion of the demo to ``dst`` in a process of its own, 0.05 s a tensor (47: 2.4 s)."""
    return subprocess.Popen([sys.executable, "-c", SLOW_CONVERTER, "--hf-path", str(FIXTURE_MODEL),
                             "--mlx-path", str(dst)], cwd=REPO, stderr=subprocess.PIPE, text=True, **popen)


def signal_mid_write(proc: subprocess.Popen, dst: Path, sig: int) -> None:
    """Send ``sig`` once a few tensors of the conversion to ``dst`` are written."""
    staging = dst.parent / f".{dst.name}.partial-{proc.pid}"
    deadline = time.time() + 60
    while not (staging / "model.safetensors.partial").is_file() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # a few tensors in
    proc.send_signal(sig)


def test_killed_or_terminated_mid_write_leaves_nothing_loadable(tmp_path):
    import mlx_lm

    runs = {sig: tmp_path / f"out-{sig.name}" for sig in (signal.SIGKILL, signal.SIGTERM)}
    procs = {sig: slow_conversion(dst) for sig, dst in runs.items()}
    for sig, proc in procs.items():
        signal_mid_write(proc, runs[sig], sig)
    for sig, proc in procs.items():
        _, err = proc.communicate(timeout=60)
        dst = runs[sig]
        assert not dst.exists()
        if sig == signal.SIGTERM:
            assert proc.returncode == 128 + signal.SIGTERM and "terminated" in err.splitlines()[-1]
            assert h.leftovers(dst) == []
        else:
            assert proc.returncode == -signal.SIGKILL
            (staging,) = [tmp_path / n for n in h.leftovers(dst)]  # SIGKILL cannot be caught...
            assert sorted(p.name for p in staging.iterdir()) == ["model.safetensors.partial"]
            with pytest.raises(LoadError):
                load(staging)
            with pytest.raises(Exception):
                mlx_lm.load(str(staging))
            conv.convert(FIXTURE_MODEL, dst, progress=False)  # ...and the next run clears it away
            assert h.leftovers(dst) == [dst.name]


def test_a_hangup_under_nohup_leaves_the_conversion_running(tmp_path):
    """nohup starts the command with SIGHUP ignored, and it stays ignored (it ended the conversion,
    "terminated", exit 129); a hangup without nohup still ends it, as SIGTERM does."""
    ignored, default = tmp_path / "nohup", tmp_path / "plain"
    procs = {ignored: slow_conversion(ignored, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)),
             default: slow_conversion(default, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))}
    for dst, proc in procs.items():
        signal_mid_write(proc, dst, signal.SIGHUP)
    _, err = procs[ignored].communicate(timeout=120)
    assert procs[ignored].returncode == 0, err
    assert load(ignored)[0].args.mask_token_id == 805
    _, err = procs[default].communicate(timeout=120)
    assert procs[default].returncode == 128 + signal.SIGHUP and "terminated" in err.splitlines()[-1], err
    assert h.leftovers(default) == []


# --------------------------------------------------------------------------
# The convert/ tooling


def test_parity_tool_against_transformers(tiny, tmp_path):
    from convert.parity import parity

    conv.convert(tiny["tied-sharded-bin"], tmp_path / "out", dtype="float32", progress=False)
    report = parity(tiny["tied-sharded-bin"], tmp_path / "out", length=48, count=1)
    assert report["top1_agreement"] == 1.0 and report["max_abs_diff"] < 1e-3, report
    assert {r["sequence"] for r in report["sequences"]} == {"seq0-plain", "seq0-slots"}


def test_a_config_without_rope_theta_gets_transformers_default(tiny, tmp_path):
    """transformers' Qwen3Config runs 10000.0 then (1e6 gave top-1 0.90 against PyTorch)."""
    from convert.parity import parity

    src = shutil.copytree(tiny["safetensors"], tmp_path / "src")
    h.edit_config(src, rope_theta=None)
    conv.convert(src, tmp_path / "out", dtype="float32", progress=False)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["rope_theta"] == 10000.0
    report = parity(src, tmp_path / "out", length=48, count=1)
    assert report["top1_agreement"] == 1.0 and report["max_abs_diff"] < 1e-3, report


@pytest.mark.parametrize("kwargs,message", [
    (dict(q_bits=7), "q_bits must be one of 2, 3, 4, 5, 6, 8, got 7"),
    (dict(q_bits=4.0), "q_bits must be one of 2, 3, 4, 5, 6, 8, got 4.0"),  # a TypeError of mx.quantize
    (dict(q_bits="4"), "q_bits must be one of 2, 3, 4, 5, 6, 8, got '4'"),
    (dict(q_bits=True), "q_bits must be one of 2, 3, 4, 5, 6, 8, got True"),
    (dict(q_bits=0), "q_bits must be one of 2, 3, 4, 5, 6, 8, got 0"),  # it meant the default
    (dict(q_group_size=64.0), "q_group_size must be one of 32, 64, 128, got 64.0"),
    (dict(q_mode="nvfp4", q_bits=8), "q_mode nvfp4 needs group size 16 and 4 bits, got group size 16 and 8 bits"),
    (dict(q_mode=["affine"]), "q_mode must be one of affine, mxfp4, nvfp4, mxfp8, got ['affine']"),
    (dict(quant_predicate="mixed_2_6", q_bits=8), "q_bits does not go with quant_predicate mixed_2_6"),
    (dict(dtype="int8"), "dtype must be one of float16, bfloat16, float32, got 'int8'"),
])
def test_python_api_raises_before_writing_naming_its_parameters(tmp_path, kwargs, message):
    with pytest.raises(RefusionError) as e:
        conv.convert(FIXTURE_MODEL, tmp_path / "out", **kwargs)
    assert str(e.value).startswith(message) and "--" not in str(e.value), e.value
    assert not (tmp_path / "out").exists()


def test_the_command_names_its_flags(tmp_path, capsys):
    code, err, _ = h.run_cli(capsys, "--hf-path", FIXTURE_MODEL, "--mlx-path", tmp_path / "out",
                             "--quant-predicate", "mixed_2_6", "--q-bits", "8")
    assert code == 2 and "error: --q-bits does not go with --quant-predicate mixed_2_6" in err[-1], err


def test_the_command_takes_each_modes_own_group_size(tmp_path, capsys):
    """--q-group-size was checked against the affine sizes whatever the mode: nvfp4's own 16 was refused."""
    code, err, out = h.run_cli(capsys, "--hf-path", FIXTURE_MODEL, "--mlx-path", tmp_path / "nv", "--q-mode", "nvfp4",
                               "--q-group-size", "16")
    assert code == 0 and "4-bit nvfp4 (group size 16)" in out, err
    quant = json.loads((tmp_path / "nv" / "config.json").read_text())["quantization"]
    assert (quant["mode"], quant["group_size"], quant["bits"]) == ("nvfp4", 16, 4)
    code, err, _ = h.run_cli(capsys, "--hf-path", FIXTURE_MODEL, "--mlx-path", tmp_path / "a", "--q-group-size", "16")
    assert code == 2 and err == ["python -m refusion_mlx.convert: error: --q-group-size must be one of 32, 64, "
                                 "128, got 16"], err


# --------------------------------------------------------------------------
# --force: the swap of the old folder for the new one


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def old_and_new(tmp_path):
    """A float32 conversion at ``out`` (the old model), and the 4-bit one (the new) to replace it."""
    dst = tmp_path / "out"
    conv.convert(FIXTURE_MODEL, dst, dtype="float32", progress=False)
    return dst, ("--hf-path", FIXTURE_MODEL, "--mlx-path", dst, "--force", "-q")


def is_quantized(dst: Path) -> bool:
    return "quantization" in json.loads((dst / "config.json").read_text())


@pytest.mark.parametrize("sig,code,word", [(signal.SIGINT, 130, "interrupted"),
                                           (signal.SIGTERM, 143, "terminated")])
def test_a_signal_between_the_renames_of_force_waits_for_the_swap(tmp_path, capsys, monkeypatch, sig, code, word):
    from refusion_mlx.convert import staging

    dst, argv = old_and_new(tmp_path)
    rename, calls = os.rename, []

    def rename_then_signal(a, b):
        rename(a, b)
        if Path(b).parent != dst.parent:  # os.rename is patched for the whole process: only the swap's count
            return
        calls.append(Path(b).name)
        if len(calls) == 1:  # the old folder is aside, the new one not yet in place
            signal.raise_signal(sig)

    monkeypatch.setattr(staging.os, "rename", rename_then_signal)
    # a shell's background job (`pytest &`) ignores SIGINT, and an ignored signal stays ignored: Python's own
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        rc, err, _ = h.run_cli(capsys, *argv)
    finally:
        signal.signal(signal.SIGINT, before)
    assert rc == code and err[-1] == f"{word}: {dst} holds the new model (it was complete)", err
    assert calls == [f".out.replaced-{os.getpid()}", "out"]
    assert is_quantized(dst) and h.leftovers(dst) == ["out"]


def test_a_failed_rename_of_force_puts_the_old_folder_back(tmp_path, capsys, monkeypatch):
    from refusion_mlx.convert import staging

    dst, argv = old_and_new(tmp_path)
    rename, calls = os.rename, []

    def second_fails(a, b):
        calls.append(Path(b).name)
        if len(calls) == 2:
            raise OSError(5, "Input/output error", str(a))
        rename(a, b)

    monkeypatch.setattr(staging.os, "rename", second_fails)
    rc, err, _ = h.run_cli(capsys, *argv)
    assert rc == 1 and err[-1].endswith(f"{dst} left as it was") and "Input/output error" in err[-1], err
    assert not is_quantized(dst) and h.leftovers(dst) == ["out"]


def test_the_next_run_undoes_a_force_killed_between_its_renames(tmp_path, capsys):
    dst, argv = old_and_new(tmp_path)
    pid = dead_pid()
    aside, staged = tmp_path / f".out.replaced-{pid}", tmp_path / f".out.partial-{pid}"
    os.rename(dst, aside)  # SIGKILL after the first rename: no destination, the old one aside
    staged.mkdir()
    rc, err, _ = h.run_cli(capsys, "--hf-path", FIXTURE_MODEL, "--mlx-path", dst, "-q")
    assert rc == 1 and "put back as it was" in err[0] and "--force" in err[-1], err
    assert not is_quantized(dst) and h.leftovers(dst) == ["out"]
    shutil.copytree(dst, aside)  # killed once the new model was in place: the old one goes
    conv.convert(FIXTURE_MODEL, dst, progress=False, force=True)
    assert h.leftovers(dst) == ["out"]


def test_stale_folders_are_matched_by_their_exact_name(tmp_path, capsys, monkeypatch):
    """The cleanup of what a killed conversion left globbed the destination's name: 'o*' put back
    another folder's moved-aside copy, and 'model[1]' never found its own staging folder."""
    monkeypatch.chdir(tmp_path)
    pid = dead_pid()
    other = tmp_path / f".other.replaced-{pid}"
    other.mkdir()
    (other / "config.json").write_text("{}")
    code, err, _ = h.run_cli(capsys, "--hf-path", FIXTURE_MODEL, "--mlx-path", "o*", "-q")
    assert code == 0 and not any("put back" in line for line in err), err
    assert (other / "config.json").read_text() == "{}" and is_quantized(tmp_path / "o*")
    stale = tmp_path / f".model[1].partial-{pid}"
    stale.mkdir()
    assert h.run_cli(capsys, "--hf-path", FIXTURE_MODEL, "--mlx-path", "model[1]", "-q")[0] == 0
    assert not stale.exists() and h.leftovers(tmp_path / "model[1]") == ["model[1]"]


def test_a_long_name_converts_and_one_too_long_is_one_line(tmp_path, capsys):
    """The staging folder '.NAME.partial-PID' is 15 bytes longer than NAME: a name of 250 bytes failed
    (File name too long) once converted, and a name that could not be checked ended in a traceback."""
    from refusion_mlx.convert import staging

    dst = tmp_path / ("m" * 250)
    stale = staging.sibling(dst, "partial", dead_pid())
    stale.mkdir()  # what a SIGKILL left: found and removed under its shortened name
    assert len(stale.name) <= 255 and stale.name.startswith(".mmm")
    assert h.run_cli(capsys, "--hf-path", FIXTURE_MODEL, "--mlx-path", dst, "-q")[0] == 0
    assert h.run_cli(capsys, "--hf-path", FIXTURE_MODEL, "--mlx-path", dst, "--force")[0] == 0
    assert not is_quantized(dst) and sorted(p.name for p in tmp_path.iterdir()) == [dst.name]
    code, err, _ = h.run_cli(capsys, "--hf-path", FIXTURE_MODEL, "--mlx-path", tmp_path / ("m" * 256), "-q")
    assert code == 1 and err[-1].startswith("error: ") and "File name too long" in err[-1], err
    assert sorted(p.name for p in tmp_path.iterdir()) == [dst.name]


def test_a_destination_that_cannot_be_checked_is_one_line(tmp_path, capsys, monkeypatch):
    """A folder above it that this user cannot enter: exists() raises PermissionError; the error's own
    message checked the destination again, and its traceback was all the user saw."""
    locked = tmp_path / "locked"
    locked.mkdir()
    exists = Path.exists

    def no_entry(self):
        if locked in self.parents:
            raise PermissionError(13, "Permission denied", str(self))
        return exists(self)

    monkeypatch.setattr(Path, "exists", no_entry)
    code, err, _ = h.run_cli(capsys, "--hf-path", FIXTURE_MODEL, "--mlx-path", locked / "model", "-q")
    assert code == 1 and len(err) == 1 and err[0].startswith("error: ") and "Permission denied" in err[0], err
    assert not any(locked.iterdir())


@pytest.mark.parametrize("module,argv,code,message", [
    ("make_checkpoint", ["{tmp}/out", "--shape", "tiny", "--shards", "0"], 2, "--shards: expected a positive integer"),
    ("make_checkpoint", ["{tmp}/out", "--shape", "tiny", "--layers", "0"], 2, "--layers: expected a positive integer"),
    ("make_checkpoint", ["{tmp}/afile/out", "--shape", "tiny"], 1, "error: cannot write {tmp}/afile/out"),
    ("make_checkpoint", ["{tmp}", "--shape", "tiny"], 2, "exists and is not an empty folder"),
    ("parity", ["--hf-path", "{tmp}", "--mlx-path", "{tmp}"], 2, "--hf-path {tmp} is not a model folder"),
    ("parity", ["--hf-path", "x", "--mlx-path", "y", "--count", "0"], 2, "--count: expected a positive integer"),
    ("parity", ["--hf-path", "x", "--mlx-path", "y", "--length", "4"], 2, "--length: expected at least 8"),
    ("convert_quality", ["--variants", "q4,bogus"], 2, "unknown variant bogus"),
    ("convert_memory", ["--format", "nope"], 2, "--format must be one of safetensors"),
])
def test_the_tools_refuse_bad_arguments_in_one_line(tmp_path, capsys, module, argv, code, message):
    import importlib

    (tmp_path / "afile").write_text("")
    main = importlib.import_module(f"convert.{module}").main
    try:
        rc = main([a.format(tmp=tmp_path) for a in argv])
    except SystemExit as e:
        rc = e.code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == code and len(err) == 1 and message.format(tmp=tmp_path) in err[0], err
    assert (tmp_path / "afile").read_text() == "" and not (tmp_path / "out").exists()


def test_a_mount_point_or_a_read_only_parent_is_refused_before_converting(tmp_path, capsys, monkeypatch):
    """The folder is staged beside the destination: an empty mount point failed once the model was
    written ("Device or resource busy"), a read-only parent on its first write."""
    from refusion_mlx.convert import staging

    mount = tmp_path / "disk"
    mount.mkdir()
    monkeypatch.setattr(staging.os.path, "ismount", lambda p: Path(p) == mount)
    code, err, _ = h.run_cli(capsys, "--hf-path", FIXTURE_MODEL, "--mlx-path", mount)
    assert code == 1 and err == [f"error: {mount} is a mount point, and the model is written beside it then "
                                 f"renamed into place; give a folder inside it ({mount}/model)"], err
    assert h.run_cli(capsys, "--hf-path", FIXTURE_MODEL, "--mlx-path", mount / "model")[0] == 0
    monkeypatch.setattr(staging.os, "access", lambda p, mode: Path(p) != tmp_path)
    code, err, _ = h.run_cli(capsys, "--hf-path", FIXTURE_MODEL, "--mlx-path", tmp_path / "new" / "model")
    assert code == 1 and err == [f"error: {tmp_path}/new/model: {tmp_path} is not writable (the model is "
                                 "written beside model, then renamed into place)"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk"]


@pytest.mark.parametrize("declared,stored", [("half", "F16"), ("float", "F32"), ("double", "BF16")])
def test_pytorchs_other_names_of_a_dtype_are_the_default_output_dtype(tmp_path, declared, stored):
    """A config's torch_dtype "half" is float16 to transformers ("float" float32; "double", float64, is no
    output dtype: the weights' own), the default output dtype; such configs were refused as "not a dtype"."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(FIXTURE_MODEL, src)
    h.edit_config(src, torch_dtype=declared)
    from refusion_mlx.models.config_checks import read_headers

    conv.convert(src, tmp_path / "out", progress=False)
    assert {t.dtype for t in read_headers([tmp_path / "out" / "model.safetensors"]).values()} == {stored}
