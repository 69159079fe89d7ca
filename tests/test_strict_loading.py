"""A checkpoint's config and an adapter folder are checked before anything is
built from them: every bad value is one line (on every command that loads
them), absurd sizes are refused without allocating, and an adapter file must
hold exactly the tensors its config describes."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from refusion_mlx.errors import ConfigError, LoadError
from refusion_mlx.models import config_checks, registry
from refusion_mlx.models.adapter_files import save_adapters, write_adapter_config
from refusion_mlx.models.adapters import add_adapters, lora_parameters
from refusion_mlx.models.loading import DEMO_MODEL, load, load_model

DATA = Path(__file__).parent / "fixtures" / "train-data"
BASE = json.loads((DEMO_MODEL / "config.json").read_text())


def checkpoint(folder: Path, **changes) -> Path:
    """The demo model's folder (its files copied: links out of a model folder are refused) with config.json changed."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in DEMO_MODEL.iterdir():
        if f.name != "config.json":
            shutil.copy(f, folder / f.name)
    (folder / "config.json").write_text(json.dumps({**BASE, **changes}))
    return folder


@pytest.mark.parametrize("changes,line", [
    ({"num_hidden_layers": 1000000}, "num_hidden_layers must be within 1..1024, got 1000000"),
    ({"vocab_size": 10 ** 12}, "vocab_size must be within 2..4194304, got 1000000000000"),
    ({"vocab_size": 1e12}, "vocab_size must be an integer, got 1000000000000.0"),
    ({"head_dim": 2 ** 40}, "head_dim must be within 2..4096, got 1099511627776"),
    ({"rope_theta": -1}, "rope_theta must be a number over 1 and at most 1e12, got -1"),
    ({"rope_theta": "big"}, 'rope_theta must be a number over 1 and at most 1e12, got "big"'),
    ({"rope_theta": 1e308}, "rope_theta must be a number over 1 and at most 1e12, got 1e+308"),  # numpy overflowed
    ({"rope_theta": 1e-300}, "rope_theta must be a number over 1 and at most 1e12, got 1e-300"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be an integer, got true"),
    ({"tie_word_embeddings": "no"}, 'tie_word_embeddings must be true or false, got "no"'),
    ({"use_sliding_window": 0}, "use_sliding_window must be true or false, got 0"),
    ({"rms_norm_eps": 0}, "rms_norm_eps must be a number in (0, 1), got 0"),
    ({"rope_scaling": {"type": "linear", "factor": "x"}}, 'rope_scaling.factor must be a number in (0, 1024], got "x"'),
    ({"rope_scaling": {"type": "linear", "factor": 1e308}}, "rope_scaling.factor must be a number in (0, 1024], got 1e+308"),
    ({"rope_scaling": "linear"}, 'rope_scaling must be an object or null, got "linear"'),
    ({"mask_token_id": -1}, "mask_token_id must be a token id (an integer >= 0), got -1"),
    ({"max_position_embeddings": -5}, "max_position_embeddings must be within 1..16777216, got -5"),
])
def test_each_bad_config_value_is_one_line(changes, line):
    with pytest.raises(ConfigError) as e:
        registry.family_args({**BASE, **changes})
    assert str(e.value) == f"config.json: {line}"


def test_every_bad_value_gets_its_own_line():
    with pytest.raises(ConfigError) as e:
        registry.family_args({**BASE, "num_hidden_layers": True, "rope_theta": -1, "head_dim": 2 ** 40,
                             "vocab_size": 1e12})
    assert str(e.value).splitlines() == [
        "config.json: num_hidden_layers must be an integer, got true",
        "config.json: head_dim must be within 2..4096, got 1099511627776",
        "config.json: vocab_size must be an integer, got 1000000000000.0",
        "config.json: rope_theta must be a number over 1 and at most 1e12, got -1"]


def test_sizes_are_checked_against_the_safetensors_headers(tmp_path):
    folder = checkpoint(tmp_path / "m", num_hidden_layers=5, vocab_size=900, intermediate_size=1024,
                        quantization={"bits": 7})
    with pytest.raises(LoadError) as e:
        load_model(folder)
    assert [line.split("config.json: ")[1] for line in str(e.value).splitlines()] == [
        "quantization.bits must be 2, 3, 4, 5, 6 or 8, got 7",
        "num_hidden_layers is 5, but the weights hold 4 layers",
        "vocab_size is 900, but model.embed_tokens.weight has 816 rows",
        "intermediate_size is 1024, but model.layers.0.mlp.gate_proj.weight has 768 rows",
        "vocab_size is 900, but lm_head.weight has 816 rows"]


def test_a_number_past_pythons_digit_limit_is_one_line(tmp_path):
    """json reads a 5000-digit integer as a ValueError that is no JSONDecodeError: it was a traceback."""
    folder = checkpoint(tmp_path / "m")
    text = (folder / "config.json").read_text()
    (folder / "config.json").write_text(text.replace('"vocab_size": 816', '"vocab_size": ' + "9" * 5000))
    with pytest.raises(LoadError, match=r"config.json is not valid JSON: Exceeds the limit \(4300 digits\)"):
        load(folder)


def with_weight(folder: Path, name: str, make) -> Path:
    """``folder``'s weights with ``name`` replaced by ``make(old)``."""
    weights = mx.load(str(folder / "model.safetensors"))
    weights[name] = make(weights[name])
    (folder / "model.safetensors").unlink()
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    return folder


Q = "model.layers.1.self_attn.q_proj.weight"


@pytest.mark.parametrize("make,message", [
    (lambda w: w.astype(mx.int32), f"config.json: {Q} is I32: weights are float32, float16 or bfloat16"),
    (lambda w: w > 0, f"config.json: {Q} is BOOL: weights are float32, float16 or bfloat16"),
    (lambda w: w * mx.array(float("nan")), f"{Q} holds values that are not finite (NaN or infinity)"),
    (lambda w: mx.where(w > 0.01, mx.array(float("inf")), w),
     f"{Q} holds values that are not finite (NaN or infinity)"),
])
def test_weights_that_are_not_floats_or_not_finite_are_refused(tmp_path, make, message):
    """Before: int32 or bool weights loaded and decoded other text, NaN ones '!!!!', exit 0; convert too."""
    from refusion_mlx.convert.converter import convert

    folder = with_weight(checkpoint(tmp_path / "m"), Q, make)
    with pytest.raises(LoadError) as e:
        load(folder)
    assert str(e.value).endswith(message) and "\n" not in str(e.value)
    with pytest.raises(LoadError, match="not finite|not bf16/fp16/fp32"):
        convert(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_adapters_that_are_not_finite_are_refused(lora_folder, tmp_path):
    folder, weights = lora_folder
    name = next(iter(weights))
    bad = adapter_variant(folder, tmp_path / "nan", {**weights, name: weights[name] * float("nan")})
    with pytest.raises(LoadError, match=f"^{bad}: .*lora.* holds values that are not finite"):
        load(DEMO_MODEL, dtype="float32", adapter_path=str(bad))


def test_a_cast_past_the_dtypes_range_is_refused_by_convert(tmp_path):
    from refusion_mlx.convert.converter import convert

    folder = with_weight(checkpoint(tmp_path / "m"), Q, lambda w: w.at[0, 0].add(1e6))  # float16's most: 65504
    with pytest.raises(LoadError, match=f"{Q}: holds values that are not finite .* in float16"):
        convert(folder, tmp_path / "out", dtype="float16")
    assert not (tmp_path / "out").exists()
    convert(folder, tmp_path / "out32", dtype="float32")  # in range there


def sparse_checkpoint(folder: Path, vocab: int, hidden: int) -> Path:
    """A one-layer checkpoint whose embedding (vocab x hidden float32) is a hole
    in a sparse file: its header is true, its bytes cost no disk."""
    folder.mkdir()
    small = {"model.norm.weight": [hidden], "model.layers.0.input_layernorm.weight": [hidden]}
    header, offset = {}, 0
    for name, shape in [("model.embed_tokens.weight", [vocab, hidden])] + list(small.items()):
        size = 4 * vocab * hidden if name.startswith("model.embed") else 4 * shape[0]
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    with open(folder / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + offset)
    config = {**BASE, "num_hidden_layers": 1, "vocab_size": vocab, "hidden_size": hidden,
              "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": hidden // 16, "mask_token_id": 5}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_weights_that_cannot_fit_are_refused_before_anything_is_allocated(tmp_path, monkeypatch):
    # 2^22 x 8192 float32 = 128 GiB of embedding, more than any machine these tests run on
    folder = sparse_checkpoint(tmp_path / "huge", 1 << 22, 8192)
    active = mx.get_active_memory()
    with pytest.raises(LoadError, match=r"the weights need 128\.0 GiB, more than this machine's"):
        load_model(folder, dtype="float32")
    assert mx.get_active_memory() == active
    # the demo model under a memory limit below its weights (3.57M parameters: 14 MB in float32)
    monkeypatch.setattr(config_checks, "physical_memory", lambda: 8 << 20)
    with pytest.raises(LoadError, match=r"need 0\.0 GiB, more than this machine's 0\.0 GiB of memory"):
        load_model(DEMO_MODEL, dtype="float32")


def test_a_lying_safetensors_header_is_one_line(tmp_path):
    folder = checkpoint(tmp_path / "m")
    (folder / "model.safetensors").unlink()
    data = (DEMO_MODEL / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(LoadError, match=r"model.safetensors is not a valid safetensors file: .* \(truncated\?\)"):
        load_model(folder)


# --------------------------------------------------------------------------
# Every command: one line per bad value, exit 1, no traceback


def run_main(main, argv, capsys) -> tuple:
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    captured = capsys.readouterr()
    return code, captured.err


@pytest.fixture(scope="module")
def bad_model(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("bad") / "m", num_hidden_layers=True, rope_theta=-1)


@pytest.fixture(scope="module")
def lora_folder(tmp_path_factory):
    """A LoRA adapter folder for the demo model (2 layers, rank 4), and its tensors."""
    model, _ = load(DEMO_MODEL, dtype="float32", join_projections=False)
    mx.random.seed(0)
    add_adapters(model, "lora", 2, lora_parameters(rank=4))
    weights = {k: mx.random.normal(v.shape) * 0.01 for k, v in tree_flatten(model.trainable_parameters())}
    folder = tmp_path_factory.mktemp("lora") / "adapters"
    write_adapter_config({"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": lora_parameters(rank=4)},
                         folder)
    save_adapters(weights, folder)
    return folder, weights


def commands(model: Path, tmp: Path, adapters: Path):
    from refusion_mlx.chat import main as chat
    from refusion_mlx.convert.__main__ import main as convert
    from refusion_mlx.fuse import main as fuse
    from refusion_mlx.generate import main as generate
    from refusion_mlx.server import main as server
    from refusion_mlx.train.__main__ import main as train

    m = str(model)
    return {"generate": (generate, ["--model", m, "--prompt", "hi"]),
            "chat": (chat, ["--model", m]),
            "server": (server, ["--model", m, "--port", "0", "--log-level", "ERROR"]),
            "train": (train, ["--model", m, "--data", str(DATA), "--iters", "1", "--adapter-path", str(tmp / "t")]),
            "fuse": (fuse, ["--model", m, "--adapter-path", str(adapters), "--save-path", str(tmp / "f")]),
            "convert": (convert, ["--hf-path", m, "--mlx-path", str(tmp / "c")])}


@pytest.mark.parametrize("command", ["generate", "chat", "server", "train", "fuse", "convert"])
def test_every_command_says_each_bad_value_in_one_line(command, bad_model, lora_folder, tmp_path, capsys,
                                                       monkeypatch):
    monkeypatch.setattr("sys.stdin", open("/dev/null"))
    main, argv = commands(bad_model, tmp_path, lora_folder[0])[command]
    code, err = run_main(main, argv, capsys)
    assert code == 1 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error: ")] == [
        "error: config.json: num_hidden_layers must be an integer, got true",
        "error: config.json: rope_theta must be a number over 1 and at most 1e12, got -1"], err
    assert not any((tmp_path / name).exists() for name in ("t", "f", "c"))


# --------------------------------------------------------------------------
# Adapters: exactly the tensors the config describes


def adapter_variant(src: Path, dst: Path, weights=None, **config_changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    for key, value in config_changes.items():
        if key in ("rank", "keys"):
            config["lora_parameters"][key] = value
        else:
            config[key] = value
    (dst / "adapter_config.json").write_text(json.dumps(config))
    if weights is not None:
        (dst / "adapters.safetensors").unlink()
        mx.save_safetensors(str(dst / "adapters.safetensors"), weights)
    return dst


def test_the_intact_folder_loads(lora_folder):
    model, _ = load(DEMO_MODEL, dtype="float32", adapter_path=str(lora_folder[0]))
    assert type(model.layers[-1].self_attn.q_proj).__name__ == "LoRALinear"


def test_adapter_files_that_do_not_match_their_config(lora_folder, tmp_path):
    folder, weights = lora_folder
    first = dict(list(sorted(weights.items()))[:10])
    dora = {**weights, **{k.rsplit(".", 1)[0] + ".m": mx.ones((v.shape[1],)) for k, v in weights.items()
                          if k.endswith(".lora_b")}}
    rank8 = {k: mx.zeros((v.shape[0], 8) if k.endswith("lora_a") else (8, v.shape[1])) for k, v in weights.items()}
    cases = {
        "truncated": (dict(weights=first), r"lacks 18 of the 28 tensors adapter_config.json describes "
                                           r"\(lora, num_layers 2, rank 4\), e\.g\. model\.layers\.\d"),
        "dora_over_lora": (dict(fine_tune_type="dora"), r"says fine_tune_type dora, but the file holds no DoRA "
                                                        r"magnitudes \(m\)"),
        "lora_over_dora": (dict(weights=dora), r"holds DoRA magnitudes \(m\), but adapter_config.json says "
                                               r"fine_tune_type lora"),
        "rank": (dict(weights=rank8), r"the file's rank is 8, lora_parameters.rank says 4"),
        # the same rank, layers of another width: another model's adapters (it blamed the rank, 4 against 4)
        "wider": (dict(weights={k: mx.zeros((v.shape[0] * 2, v.shape[1])) if k.endswith("lora_a") else v
                                for k, v in weights.items()}), r"adapters trained for another model"),
        "fewer_layers": (dict(num_layers=1), r"model\.layers\.2\..* is not among the tensors adapter_config.json "
                                             r"describes \(lora, num_layers 1, rank 4\), nor are 13 more"),
        "more_layers": (dict(num_layers=3), r"lacks 14 of the 42 tensors"),
        "keys": (dict(keys=["self_attn.q_proj"]), r"is not among the tensors .*keys self_attn.q_proj"),
    }
    for name, (changes, message) in cases.items():
        variant = adapter_variant(folder, tmp_path / name, **changes)
        with pytest.raises(LoadError, match=message) as e:
            load(DEMO_MODEL, dtype="float32", adapter_path=str(variant))
        assert "\n" not in str(e.value), name


@pytest.mark.parametrize("command", ["generate", "chat", "server", "fuse"])
def test_a_truncated_adapter_file_is_one_line_on_the_commands(command, lora_folder, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", open("/dev/null"))
    folder, weights = lora_folder
    variant = adapter_variant(folder, tmp_path / "cut", weights=dict(list(sorted(weights.items()))[:10]))
    main, argv = commands(DEMO_MODEL, tmp_path, variant)[command]
    if command != "fuse":
        argv = argv + ["--adapter-path", str(variant)]
    code, err = run_main(main, argv, capsys)
    assert code == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "adapters.safetensors: lacks 18 of the 28 tensors" in err
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])
def test_a_dtype_field_that_names_no_dtype_is_refused_alike_by_a_command_and_by_python(tmp_path, key):
    """transformers reads the field as ``torch.<value>`` only where PyTorch is installed, and a command
    keeps PyTorch out: "auto" loaded from ``generate`` and failed from ``load()`` with "cannot load the
    tokenizer: module 'torch' has no attribute 'auto'". Both say the same line now."""
    import os
    import subprocess
    import sys

    folder = checkpoint(tmp_path / "auto", **{key: "auto"})
    line = f"config.json: {key} is 'auto', which is not a dtype (float16, bfloat16 or float32)"
    with pytest.raises(LoadError) as refused:
        load(folder)
    assert str(refused.value).startswith(line)
    proc = subprocess.run([sys.executable, "-m", "refusion_mlx.generate", "--model", str(folder), "--max-tokens", "4"],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [f"error: {str(refused.value)}"], proc.stderr
    assert load(checkpoint(tmp_path / "f16", **{key: "float16"}))[0] is not None


@pytest.mark.parametrize("key,value", [("torch_dtype", "half"), ("dtype", "float"), ("torch_dtype", "double")])
def test_pytorchs_other_names_of_a_dtype_load_as_transformers_reads_them(tmp_path, key, value):
    """"half", "float" and "double" are torch.float16, float32 and float64 to transformers; they were
    refused as "not a dtype" (and loaded before that check), while "auto" stays refused."""
    import os
    import subprocess
    import sys

    folder = checkpoint(tmp_path / value, **{key: value})
    assert load(folder)[0] is not None
    if value == "half":  # a command too
        proc = subprocess.run([sys.executable, "-m", "refusion_mlx.generate", "--model", str(folder), "-m", "4"],
                              capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr
    assert config_checks.dtype_field_problems({key: "auto"})
