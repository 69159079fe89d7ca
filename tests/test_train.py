"""Fine-tuning: data, the training run, adapters (mlx-lm's format), QLoRA,
fuse, and the command line's errors and Ctrl-C."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from refusion_mlx.errors import RefusionError
from refusion_mlx.models.projections import hf_parameters
from refusion_mlx.models.loading import DEMO_MODEL, load, load_tokenizer
from refusion_mlx.train import Record, fine_tune, fit_length, iterate_batches, load_datasets, read_jsonl
from refusion_mlx.train.__main__ import main as train_main
from refusion_mlx.train.config import flag

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "fixtures" / "train-data"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OPENBLAS_NUM_THREADS": "1"}
QUICK = dict(data=str(DATA), batch_size=4, val_batches=4, steps_per_report=5, progress=False,
             dtype="float32")  # the tests compare float32 logits, whatever paths the run takes
ONE_VAL = {**QUICK, "val_batches": 1}  # for runs whose validation losses no test reads: a quarter of the passes


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEMO_MODEL)


def write(folder: Path, name: str, lines) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def sequence(tokenizer):
    """A training-style sequence: prompt, then response slots out of order with some masked."""
    prompt = tokenizer.encode("<|im_start|>user\nWho is Quillon?<|im_end|>\n<|im_start|>assistant\n")
    answer = tokenizer.encode("Quillon lives in Lima. Quillon works as a baker.")[:16]
    P = len(prompt)
    ids = prompt + answer[8:12] + [805] * 4 + answer[:8] + [805] * 4
    pos = list(range(P)) + list(range(P + 8, P + 12)) + list(range(P + 12, P + 16)) + \
        list(range(P, P + 8)) + list(range(P + 16, P + 20))
    return mx.array([ids]), mx.array([pos])


def logits_of(model, ids, pos):
    out = model(ids, pos)
    mx.eval(out)
    return np.array(out.astype(mx.float32))


# --------------------------------------------------------------------------
# Data


def test_chat_and_completion_formats(tok, tmp_path):
    from refusion_mlx.decode.stream import chat_prompt

    path = write(tmp_path, "train.jsonl", [
        {"messages": [{"role": "user", "content": "Who is Quillon?"},
                      {"role": "assistant", "content": "Quillon lives in Lima."}]},
        "",
        {"prompt": "Who is Quillon?", "completion": "Quillon lives in Lima."},
        {"text": "just text"},
    ])
    a, b, c = read_jsonl(path, tok)
    assert a.prompt == chat_prompt(tok, "Who is Quillon?") == b.prompt
    assert a.response == tok.encode("Quillon lives in Lima.", add_special_tokens=False) + [tok.eos_token_id]
    assert a.response == b.response and a.where.endswith("train.jsonl:1") and b.where.endswith(":3")
    assert c.prompt == [] and c.response[-1] == tok.eos_token_id


def test_multi_turn_earlier_turns_are_prompt(tok, tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who is Odessa?"},
                {"role": "assistant", "content": "Odessa lives in Quito."},
                {"role": "user", "content": "And her pet?"}, {"role": "assistant", "content": "A dog."}]
    (r,) = read_jsonl(write(tmp_path, "train.jsonl", [{"messages": messages}]), tok)
    text = tok.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
    assert r.prompt == tok.encode(text)
    assert "Odessa lives in Quito." in tok.decode(r.prompt) and tok.decode(r.prompt).endswith("assistant\n")
    assert tok.decode(r.response[:-1]) == "A dog."


def test_tool_rows_learn_the_templates_calls(tmp_path):
    """mlx-lm's tool rows: tools reach the template; a last message with tool_calls
    (content null) is learnt as the template renders it, up to the end of its turn
    (the demo's phase-3 tokenizer, whose template renders tools)."""
    from tests.helpers import demo_example_module

    tok = load_tokenizer(demo_example_module("grow_vocab").tool_tokenizer(tmp_path / "tokenizer"))
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}}}}]
    ask = {"role": "user", "content": "What is 6 * 7?"}
    calling = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "6 * 7"}'}}]}
    rows = [{"messages": [ask, calling], "tools": tools},
            {"messages": [ask, calling, {"role": "tool", "tool_call_id": "c1", "content": "42"},
                          {"role": "assistant", "content": "42."}], "tools": tools}]
    call, answer = read_jsonl(write(tmp_path, "train.jsonl", rows), tok)
    assert call.prompt == tok.encode(tok.apply_chat_template([ask], tools=tools, add_generation_prompt=True,
                                                             tokenize=False))
    assert tok.decode(call.response) == '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}' \
                                        '\n</tool_call><|im_end|>'
    assert call.response.count(tok.eos_token_id) == 1
    assert "<tool_response>\n42\n</tool_response>" in tok.decode(answer.prompt)
    assert tok.decode(answer.response) == "42.<|im_end|>"


@pytest.mark.parametrize("line, message", [
    ("{not json", "train.jsonl:2: not valid JSON"),
    ("[1, 2]", "train.jsonl:2: expected a JSON object"),
    ('{"messages": []}', "train.jsonl:2: \"messages\" must be a non-empty list"),
    ('{"messages": [{"role": "user"}]}', "train.jsonl:2: message 1 needs"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null, "tool_calls": 3}]}',
     "train.jsonl:2: message 2: \"tool_calls\" must be"),
    ('{"messages": [{"role": "user", "content": null, "tool_calls": [{"name": "f"}]}, '
     '{"role": "assistant", "content": "x"}]}', "train.jsonl:2: message 1: \"tool_calls\" must be"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "train.jsonl:2: the last message must be the assistant"),
    ('{"prompt": "hi", "completion": 3}', "train.jsonl:2: \"prompt\" and \"completion\" must both be strings"),
    ('{"question": "hi"}', "train.jsonl:2: unknown format"),
    ('{"text": ' + "[" * 100000 + "]" * 100000 + "}", "train.jsonl:2: not valid JSON \\(nested too deeply"),
])
def test_malformed_lines_name_file_and_line(tok, tmp_path, line, message):
    good = '{"prompt": "a", "completion": "b"}'
    path = write(tmp_path, "train.jsonl", [good, line])
    with pytest.raises(RefusionError, match=message) as info:
        read_jsonl(path, tok)
    assert "\n" not in str(info.value)


def test_bad_files(tok, tmp_path):
    (tmp_path / "train.jsonl").write_bytes(b'{"text": "a"}\n{"text": "\xff"}\n')
    with pytest.raises(RefusionError, match="train.jsonl:2: not valid UTF-8"):
        read_jsonl(tmp_path / "train.jsonl", tok)
    write(tmp_path / "empty", "train.jsonl", ["", "  "])
    write(tmp_path / "empty", "valid.jsonl", ['{"text": "a"}'])
    with pytest.raises(RefusionError, match="holds no examples"):
        load_datasets(tmp_path / "empty", tok)
    with pytest.raises(RefusionError, match="has no valid.jsonl"):
        write(tmp_path / "novalid", "train.jsonl", ['{"text": "a"}'])
        load_datasets(tmp_path / "novalid", tok)
    with pytest.raises(RefusionError, match="no such folder"):
        load_datasets(tmp_path / "missing", tok)


def test_lengths_and_batches():
    records = [Record(list(range(5)), list(range(10, 10 + n)), f"f:{n}") for n in (3, 40, 7, 20, 9)]
    assert fit_length(records, 30) == 1 and len(records[1]) == 30
    with pytest.raises(RefusionError, match="f:3: the prompt has 5 tokens"):
        fit_length([Record(list(range(5)), [1], "f:3")], 5)
    rng = np.random.default_rng(0)
    batches = list(iterate_batches(records, 2, 805, rng, 30))
    assert len(batches) == 2  # the fifth record is the remainder, left out as in mlx-lm
    for b in batches:
        assert b["input_ids"].shape[0] == 2 and b["input_ids"].shape[1] in (30, 32)
        assert b["mdm"].dtype == bool and b["mask_prob"].shape == (2,)
    with pytest.raises(RefusionError, match="fewer than the batch size"):
        next(iterate_batches(records, 8, 805, rng))


def passes(by_length: bool, n_passes: int = 3):
    """The batches of ``n_passes`` passes over 16 records, each named by its response length."""
    records = [Record([1, 2], list(range(10, 10 + n))) for n in range(1, 17)]
    it = iterate_batches(records, 4, 805, np.random.default_rng(0), 64, loop=True, by_length=by_length)
    return [[sorted(int(n) for n in next(it)["response_length"]) for _ in range(4)] for _ in range(n_passes)]


def test_batch_order():
    """length (default, mlx-lm's): the same four batches of neighbouring lengths every pass;
    random: every record once per pass, in batches dealt anew that mix lengths."""
    for p in passes(True):
        assert sorted(map(tuple, p)) == [tuple(range(1 + 4 * k, 5 + 4 * k)) for k in range(4)]
    dealt = passes(False)
    for p in dealt:
        assert sorted(n for batch in p for n in batch) == list(range(1, 17))
    assert len({tuple(map(tuple, sorted(p))) for p in dealt}) == 3  # new batches each pass
    assert any(batch[-1] - batch[0] > 3 for p in dealt for batch in p)  # lengths mixed


def test_evaluation_samples_batches_of_every_length(monkeypatch):
    """--val-batches N and --test-batches N visit the length-sorted batches in a random order, as mlx-lm's
    evaluate does (not the N shortest), and every evaluation of a run the same batches."""
    from refusion_mlx.train import trainer

    seen = []

    def loss(model, batch, ar_weight):
        seen.append(tuple(sorted(int(n) for n in np.array(batch["response_length"]))))
        return mx.array(0.0)

    monkeypatch.setattr(trainer, "refusion_loss", loss)
    records = [Record([1, 2], list(range(10, 10 + n))) for n in range(40, 0, -1)]  # longest first
    groups = [tuple(range(1 + 4 * k, 5 + 4 * k)) for k in range(10)]

    def visited(num_batches, seed=0):
        seen.clear()
        trainer.evaluate(nn.Linear(2, 2), records, 4, num_batches, 805, 64, seed)
        return list(seen)

    first = visited(3)
    assert len(first) == 3 and set(first) <= set(groups)
    assert first != groups[:3]  # not the shortest rows alone
    assert visited(3) == first  # fixed: evaluations of a run compare
    assert sorted(visited(-1)) == groups  # all: each batch once
    assert {visited(1, seed)[0] for seed in range(10)} != {groups[0]}


def test_batch_order_option(tmp_path, capsys):
    data = Path(__file__).parent / "fixtures" / "train-data"
    folder = tmp_path / "a"
    code = train_main(["--data", str(data), "--adapter-path", str(folder), "--iters", "2", "--batch-size", "2",
                       "--num-layers", "1", "--val-batches", "1", "--batch-order", "random"])
    assert code == 0 and json.loads((folder / "adapter_config.json").read_text())["batch_order"] == "random"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        train_main(["--data", str(data), "--batch-order", "shuffled"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--batch-order" in err and len(err.strip().splitlines()) == 1


def test_a_run_that_fails_before_a_step_leaves_the_adapter_folder_as_it_was(tmp_path, capsys):
    """adapter_config.json is written with the first weights, not before: a run
    refused by its optimizer settings leaves an existing folder's config (whose
    weights it describes) alone; infinite rates and out-of-range seeds are one line up front."""
    data = Path(__file__).parent / "fixtures" / "train-data"
    folder = tmp_path / "a"
    base = ["--data", str(data), "--adapter-path", str(folder), "--iters", "1", "--batch-size", "2",
            "--num-layers", "1", "--val-batches", "1"]
    assert train_main(base + ["--rank", "8"]) == 0
    config = (folder / "adapter_config.json").read_text()
    (tmp_path / "c.yaml").write_text("lr_schedule: {name: bogus, arguments: [1]}\n")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:  # a usage error, found before the model loads
        train_main(base + ["--rank", "4", "-c", str(tmp_path / "c.yaml")])
    assert exit_.value.code == 2 and "lr_schedule is not valid" in capsys.readouterr().err
    assert (folder / "adapter_config.json").read_text() == config
    for flags in (["--learning-rate", "inf"], ["--seed", "-1"], ["--ar-weight", "nan"]):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            train_main(base + flags)
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and flags[0] in err[0], err
    assert (folder / "adapter_config.json").read_text() == config


# --------------------------------------------------------------------------
# A LoRA run on the demo model


LORA_FITTED: list = []  # lora_run's batches: the rows each fitted the BLAS's threads to


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    from refusion_mlx import _blas

    folder = tmp_path_factory.mktemp("lora") / "adapters"
    lines, fitted = [], LORA_FITTED
    fit_rows = _blas.fit_rows
    with pytest.MonkeyPatch.context() as patch:  # the rows each batch fitted the BLAS's threads to
        patch.setattr(_blas, "fit_rows", lambda rows, split=False: fitted.append(rows) or fit_rows(rows, split))
        model, tokenizer, result = fine_tune(adapter_path=str(folder), iters=30, learning_rate=3e-4,
                                             steps_per_eval=30, save_every=20, report=lines.append, **QUICK)
    return model, tokenizer, result, folder, lines


def test_lora_run_lowers_the_loss(lora_run):
    model, _, result, _, lines = lora_run
    assert result.iterations == 30 and len(result.val_losses) == 2
    assert result.val_losses[-1] < 0.7 * result.val_losses[0]
    assert result.train_losses[-1] < result.train_losses[0]
    assert result.tokens_per_second > 0 and result.peak_memory_gb > 0
    report = [line for line in lines if line.startswith("Iter 10: Train loss")]
    assert report and all(k in report[0] for k in ("Learning Rate", "It/sec", "Tokens/sec", "Trained Tokens",
                                                   "Peak mem"))
    assert any(line.startswith("Iter 30: Val loss") for line in lines)
    layer = model.layers[0].self_attn.q_proj
    assert type(layer).__name__ == "LoRALinear" and not model.training


def test_every_batch_fits_the_blas_threads_to_its_rows(lora_run, monkeypatch):
    """A small model's load leaves one BLAS thread (its narrow decode passes); a training batch's rows are a
    wide product's: each batch, trained or validated, fits the threads to its rows first (on two cores the
    new-family fine-tune took 0.83-0.90x the wall time with both)."""
    from refusion_mlx import _blas
    from refusion_mlx.train import trainer

    fitted = LORA_FITTED
    assert len(fitted) == 30 + 2 * 4  # every step and both validations' 4 batches
    assert all(rows % 32 == 0 and rows >= 4 * 32 for rows in fitted)  # batch size 4, lengths padded to 32
    calls = []
    for name in ("_small_model", "_threads"):  # as they are, restored after the test
        monkeypatch.setattr(_blas, name, getattr(_blas, name))
    monkeypatch.setattr(_blas, "_thread_setter", lambda: calls.append)
    monkeypatch.setattr(_blas, "user_chose_threads", lambda: False)
    monkeypatch.setattr(_blas.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(_blas, "_threads", None)
    assert _blas.fit_threads(256) == 1
    wide = {"input_ids": np.zeros((4, 32), np.int32), "position_ids": np.zeros((4, 32), np.int32)}
    assert set(trainer.to_mx(wide)) == {"input_ids", "position_ids"} and calls == [1, 4]
    trainer.to_mx({"input_ids": np.zeros((1, 32), np.int32)})  # under WIDE_ROWS: one thread, as a decode pass
    assert calls == [1, 4, 1]
    monkeypatch.setattr(_blas, "_small_model", False)  # a bigger model: its count is left as it is
    trainer.to_mx(wide)
    assert calls == [1, 4, 1]


def test_adapters_saved_in_mlx_lm_layout(lora_run):
    _, _, _, folder, _ = lora_run
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "lora" and config["num_layers"] == 4
    assert config["lora_parameters"]["rank"] == 8 and config["lora_parameters"]["scale"] == 20.0
    weights = mx.load(str(folder / "adapters.safetensors"))
    assert len(weights) == 4 * 7 * 2 and all(k.rsplit(".", 1)[1] in ("lora_a", "lora_b") for k in weights)
    assert weights["model.layers.0.self_attn.q_proj.lora_a"].shape == (256, 8)
    assert (folder / "0000020_adapters.safetensors").is_file()
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_adapter_folder_is_written_by_models_adapter_files(tmp_path):
    """models.adapter_files is the one home of writing an adapter folder: the weights (and
    a numbered copy), adapter_config.json (its folder made as needed), and
    what a folder that cannot be made gives; models.adapters reads it."""
    from refusion_mlx.models import adapter_files, adapters
    from tests.helpers import random_config, random_model

    folder = tmp_path / "a" / "b"
    config = {"fine_tune_type": "lora", "num_layers": 1, "lora_parameters": adapters.lora_parameters()}
    assert adapter_files.write_adapter_config(config, folder) == folder / "adapter_config.json"
    weights = {"model.layers.0.self_attn.q_proj.lora_a": mx.ones((4, 2))}
    assert adapter_files.save_adapters(weights, folder, iteration=7) == folder / "adapters.safetensors"
    assert adapter_files.numbered_adapter_file(7) == "0000007_adapters.safetensors"
    assert sorted(p.name for p in folder.iterdir()) == [
        "0000007_adapters.safetensors", "adapter_config.json", "adapters.safetensors"]
    assert adapters.read_adapter_config(folder)["lora_parameters"]["rank"] == 8
    (tmp_path / "file").write_text("")
    with pytest.raises(RefusionError, match="cannot create the adapter folder"):
        adapter_files.make_adapter_folder(tmp_path / "file" / "x")
    (folder / "adapters.safetensors").write_text("not safetensors")
    with pytest.raises(adapters.LoadError, match="adapters.safetensors is not a readable safetensors file"):
        adapters.load_adapters(random_model(random_config()), folder)
    from refusion_mlx.train.run import load_resume

    with pytest.raises(RefusionError, match="--resume-adapter-file .* is not a readable safetensors file"):
        load_resume(None, str(folder / "adapters.safetensors"))


def test_load_with_adapters_gives_the_trained_logits(lora_run, tok):
    model, _, _, folder, _ = lora_run
    loaded, _ = load(DEMO_MODEL, dtype="float32", adapter_path=str(folder))
    ids, pos = sequence(tok)
    np.testing.assert_allclose(logits_of(loaded, ids, pos), logits_of(model, ids, pos), atol=1e-5)
    batch_ids = mx.concatenate([ids, ids[:, ::-1]])
    batch_pos = mx.concatenate([pos, pos])
    np.testing.assert_allclose(logits_of(loaded, batch_ids, batch_pos), logits_of(model, batch_ids, batch_pos),
                               atol=1e-5)
    base, _ = load(DEMO_MODEL, dtype="float32")
    assert np.abs(logits_of(base, ids, pos) - logits_of(model, ids, pos)).max() > 1e-2  # it did train


def test_mlx_lm_loads_the_adapters(lora_run, tok):
    import mlx_lm

    model, _, _, folder, _ = lora_run
    theirs, _ = mlx_lm.load(str(DEMO_MODEL), adapter_path=str(folder))
    theirs.set_dtype(mx.float32)
    ids = mx.array([tok.encode("<|im_start|>user\nWho is Quillon?<|im_end|>\n<|im_start|>assistant\nQuillon")])
    ours = logits_of(model, ids, mx.arange(ids.shape[1])[None])
    np.testing.assert_allclose(np.array(theirs(ids)), ours, atol=2e-2)  # mlx-lm loads the bf16 weights


def test_fuse_cli_output_loads_everywhere(lora_run, tok, tmp_path, capsys):
    """The command's fuse in this process (its output is the subject), then its refusal in a process of
    its own: ``python -m refusion_mlx.fuse``, one line on stderr and exit 1."""
    import mlx_lm

    from refusion_mlx.fuse import main as fuse_main

    model, _, _, folder, _ = lora_run
    out = tmp_path / "fused"
    code = fuse_main(["--adapter-path", str(folder), "--save-path", str(out), "--dtype", "float32"])
    assert code == 0, capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    assert config["mask_token_id"] == 805 and "quantization" not in config
    fused, _ = load(out, dtype="float32")
    ids, pos = sequence(tok)
    np.testing.assert_allclose(logits_of(fused, ids, pos), logits_of(model, ids, pos), atol=1e-4)
    theirs, _ = mlx_lm.load(str(out))
    plain = ids[:, :20]
    np.testing.assert_allclose(np.array(theirs(plain)), logits_of(model, plain, mx.arange(20)[None]), atol=1e-4)
    proc = subprocess.run([sys.executable, "-m", "refusion_mlx.fuse", "--adapter-path", str(folder),
                           "--save-path", str(out)], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "not empty" in proc.stderr


def test_fuse_onto_a_full_disk_is_one_line_and_leaves_nothing(lora_run, tmp_path, capsys, monkeypatch):
    """MLX's writer raises RuntimeError on a full disk: one line naming --save-path, exit 1, no folder or
    staging folder left (it was a traceback)."""
    from refusion_mlx.convert import fusion
    from refusion_mlx.fuse import main as fuse_main

    def full(path, *args, **kwargs):
        raise RuntimeError(f"[write] Unable to write 280952 bytes to file {path}.")

    monkeypatch.setattr(fusion.mx, "save_safetensors", full)
    out = tmp_path / "fused"
    assert fuse_main(["--adapter-path", str(lora_run[3]), "--save-path", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write --save-path {out}: [write] Unable to write 280952 bytes"), err
    assert err.count("\n") == 1 and "it is left as it was" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_generate_and_bench_with_adapters(lora_run, tok, capsys):
    from refusion_mlx.bench.compare import load_models
    from refusion_mlx.generate import main as generate_main

    model, _, _, folder, _ = lora_run
    assert generate_main(["--adapter-path", str(folder), "--prompt", "Who is Quillon?", "--max-tokens", "16",
                          "--block-length", "16", "--json"]) == 0
    assert "output_ids" in json.loads(capsys.readouterr().out)
    ours, _, ar = load_models(None, "float32", True, str(folder))
    ids = mx.array([tok.encode("<|im_start|>user\nHi<|im_end|>\n")])
    np.testing.assert_allclose(np.array(ar(ids)), logits_of(model, ids, mx.arange(ids.shape[1])[None]),
                               atol=1e-4)


def test_prompts_file_decodes_with_the_adapters(lora_run, tmp_path, capsys):
    """generate --prompts-file --adapter-path decodes with the adapters, as a single --prompt does."""
    from refusion_mlx.generate import main as generate_main

    _, _, _, folder, _ = lora_run
    prompts = ["Who is Quillon?", "Count from 3 to 9.", "Spell the word river."]
    common = ["--max-tokens", "32", "--block-length", "16", "--json"]
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n")

    def answers(*extra):
        assert generate_main(["--prompts-file", str(path), *extra, *common]) == 0
        return [json.loads(line)["output_ids"] for line in capsys.readouterr().out.splitlines()]

    adapted, base = answers("--adapter-path", str(folder)), answers()
    alone = []
    for prompt in prompts:
        assert generate_main(["--prompt", prompt, "--adapter-path", str(folder), *common]) == 0
        alone.append(json.loads(capsys.readouterr().out)["output_ids"])
    assert adapted == alone
    assert adapted != base  # the adapters change these answers, so the check has teeth


def test_resume_continues_from_the_saved_adapters(lora_run, tmp_path):
    _, _, first, folder, _ = lora_run
    _, _, result = fine_tune(adapter_path=str(tmp_path / "resumed"), iters=1, learning_rate=3e-4,
                             resume_adapter_file=str(folder / "adapters.safetensors"), report=lambda _: None,
                             **QUICK)
    assert result.val_losses[0] == pytest.approx(first.val_losses[-1], rel=1e-5)


def test_dora_and_full(tmp_path, tok):
    for kind, layers in (("dora", 2), ("full", 1)):
        folder = tmp_path / kind
        model, _, result = fine_tune(adapter_path=str(folder), iters=2, fine_tune_type=kind, num_layers=layers,
                                     report=lambda _: None, **ONE_VAL)
        names = list(mx.load(str(folder / "adapters.safetensors")))
        if kind == "full":
            assert all(n.startswith("model.layers.3.") for n in names) and "model.layers.3.mlp.up_proj.weight" in names
        else:
            assert any(n.endswith(".m") for n in names) and all(".layers.2." in n or ".layers.3." in n for n in names)
        loaded, _ = load(DEMO_MODEL, dtype="float32", adapter_path=str(folder))
        ids, pos = sequence(tok)
        np.testing.assert_allclose(logits_of(loaded, ids, pos), logits_of(model, ids, pos), atol=1e-5)


def test_full_fine_tune_weights_take_the_models_dtype(tmp_path, tok):
    """The trainer saves float32; a bfloat16 load, and a fuse that keeps the
    checkpoint's dtype, must hold bfloat16 weights, not float32 behind a
    bfloat16 config."""
    from refusion_mlx.convert.fusion import fuse

    folder = tmp_path / "full"
    fine_tune(adapter_path=str(folder), iters=1, fine_tune_type="full", num_layers=1, train_embeddings=True,
              report=lambda _: None, **ONE_VAL)
    saved = mx.load(str(folder / "adapters.safetensors"))
    assert saved["model.layers.3.mlp.up_proj.weight"].dtype == mx.float32
    model, _ = load(DEMO_MODEL, dtype="bfloat16", adapter_path=str(folder))
    params = hf_parameters(model)  # checkpoint names (loading joins some projections)
    assert {params[name].dtype for name in saved} == {mx.bfloat16}
    np.testing.assert_array_equal(np.array(params["lm_head.weight"].astype(mx.float32)),
                                  np.array(saved["lm_head.weight"].astype(mx.bfloat16).astype(mx.float32)))
    out = fuse(None, folder, tmp_path / "fused")  # the demo is stored in bfloat16
    written = mx.load(str(out / "model.safetensors"))
    assert {w.dtype for w in written.values()} == {mx.bfloat16}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_replay_mixes_the_known_tasks_in(tmp_path, tok):
    from refusion_mlx.train import with_replay
    from refusion_mlx.train.dataset import replay_records

    new = [Record([1], [2, 801], "new")] * 10
    old = replay_records(DATA, tok)
    mixed = with_replay(new, old, 1.5, seed=0)
    assert len(mixed) == 25 and mixed[:10] == new
    assert len({id(r) for r in mixed[10:]}) == 15  # drawn without repeats while the pool lasts
    assert with_replay(new, old, 1.5, seed=0) == mixed  # reproducible
    assert len(with_replay(new, old[:3], 2.0, seed=0)) == 30  # a small pool repeats
    for ratio in (float("inf"), float("nan"), 1e300, 101.0):  # an OverflowError, a ValueError, 298 GiB
        with pytest.raises(RefusionError, match="--replay-ratio must be between 0 and 100"):
            with_replay(new, old, ratio, seed=0)
    lines = []
    fine_tune(adapter_path=str(tmp_path / "r"), iters=1, replay_data=str(DATA / "train.jsonl"), replay_ratio=0.5,
              report=lines.append, **ONE_VAL)
    assert any(line.startswith("Replaying") for line in lines)
    with pytest.raises(RefusionError, match="--replay-data .*no such file"):
        fine_tune(adapter_path=str(tmp_path / "r2"), iters=1, replay_data=str(tmp_path / "none"),
                  report=lambda _: None, **QUICK)


def test_train_embeddings_saves_loads_and_fuses(tmp_path, tok):
    folder = tmp_path / "emb"
    base, _ = load(DEMO_MODEL, dtype="float32")
    model, _, _ = fine_tune(adapter_path=str(folder), iters=3, learning_rate=1e-3, train_embeddings=True,
                            report=lambda _: None, **ONE_VAL)
    weights = mx.load(str(folder / "adapters.safetensors"))
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= set(weights)
    assert json.loads((folder / "adapter_config.json").read_text())["train_embeddings"] is True
    moved = np.abs(np.array(weights["lm_head.weight"]) - np.array(base.lm_head.weight)).max()
    assert moved > 1e-4  # the head trained, not only the LoRA layers
    loaded, _ = load(DEMO_MODEL, dtype="float32", adapter_path=str(folder))
    ids, pos = sequence(tok)
    np.testing.assert_allclose(logits_of(loaded, ids, pos), logits_of(model, ids, pos), atol=1e-5)
    from refusion_mlx.convert.fusion import fuse

    fused, _ = load(fuse(None, folder, tmp_path / "fused", dtype="float32"), dtype="float32")
    np.testing.assert_allclose(logits_of(fused, ids, pos), logits_of(model, ids, pos), atol=1e-4)
    # a LoRA folder that holds a head without saying train_embeddings is refused, in one line
    config = json.loads((folder / "adapter_config.json").read_text())
    config["train_embeddings"] = False
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(RefusionError, match=r"holds lm_head.weight .*not say train_embeddings") as e:
        load(DEMO_MODEL, dtype="float32", adapter_path=str(folder))
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------
# QLoRA


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    from refusion_mlx.convert.converter import convert

    out = tmp_path_factory.mktemp("q") / "demo-4bit"
    convert(DEMO_MODEL, out, quantize=True, q_bits=4, progress=False)
    return out


def test_qlora_keeps_the_base_quantized_and_trains(q4, tmp_path, tok):
    from refusion_mlx.convert.fusion import fuse

    folder = tmp_path / "qlora"
    options = {**QUICK, "val_batches": 2}  # quantized matmuls are slow on the CPU: a short run
    model, _, result = fine_tune(model=str(q4), adapter_path=str(folder), iters=6, learning_rate=3e-4,
                                 steps_per_eval=6, report=lambda _: None, **options)
    q_proj = model.layers[0].self_attn.q_proj
    assert type(q_proj).__name__ == "LoRALinear" and isinstance(q_proj.linear, nn.QuantizedLinear)
    assert isinstance(model.lm_head, nn.QuantizedLinear) and q_proj.linear.bits == 4
    assert not any(k.endswith((".weight", ".scales")) for k, _ in tree_flatten(model.trainable_parameters()))
    assert result.val_losses[-1] < result.val_losses[0]
    ids, pos = sequence(tok)
    loaded, _ = load(q4, dtype="float32", adapter_path=str(folder))
    np.testing.assert_allclose(logits_of(loaded, ids, pos), logits_of(model, ids, pos), atol=1e-5)
    # fused: dequantized float32 matches the adapter model; re-quantized keeps the quantization block
    fuse(str(q4), folder, tmp_path / "deq", dequantize_weights=True, dtype="float32")
    assert "quantization" not in json.loads((tmp_path / "deq" / "config.json").read_text())
    deq, _ = load(tmp_path / "deq", dtype="float32")
    np.testing.assert_allclose(logits_of(deq, ids, pos), logits_of(model, ids, pos), atol=1e-3)
    fuse(str(q4), folder, tmp_path / "q", dequantize_weights=False)
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization"]["bits"] == 4
    requant, _ = load(tmp_path / "q", dtype="float32", join_projections=False)
    assert isinstance(requant.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    agree = (logits_of(requant, ids, pos).argmax(-1) == logits_of(model, ids, pos).argmax(-1)).mean()
    assert agree > 0.8
    with pytest.raises(RefusionError, match="unquantized embedding"):  # a quantized head cannot train
        fine_tune(model=str(q4), adapter_path=str(tmp_path / "qe"), iters=1, train_embeddings=True,
                  report=lambda _: None, **options)


def test_fuse_dequantize_counts_every_quantized_layer(q4, tmp_path, capsys):
    """--dequantize's line counts every layer it made plain: the adapted ones, dequantized while fusing,
    too (it said 2, the embedding and the head, of the 4-bit demo's 30)."""
    from refusion_mlx.fuse import main as fuse_main

    def scales(folder):
        return sum(k.endswith(".scales") for f in folder.glob("*.safetensors") for k in mx.load(str(f)))

    folder = tmp_path / "qlora"
    fine_tune(model=str(q4), adapter_path=str(folder), iters=1, report=lambda _: None,
              **{**QUICK, "batch_size": 1, "val_batches": 1})
    assert scales(q4) == 30
    assert fuse_main(["--model", str(q4), "--adapter-path", str(folder), "--save-path", str(tmp_path / "d"),
                      "--dequantize"]) == 0
    assert "[INFO] dequantized 30 layers\n" in capsys.readouterr().err and scales(tmp_path / "d") == 0


@pytest.mark.parametrize("mode, group", [("nvfp4", 16), ("mxfp8", 32), ("affine", 64)])
def test_fusing_into_any_quantized_base_gives_float_weights(mode, group):
    """mxfp4, nvfp4 and mxfp8 keep their scales as uint8: the fused layer is cast to a floating dtype (the
    model's), never to its scales' (the weights came out as uint8 garbage, and so did a layer's bias)."""
    from refusion_mlx.models.adapters import add_adapters, fuse_adapters
    from tests.helpers import random_config, random_model

    model = random_model(random_config(attention_bias=True, tie=False), seed=2)
    nn.quantize(model, group_size=group, bits=8 if mode == "mxfp8" else 4, mode=mode,
                class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % group == 0)
    add_adapters(model, "lora", -1, {"rank": 4, "scale": 10.0, "dropout": 0.0,
                                     "keys": ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"]})
    for _, m in model.named_modules():
        if hasattr(m, "lora_b"):
            m.lora_b = mx.random.normal(m.lora_b.shape, key=mx.random.key(3)) * 0.05
    ids, pos = mx.array([[5, 9, 805, 805, 7, 3]]), mx.array([[0, 1, 4, 5, 2, 3]])
    want = logits_of(model, ids, pos)
    lora = model.layers[0].self_attn.q_proj  # the sum in float32: the fp modes' dequantize gave bfloat16
    base = lora.linear
    exact = mx.dequantize(base.weight, base.scales, base.get("biases"), group_size=group, bits=base.bits,
                          mode=mode, dtype=mx.float32) + (lora.scale * lora.lora_b.T) @ lora.lora_a.T
    assert fuse_adapters(model, dequantize=True) == 6
    q_proj = model.layers[0].self_attn.q_proj
    assert q_proj.weight.dtype == mx.float32 and q_proj.bias.dtype == mx.float32
    np.testing.assert_allclose(np.array(q_proj.weight), np.array(exact), rtol=0, atol=1e-6)
    from refusion_mlx.convert.fusion import dequantize  # --dequantize's other layers: float32 too

    k_proj = model.layers[0].self_attn.k_proj
    plain = mx.dequantize(k_proj.weight, k_proj.scales, k_proj.get("biases"), group_size=group, bits=k_proj.bits,
                          mode=mode, dtype=mx.float32)
    assert dequantize(model) > 0 and np.array_equal(np.array(model.layers[0].self_attn.k_proj.weight),
                                                    np.array(plain))
    # the fp modes' kernels round their products apart from a float matmul of the dequantized weights
    np.testing.assert_allclose(logits_of(model, ids, pos), want, atol=1e-3 if mode == "affine" else 0.1)


def test_dequantizing_matmuls_compute_the_same_products():
    from refusion_mlx.train.trainer import dequantizing_matmuls
    from tests.helpers import random_config, random_model

    model = random_model(random_config(tie=True), seed=1)
    nn.quantize(model, group_size=64, bits=4)
    ids = mx.array([[5, 9, 805, 805, 7, 3]])
    pos = mx.array([[0, 1, 4, 5, 2, 3]])
    kernel = logits_of(model, ids, pos)
    undo = dequantizing_matmuls(model, "dequantize")
    assert type(model.model.embed_tokens).__name__ == "_DequantizingEmbedding"
    np.testing.assert_allclose(logits_of(model, ids, pos), kernel, atol=1e-4)
    undo()
    assert type(model.model.embed_tokens) is nn.QuantizedEmbedding
    assert type(model.layers[0].mlp.down_proj) is nn.QuantizedLinear
    assert dequantizing_matmuls(model, "kernel")() is None  # nothing swapped


# --------------------------------------------------------------------------
# The command line


def cli(argv, capsys):
    try:
        code = train_main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return code, err


def test_yaml_config_and_flags(tmp_path, capsys):
    config = tmp_path / "train.yaml"
    config.write_text("iters: 5\nlearning_rate: 2e-4\nbatch_size: 4\nval_batches: 1\nsteps_per_eval: 100\n"
                      "lora_parameters:\n  rank: 4\n  scale: 10.0\ntrain: true\n")
    folder = tmp_path / "a"
    code = train_main(["--config", str(config), "--data", str(DATA), "--adapter-path", str(folder),
                       "--iters", "2", "--num-layers", "2", "--test"])
    out = capsys.readouterr().out
    assert code == 0 and "Iter 2: Train loss" in out and "Test loss" in out
    saved = json.loads((folder / "adapter_config.json").read_text())
    assert saved["iters"] == 2 and saved["learning_rate"] == 2e-4 and saved["num_layers"] == 2
    assert saved["lora_parameters"]["rank"] == 4 and saved["lora_parameters"]["scale"] == 10.0
    assert saved["objective"]["slot_sizes"] == [4, 8, 16, 32]  # the paper's, unless asked


def test_a_config_written_from_mlx_lms_defaults_is_read(tmp_path):
    """mlx-lm's CONFIG_DEFAULTS as a YAML file: its options this trainer has no use for (report_to: null,
    clear_cache_threshold: 0, trust_remote_code: false ...) are accepted at those values (they were unknown)."""
    import yaml
    from mlx_lm.lora import CONFIG_DEFAULTS

    from refusion_mlx.train.config import MLX_LM_OFF, merge

    assert set(MLX_LM_OFF) <= set(CONFIG_DEFAULTS)
    config = tmp_path / "mlx-lm.yaml"
    config.write_text(yaml.safe_dump(CONFIG_DEFAULTS))
    o = merge({"data": str(DATA)}, str(config))
    assert o["learning_rate"] == 1e-5 and o["batch_size"] == 4 and o["train"] is False
    assert not set(MLX_LM_OFF) & set(o)  # accepted, not options of this trainer


def test_slot_sizes_reach_every_example(tmp_path, capsys, monkeypatch):
    """--slot-sizes (flag or YAML list) is the size every training example draws from, and is recorded."""
    import refusion_mlx.train.batches as batches

    drawn = []
    real = batches.build_example

    def spy(*args, **kwargs):
        example = real(*args, **kwargs)
        drawn.append(example.slot_size)
        return example

    monkeypatch.setattr(batches, "build_example", spy)
    config = tmp_path / "c.yaml"
    config.write_text("slot_sizes: [2, 1]\n")
    for argv, sizes in ((["--slot-sizes", "1,2"], {1, 2}), (["--config", str(config)], {1, 2}), ([], {4, 8, 16, 32})):
        drawn.clear()
        folder = tmp_path / f"a{len(argv)}"
        code = train_main(["--data", str(DATA), "--adapter-path", str(folder), "--iters", "4", "--batch-size", "4",
                           "--num-layers", "1", "--val-batches", "1", *argv])
        assert code == 0, capsys.readouterr().err
        assert set(drawn) <= sizes and len(drawn) >= 16
        saved = json.loads((folder / "adapter_config.json").read_text())
        assert set(saved["objective"]["slot_sizes"]) == sizes
    assert set(drawn) != {4}  # the default draws all four sizes over 20 examples (seed 0)


@pytest.mark.parametrize("argv, message", [
    ([], "--data is required"),
    (["--data", str(DATA), "--rank", "0"], "--rank must be at least 1"),
    (["--data", str(DATA), "--batch-size", "0"], "--batch-size must be at least 1"),
    (["--data", str(DATA), "--learning-rate", "-1"], "--learning-rate must be positive"),
    (["--data", str(DATA), "--fine-tune-type", "qlora"], "invalid choice"),
    (["--data", str(DATA), "--iters", "ten"], "invalid int value"),
    (["--data", str(DATA), "--num-layers", "0"], "--num-layers must be -1"),
    (["--data", str(DATA), "--config", "/nonexistent.yaml"], "no such file"),
    (["--data", str(DATA), "--replay-ratio", "-0.5"], "--replay-ratio must be between 0 and 100"),
    (["--data", str(DATA), "--replay-ratio", "inf"], "--replay-ratio must be between 0 and 100"),
    (["--data", str(DATA), "--replay-ratio", "nan"], "--replay-ratio must be between 0 and 100"),
    (["--data", str(DATA), "--replay-ratio", "1e9"], "--replay-ratio must be between 0 and 100"),
    (["--data", str(DATA), "--slot-sizes", "4,0"], "slot_sizes must be positive integers"),
    (["--data", str(DATA), "--slot-sizes", "four"], "slot_sizes must be positive integers"),
    (["--data", str(DATA), "--adapter-path", ""], "--adapter-path must name a folder, not an empty string"),
    (["--data", str(DATA), "--resume-adapter-file", " "], "--resume-adapter-file must name a file"),
])
def test_usage_errors(argv, message, capsys):
    code, err = cli(argv, capsys)
    assert code == 2 and message in err


@pytest.mark.parametrize("text, message", [
    ("iterations: 5\n", "unknown option 'iterations'"),
    ("iters: ten\n", "iters must be int"),
    ("lora_parameters:\n  alpha: 3\n", "unknown key 'alpha'"),
    # a string was read a letter a key ("unknown: s, e, l, f, ...")
    ("lora_parameters: {keys: self_attn.q_proj}\n",
     "lora_parameters.keys must be a list of module names such as [self_attn.q_proj], got 'self_attn.q_proj'"),
    ("iters: [\n", "not valid YAML"),
    ("slot_sizes: [4, 2.5]\n", "slot_sizes must be positive integers"),
    ("slot_sizes: {a: 1}\n", "slot_sizes must be"),
    ("report_to: wandb\n", "report_to: 'wandb' is refused: reporting to wandb or swanlab is not supported here"),
    ("project_name: runs\n", "project_name: 'runs' is refused"),
    ("clear_cache_threshold: 2\n", "clear_cache_threshold: 2 is refused"),
    ("trust_remote_code: true\n", "trust_remote_code: true is refused: a ReFusion model needs no code"),
    ("trust_remote_code: 0\n", "trust_remote_code: 0 is refused"),
    ("config: other.yaml\n", "config: 'other.yaml' is refused: a config file cannot name another"),
])
def test_yaml_errors(text, message, tmp_path, capsys):
    (tmp_path / "c.yaml").write_text(text)
    code, err = cli(["--data", str(DATA), "--config", str(tmp_path / "c.yaml")], capsys)
    assert code == 2 and message in err


@pytest.mark.parametrize("block, message", [
    ("{rank: -1}", "lora_parameters.rank must be a positive integer, got -1"),
    ("{scale: x}", "lora_parameters.scale must be a finite number, got 'x'"),
    ("{dropout: 2}", "lora_parameters.dropout must be in [0, 1), got 2"),
    ("{keys: [q_proj]}", "lora_parameters.keys must be a non-empty subset of self_attn.q_proj"),
    ("{alpha: 3}", "lora_parameters: unknown key 'alpha' (rank, scale, dropout, keys)"),
])
def test_yaml_lora_parameters_errors_name_the_file_and_key(block, message, tmp_path, capsys):
    """A bad value in the YAML's lora_parameters is named as the file's other keys are: the file, then
    the key (a bad rank said --rank, a flag never typed; the others named neither file nor key)."""
    config = tmp_path / "c.yaml"
    config.write_text(f"lora_parameters: {block}\n")
    code, err = cli(["--data", str(DATA), "--config", str(config)], capsys)
    assert code == 2 and f"error: --config {config}: {message}" in err and "--rank" not in err, err
    with pytest.raises(RefusionError, match=r"^fine_tune: lora_parameters\.dropout must be in"):  # the API's
        fine_tune(data=str(DATA), lora_parameters={"dropout": 2})


@pytest.mark.parametrize("text, message", [
    ("batch_size: 0", "batch_size must be at least 1, got 0"),  # each minimum
    ("iters: -3", "iters must be at least 0, got -3"),
    ("max_seq_length: 1", "max_seq_length must be at least 2, got 1"),
    ("rank: 0", "rank must be at least 1, got 0"),
    ("max_seq_length: 4\ndraft_run: 5", "draft_run must be at most max_seq_length (4), got 5"),
    ("val_batches: -2", "val_batches must be -1 (all) or at least 0, got -2"),
    ("test: true\ntest_batches: 0", "test_batches 0 tests nothing"),
    ("slot_sizes: '4,x'", "slot_sizes must be positive integers"),
    ("learning_rate: 0", "learning_rate must be positive and finite, got 0.0"),  # each number's range
    ("draft_fraction: 2", "draft_fraction must be between 0 and 1, got 2.0"),
    ("ar_weight: -1", "ar_weight must be positive and finite, got -1.0"),
    ("replay_ratio: 1000", "replay_ratio must be between 0 and 100"),
    ("seed: -1", "seed must be within [0, 2**32), got -1"),
    ("num_layers: 0", "num_layers must be -1 (all) or at least 1, got 0"),
    ("adapter_path: ' '", "adapter_path must name a folder, not an empty string"),
    ("data: org/name", "data org/name: no such folder; Hugging Face datasets are not read here"),
])
def test_yaml_range_errors_name_the_file_and_key(text, message, tmp_path, capsys):
    """A YAML value of the right type out of range is named by the file and its key, as a value of the wrong
    type is (it said --batch-size, a flag never typed); the same value as a flag keeps the flag's name."""
    config = tmp_path / "c.yaml"
    config.write_text(text + "\n")
    argv = ["--config", str(config)] + ([] if text.startswith("data:") else ["--data", str(DATA)])
    code, err = cli(argv, capsys)
    assert code == 2 and f"error: --config {config}: {message}" in err and err.count(" --") == 1, err
    key, value = text.splitlines()[-1].split(": ")
    code, err = cli(argv + [flag(key), value.strip("'")], capsys)  # the flag wins, and is named
    assert code == 2 and f"error: {flag(key)}" in err and str(config) not in err, err


def test_yaml_input_errors_name_the_file_and_key(tmp_path, capsys):
    """The run's own checks of a value the YAML gave (a folder, a file, a count against the data) name the
    file and the key too."""
    (tmp_path / "file").write_text("x")
    config = tmp_path / "c.yaml"
    for text, message in [
        (f"data: {tmp_path / 'missing'}", f"data {tmp_path / 'missing'}: no such folder"),
        ("iters: 0", "iters 0 trains nothing"),
        (f"adapter_path: {tmp_path / 'file'}", f"adapter_path {tmp_path / 'file'} is a file"),
        (f"resume_adapter_file: {tmp_path / 'nope'}", f"resume_adapter_file {tmp_path / 'nope'}: no such file"),
    ]:
        config.write_text(text + "\n")
        argv = ["--config", str(config)] + ([] if text.startswith("data:") else ["--data", str(DATA)])
        code, err = cli(argv + ["--adapter-path", str(tmp_path / "out")] * (not text.startswith("adapter"))
                        + ["--iters", "1"] * (not text.startswith("iters")), capsys)
        assert code == 1 and f"error: --config {config}: {message}" in err, (text, err)
    config.write_text("batch_size: 64\n")  # named within the sentence: the key alone
    code, err = cli(["--config", str(config), "--data", str(DATA), "--adapter-path", str(tmp_path / "out"),
                     "--iters", "1", "--num-layers", "1"], capsys)
    assert code == 1 and "train.jsonl has 40 examples, fewer than batch_size 64" in err, err


def test_input_errors(tmp_path, q4, capsys):
    bad = tmp_path / "bad"
    write(bad, "train.jsonl", ['{"prompt": "a", "completion": "b"}', '{"prompt": "a"'])
    write(bad, "valid.jsonl", ['{"prompt": "a", "completion": "b"}'])
    empty = tmp_path / "empty"
    write(empty, "train.jsonl", [""])
    write(empty, "valid.jsonl", ['{"prompt": "a", "completion": "b"}'])
    (tmp_path / "file").write_text("x")
    base = ["--data", str(DATA), "--adapter-path", str(tmp_path / "out"), "--iters", "1"]
    cases = [
        (["--data", str(tmp_path / "missing")], "no such folder"),
        (["--data", str(bad)], "train.jsonl:2: not valid JSON"),
        (["--data", str(empty)], "train.jsonl holds no examples"),
        (base + ["--num-layers", "99"], "--num-layers 99 is more than the model's 4 layers"),
        (base + ["--max-seq-length", "10"], "the prompt has"),
        (base + ["--batch-size", "64"], "train.jsonl has 40 examples, fewer than --batch-size 64"),
        (base + ["--model", str(q4), "--fine-tune-type", "full"], "full fine-tuning needs an unquantized model"),
        (base + ["--resume-adapter-file", str(tmp_path / "nope.safetensors")], "no such file"),
        (base + ["--adapter-path", str(tmp_path / "file")], "is a file"),
        (base + ["--iters", "0"], "--iters 0 trains nothing"),
        (base + ["--rank", "100000"], "--rank 100000 is over the smallest side of a layer it adapts (128)"),
        (base + ["--model", str(tmp_path / "nomodel")], "no model folder"),
    ]
    for argv, message in cases:
        code, err = cli(argv, capsys)
        assert code == 1 and message in err and err.startswith("error: "), (argv, err)


def test_resume_with_another_rank_is_refused(lora_run, tmp_path, capsys):
    folder = lora_run[3]
    code, err = cli(["--data", str(DATA), "--adapter-path", str(tmp_path / "r"), "--iters", "1", "--rank", "4",
                     "--resume-adapter-file", str(folder / "adapters.safetensors")], capsys)
    assert code == 1 and "another --rank?" in err


def test_cli_error_in_a_real_process():
    proc = subprocess.run([sys.executable, "-m", "refusion_mlx.train", "--data", "/nonexistent"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "error: --data /nonexistent: no such folder"]


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_and_sigterm_save_the_last_adapters(tmp_path, tok, sig, code):
    folder = tmp_path / "adapters"
    proc = subprocess.Popen([sys.executable, "-m", "refusion_mlx.train", "--data", str(DATA), "--adapter-path",
                             str(folder), "--iters", "100000", "--steps-per-report", "1", "--val-batches", "0",
                             "--save-every", "100000"],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # a shell's background job (`pytest &`) ignores SIGINT, and a child
                            # inherits that; the trainer must be tested as a terminal runs it
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stdout:
            if line.startswith("Iter 3: Train loss"):
                break
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert "saved the adapters of the last completed step" in err and "Traceback" not in err
    model, _ = load(DEMO_MODEL, dtype="float32", adapter_path=str(folder))
    assert type(model.layers[0].self_attn.q_proj).__name__ == "LoRALinear"


def test_a_rows_content_may_be_a_list_of_text_parts_as_in_openais_chat_format(tok):
    """``[{"type": "text", "text": ...}]`` content (OpenAI's, which chat_prompt and the server take) was
    refused: 'message 1 needs a string "role" and a string "content"'."""
    from refusion_mlx.train.dataset import encode_line

    plain = {"messages": [{"role": "user", "content": "Who is Sven?"}, {"role": "assistant", "content": "A baker."}]}
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Who is "},
                                                       {"type": "text", "text": "Sven?"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "A baker."}]}]}
    a, b = encode_line(plain, tok, "row"), encode_line(parts, tok, "row")
    assert (a.prompt, a.response) == (b.prompt, b.response)
    bad = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}, plain["messages"][1]]}
    with pytest.raises(RefusionError, match=r"^row: a message's content must be text, or a list of text parts"):
        encode_line(bad, tok, "row")
