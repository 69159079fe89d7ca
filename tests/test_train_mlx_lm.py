"""An mlx-lm LoRA user's commands and habits against ``refusion_mlx.train``:
``--train`` is not ``--train-embeddings``, ``--test`` without ``--train``
tests the saved adapters (and trains nothing over them), a data folder
without valid.jsonl trains, a split the run does not use is never read,
mlx-lm's other flags (``--mask-prompt``, ``--grad-accumulation-steps``, its
optimizers) run, a schedule's rate is checked, a Ctrl-C before the first step or a failed save leaves the
adapter folder as it was, every bad row names its line, and ``fine_tune``
takes Paths and refuses a misspelt option."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlx.core as mx
import pytest

from refusion_mlx.errors import RefusionError
from refusion_mlx.models.loading import DEMO_MODEL
from refusion_mlx.train import fine_tune
from refusion_mlx.train.__main__ import main as train_main

DATA = Path(__file__).parent / "fixtures" / "train-data"
DEMO = DEMO_MODEL


def run(argv, capsys):
    try:
        code = train_main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def digest(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mlx-lm") / "adapters"
    fine_tune(data=DATA, adapter_path=folder, iters=3, val_batches=1, batch_size=4, report=None, progress=False)
    return folder


def test_train_is_mlx_lms_flag_and_test_alone_tests_the_saved_adapters(trained, tmp_path, capsys):
    folder = tmp_path / "a"
    code, out, _ = run(["--data", DATA, "--adapter-path", folder, "--iters", "2", "--train", "--mask-prompt",
                        "--val-batches", "1"], capsys)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert code == 0 and config["train_embeddings"] is False and config["train"] is True  # was --train-embeddings
    before = digest(trained)
    code, out, _ = run(["--data", DATA, "--adapter-path", trained, "--test", "--test-batches", "2"], capsys)
    assert code == 0 and f"Testing the adapters in {trained}" in out and "Training" not in out
    assert digest(trained) == before  # it trained 1000 steps over them before
    share = next(line for line in out.splitlines() if line.startswith("Trainable parameters"))
    adapters = sum(v.size for v in mx.load(str(trained / "adapters.safetensors")).values())
    assert f"({adapters / 1e6:.3f}M/" in share and float(share.split()[2].rstrip("%")) < 100  # it said 104.364%
    tested = [line for line in out.splitlines() if line.startswith("Test loss")]
    code, base, _ = run(["--data", DATA, "--adapter-path", tmp_path / "none", "--test", "--test-batches", "2"],
                        capsys)
    assert code == 0 and "Testing the base model" in base
    assert tested and "Test ppl" in tested[0] and tested[0] not in base  # the adapters, not the base


def test_no_valid_jsonl_trains_without_validation(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_bytes((DATA / "train.jsonl").read_bytes())
    code, out, _ = run(["--data", data, "--adapter-path", tmp_path / "a", "--iters", "1"], capsys)
    assert code == 0 and "has no valid.jsonl: training without validation" in out
    assert (tmp_path / "a" / "adapters.safetensors").is_file()


def test_a_split_the_run_does_not_use_is_never_read(tmp_path, capsys):
    """Only the splits a run uses are read: a bad test.jsonl does not stop training without --test, an
    empty valid.jsonl does not stop --val-batches 0, a bad train.jsonl does not stop a test-only run
    (each stopped the run before it started)."""
    data = tmp_path / "d"
    data.mkdir()
    for name in ("train", "valid", "test"):
        (data / f"{name}.jsonl").write_bytes((DATA / f"{name}.jsonl").read_bytes())
    with open(data / "test.jsonl", "a") as f:
        f.write(json.dumps({"prompt": "word " * 3000, "completion": "a"}) + "\n")
    code, out, err = run(["--data", data, "--adapter-path", tmp_path / "a", "--iters", "1", "--val-batches", "1"],
                         capsys)
    assert code == 0 and "Iter 1:" in out, err
    code, _, err = run(["--data", data, "--adapter-path", tmp_path / "b", "--iters", "1", "--test"], capsys)
    assert code == 1 and "test.jsonl:9: the prompt has" in err  # read when used
    (data / "test.jsonl").write_bytes((DATA / "test.jsonl").read_bytes())
    (data / "valid.jsonl").write_text("\n")
    code, out, err = run(["--data", data, "--adapter-path", tmp_path / "c", "--iters", "1", "--val-batches", "0"],
                         capsys)
    assert code == 0 and "Iter 1:" in out, err
    (data / "train.jsonl").write_text('{"prompt": "a"\n')
    code, out, err = run(["--data", data, "--adapter-path", tmp_path / "c", "--iters", "0", "--test",
                          "--test-batches", "1"], capsys)
    assert code == 0 and "Test loss" in out, err


@pytest.mark.parametrize("extra", [["--grad-accumulation-steps", "2"], ["--optimizer", "sgd"],
                                   ["--optimizer", "adafactor"]])
def test_mlx_lms_other_flags_train(extra, tmp_path, capsys):
    code, out, err = run(["--data", DATA, "--adapter-path", tmp_path / "a", "--iters", "2", "--val-batches", "0",
                          "--steps-per-report", "1", *extra], capsys)
    assert code == 0, err
    assert [line for line in out.splitlines() if line.startswith("Iter 2: Train loss")]


def test_grad_accumulation_updates_once_per_group(tmp_path):
    from mlx.utils import tree_flatten

    runs = {}
    for steps, iters in ((1, 1), (2, 1), (2, 2)):  # (accumulation, iters): an update at the last step always
        model, _, result = fine_tune(data=DATA, adapter_path=tmp_path / f"{steps}-{iters}", iters=iters,
                                     grad_accumulation_steps=steps, val_batches=0, report=None, progress=False,
                                     learning_rate=1e-3)
        runs[steps, iters] = {k: v.tolist() for k, v in tree_flatten(model.trainable_parameters())}
    assert runs[1, 1] == runs[2, 1]  # one step, updated at the end of the run either way
    assert runs[2, 2] != runs[1, 1]  # two steps' gradients, averaged into one update


def test_a_schedule_that_goes_negative_is_refused(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("lr_schedule:\n  name: cosine_decay\n  arguments: [-1, 4]\n")
    code, _, err = run(["--data", DATA, "--adapter-path", tmp_path / "a", "--iters", "4", "-c", tmp_path / "c.yaml"],
                       capsys)
    assert code == 2 and "lr_schedule gives a learning rate of -1 at step 0" in err  # a usage error
    assert "Loading pretrained model" not in err + _ and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "a").exists()


def test_the_library_refuses_a_bad_schedule_before_loading(tmp_path, monkeypatch):
    from refusion_mlx.train import run as train_run

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(train_run, "load", no_load)
    with pytest.raises(RefusionError, match="optimizer_config.adam"):
        train_run.fine_tune(data=DATA, adapter_path=tmp_path / "a", iters=2, report=None, progress=False,
                            optimizer_config={"adam": {"nonsense": 1}})


def test_adapters_never_go_into_a_model_folder(tmp_path, capsys):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(DEMO, model)
    before = digest(model)
    code, _, err = run(["--data", DATA, "--model", model, "--adapter-path", model, "--iters", "1"], capsys)
    assert code == 1 and "is a model folder" in err and len(err.strip().splitlines()) == 1
    assert digest(model) == before


def test_a_run_that_fails_before_its_first_save_leaves_no_folder(tmp_path, capsys, monkeypatch):
    from refusion_mlx.train import trainer

    def fail(*a, **k):
        raise RefusionError("the first step failed")

    monkeypatch.setattr(trainer, "iterate_batches", fail)
    code, _, err = run(["--data", DATA, "--adapter-path", tmp_path / "new" / "a", "--iters", "2"], capsys)
    assert code == 1 and "the first step failed" in err
    assert not (tmp_path / "new").exists()


def test_nothing_saved_over_adapters_before_the_first_step_or_by_a_failed_save(trained, tmp_path, monkeypatch):
    import shutil

    from refusion_mlx.train import trainer

    folder = tmp_path / "kept"
    shutil.copytree(trained, folder)
    before = digest(folder)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "evaluate", interrupted)  # Ctrl-C in the first validation
    with pytest.raises(KeyboardInterrupt):
        fine_tune(data=DATA, adapter_path=folder, iters=5, val_batches=1, rank=16, report=None, progress=False)
    assert digest(folder) == before
    monkeypatch.undo()

    def full_disk(*args, **kwargs):
        raise RefusionError("cannot write adapters.safetensors: No space left on device")

    monkeypatch.setattr(trainer, "save_adapters", full_disk)
    with pytest.raises(RefusionError, match="No space left"):
        fine_tune(data=DATA, adapter_path=folder, iters=1, val_batches=0, rank=16, report=None, progress=False)
    assert digest(folder) == before  # the config of rank 16 was written beside the old rank-8 weights
    monkeypatch.undo()

    from refusion_mlx.models import adapter_files

    real, written = mx.save_safetensors, []

    def fills_the_disk(path, *args, **kwargs):  # the weights fit, their numbered copy does not
        written.append(path)
        if "0000002_adapters" in path:
            raise RuntimeError(f"[write] Unable to write 628232 bytes to file {path}.")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(adapter_files.mx, "save_safetensors", fills_the_disk)
    with pytest.raises(RefusionError, match=r"cannot write .*0000002_adapters.safetensors: \[write\] Unable"):
        fine_tune(data=DATA, adapter_path=folder, iters=4, val_batches=0, rank=16, save_every=2, report=None,
                  progress=False)
    assert digest(folder) == before  # new weights replaced the old ones beside their old config, once
    assert sorted(p.name for p in folder.iterdir()) == sorted(before), "temporary files left"


def test_every_bad_row_names_its_line_and_an_assistant_message_alone_is_learned(tmp_path, capsys):
    rows = {"surrogate": '{"text": "a\\ud800b"}',
            "tools": '{"tools": "notalist", "messages": [{"role": "user", "content": "hi"}, '
                     '{"role": "assistant", "content": "yo"}]}'}
    for name, row in rows.items():
        data = tmp_path / name
        data.mkdir()
        (data / "train.jsonl").write_text('{"text": "fine"}\n' + row + "\n")
        code, _, err = run(["--data", data, "--adapter-path", tmp_path / "a", "--iters", "1"], capsys)
        assert code == 1 and err.startswith(f"error: {data / 'train.jsonl'}:2: "), err
    data = tmp_path / "alone"
    data.mkdir()
    (data / "train.jsonl").write_text('{"messages": [{"role": "assistant", "content": "hello"}]}\n' * 4)
    code, _, err = run(["--data", data, "--adapter-path", tmp_path / "b", "--iters", "1"], capsys)
    assert code == 0, err


def test_a_test_only_config_never_trains_over_the_adapters(trained, tmp_path, capsys):
    """mlx-lm's test-only config (``train: false``, ``test: true``, its example's ``iters: 1000`` left in)
    tests the folder's adapters and writes nothing (it trained 1000 steps over them); ``train: false``
    alone has nothing to do."""
    import shutil

    folder = tmp_path / "evalme"
    shutil.copytree(trained, folder)
    before = digest(folder)
    (tmp_path / "ev.yaml").write_text(f"train: false\ntest: true\ndata: {DATA}\niters: 1000\n"
                                      f"adapter_path: {folder}\n")
    code, out, err = run(["-c", tmp_path / "ev.yaml"], capsys)
    assert code == 0 and "Test loss" in out and "Iter 1:" not in out and digest(folder) == before, err
    code, _, err = run(["--data", DATA, "--test", "--adapter-path", folder, "--test-batches", "0"], capsys)
    assert code == 2 and "--test-batches 0 tests nothing" in err
    (tmp_path / "none.yaml").write_text(f"train: false\ndata: {DATA}\n")
    code, _, err = run(["-c", tmp_path / "none.yaml", "--adapter-path", folder], capsys)
    assert code == 1 and err == "error: train is false: nothing to do; add --test to only evaluate\n"


def test_rows_holding_line_separators_are_one_row_each(tmp_path, capsys):
    """JSONL written by ``json.dumps(ensure_ascii=False)`` keeps U+2028, U+2029 and NEL raw inside strings:
    a row each still (they were cut there: "not valid JSON"); a broken row's message reads once "at"."""
    data = tmp_path / "d"
    data.mkdir()
    rows = [json.dumps({"prompt": f"Who is Zoe {i}?", "completion": f"Zoe{sep}lives in Oslo."}, ensure_ascii=False)
            for i, sep in enumerate(["\u2028", "\u2029", "\x85", " "] * 2)]
    (data / "train.jsonl").write_text("\n".join(rows) + "\n")
    code, out, err = run(["--data", data, "--adapter-path", tmp_path / "a", "--iters", "1", "--batch-size", "8"],
                         capsys)
    assert code == 0, err
    (data / "train.jsonl").write_text(rows[0] + '\n{"prompt": "x", "completion": "unterminated}\n')
    code, _, err = run(["--data", data, "--adapter-path", tmp_path / "b", "--iters", "1"], capsys)
    assert code == 1 and "Unterminated string starting at column" in err and "at at" not in err, err


def test_a_configs_feature_keys_name_the_rows_parts(tmp_path, capsys):
    """mlx-lm's prompt_feature, completion_feature, text_feature and chat_feature (YAML) read rows whose
    parts are under other keys, as its create_dataset does (they were unknown options, exit 2)."""
    data = tmp_path / "d"
    data.mkdir()
    rows = [{"question": "Who is Zoe?", "answer": "Zoe lives in Oslo."},
            {"conversation": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
            {"body": "Sven lives in Hanoi."}] * 3
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "c.yaml"
    config.write_text("prompt_feature: question\ncompletion_feature: answer\nchat_feature: conversation\n"
                      "text_feature: body\n")
    code, out, err = run(["--data", data, "--adapter-path", tmp_path / "a", "--iters", "1", "-c", config], capsys)
    assert code == 0 and "Iter 1:" in out, err
    code, _, err = run(["--data", data, "--adapter-path", tmp_path / "b", "--iters", "1"], capsys)
    assert code == 1 and 'unknown format (keys: answer, question); expected "messages", "prompt"/"completion" ' \
                         'or "text"' in err
    code, _, err = run(["--data", "mlx-community/wikisql", "--iters", "1"], capsys)  # mlx-lm's hub dataset id
    assert code == 2 and "Hugging Face datasets are not read here" in err
    config.write_text("prompt_feature: 5\n")
    code, _, err = run(["--data", data, "--adapter-path", tmp_path / "c", "--iters", "1", "-c", config], capsys)
    assert code == 2 and "prompt_feature must be str" in err


def test_fine_tune_takes_paths_and_refuses_a_misspelt_option(tmp_path):
    with pytest.raises(TypeError, match="unknown option.*learnig_rate"):
        fine_tune(data=DATA, adapter_path=tmp_path / "a", iters=1, learnig_rate=5.0)
    _, _, result = fine_tune(data=DATA, adapter_path=tmp_path / "a", iters=1, val_batches=0, report=None,
                             progress=False)
    assert result.iterations == 1 and (tmp_path / "a" / "adapters.safetensors").is_file()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_sigterm_whose_raise_python_drops_still_stops_the_training_at_the_next_step(tmp_path, capsys, monkeypatch):
    """A signal handler's exception raised while a ``__del__`` runs is dropped by Python ("Exception ignored"):
    the training went on for good after its one SIGTERM (a supervisor waits, then kills it, adapters unsaved).
    The loop stops at its next step while the stop is pending, and saves as for any SIGTERM (exit 143)."""
    import signal

    from refusion_mlx.train import trainer

    class Dropped:
        def __del__(self):
            signal.raise_signal(signal.SIGTERM)

    tokens, calls = trainer.batch_tokens, []

    def counted(batch):
        calls.append(1)
        if len(calls) == 2:
            Dropped()  # the handler runs inside its __del__
        return tokens(batch)

    monkeypatch.setattr(trainer, "batch_tokens", counted)
    before = signal.getsignal(signal.SIGTERM)
    code, _, err = run(["--data", DATA, "--adapter-path", tmp_path / "a", "--iters", "30", "--val-batches", "0",
                        "--steps-per-report", "1"], capsys)
    assert code == 143 and "Interrupted after iteration 2: saved the adapters" in err, (code, err[-500:])
    assert len(calls) == 2 and (tmp_path / "a" / "adapters.safetensors").is_file()
    assert signal.getsignal(signal.SIGTERM) is before
