"""The demo's training data builder (examples/demo_model/build_data.py): the
conversations it evaluates on and the same questions asked alone."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import demo_example_module


def build_data_module():
    return demo_example_module("build_data")


def write_tasks(folder: Path) -> None:
    """A small mix in the shared mix's shape: a few families, train and valid."""
    def rows(names):
        out = []
        for name in names:
            out.append({"messages": [{"role": "user", "content": f"Spell the word {name}."},
                                     {"role": "assistant", "content": "-".join(name)}]})
            out.append({"messages": [{"role": "user", "content": f"Reverse the words: {name} sun"},
                                     {"role": "assistant", "content": f"sun {name}"}]})
        return out

    folder.mkdir()
    for split, names in (("train", ["apple", "river", "stone", "cloud"]), ("valid", ["tiger", "moon"])):
        with open(folder / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows(names))


def read(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_alone_rows_are_the_conversations_last_questions(tmp_path):
    bd = build_data_module()
    write_tasks(tmp_path / "tasks")
    bd.build(tmp_path / "tasks", tmp_path / "out", seed=3, n_conversations=20, n_counting=10,
             n_valid_conversations=5, n_eval_conversations=12)
    convs = read(tmp_path / "out" / "conversations.jsonl")
    alone = read(tmp_path / "out" / "alone.jsonl")
    assert len(convs) == len(alone) == 12
    valid_prompts = {r["messages"][0]["content"] for r in read(tmp_path / "tasks" / "valid.jsonl")}
    for conv, single in zip(convs, alone):
        assert len(conv["messages"]) == 6  # three turns
        assert single["messages"] == conv["messages"][-2:]
        assert single["messages"][0]["content"] in valid_prompts  # evaluated on held-out rows


def test_the_files_are_deterministic_in_the_seed(tmp_path):
    """retrain.py's stages rebuild their data from a seed; a rerun must train on the same rows."""
    bd = build_data_module()
    write_tasks(tmp_path / "tasks")
    for run, seed in (("a", 5), ("b", 5), ("c", 6)):
        bd.build(tmp_path / "tasks", tmp_path / run, seed=seed, n_conversations=30, n_counting=10)
    for name in ("train.jsonl", "conversations.jsonl", "alone.jsonl"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()
    assert (tmp_path / "a" / "train.jsonl").read_text() != (tmp_path / "c" / "train.jsonl").read_text()


def test_evaluation_conversations_can_end_in_one_family(tmp_path):
    bd = build_data_module()
    write_tasks(tmp_path / "tasks")
    bd.build(tmp_path / "tasks", tmp_path / "out", seed=1, n_conversations=10, n_counting=5,
             n_eval_conversations=20, eval_focus=("Spell the",))
    lasts = [row["messages"][-2]["content"] for row in read(tmp_path / "out" / "alone.jsonl")]
    assert len(lasts) == 20 and all(q.startswith("Spell the word") for q in lasts)
    import pytest

    with pytest.raises(SystemExit, match="no validation row"):
        bd.build(tmp_path / "tasks", tmp_path / "out2", seed=1, n_conversations=10, n_counting=5,
                 eval_focus=("Sort these",))
