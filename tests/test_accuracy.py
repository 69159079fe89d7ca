"""python -m refusion_mlx.train.accuracy: task families, budgets, exact match, the CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest

from refusion_mlx.decode.stream import chat_prompt, generate
from refusion_mlx.errors import RefusionError
from refusion_mlx.train.accuracy import (answer_budget, default_params, exact_match, family_of_prompt,
                                         format_table, main, read_rows, row_family)

# one prompt of every template of the demo's task mix
TEMPLATES = {
    "Count from 64 to 84.": "counting", "Please count from 73 up to 86.": "counting",
    "List the numbers from 23 to 39.": "counting",
    "Write the multiplication table of 4 up to 10.": "times_table",
    "Show the times table for 8 from 1 to 5.": "times_table",
    "What is 84 + 24?": "addition", "Compute 35 + 90.": "addition", "Please add 52 and 50.": "addition",
    "What is 3 - 6?": "subtraction", "Compute 56 - 13.": "subtraction",
    "Please subtract 50 and 97.": "subtraction",
    "What is 35 * 3?": "multiplication", "Compute 35 * 11.": "multiplication",
    "Please multiply 31 and 3.": "multiplication",
    "Who is Omar?": "people", "Tell me about Hana.": "people", "Describe Quinn.": "people",
    "What pet does Priya have?": "people", "What is the job of Chen?": "people",
    "Where does Uma live?": "people",
    "Write a Python function that returns the sum of a list.": "python",
    "Write a Python function g that multiplies x by 4.": "python",
    "Reverse the words: rocket sugar apple": "reversing", "Spell the word coffee.": "spelling",
    "Repeat the word yellow 4 times.": "repeating", "Sort these numbers: 72, 54, 74": "sorting",
    "Write a poem.": "other", "What is the capital of France?": "other",
}


@pytest.mark.parametrize("prompt,family", TEMPLATES.items())
def test_every_template_has_its_family(prompt, family):
    assert family_of_prompt(prompt) == family


def test_a_family_field_wins_and_the_last_user_turn_decides():
    row = {"messages": [{"role": "user", "content": "Who is Omar?"}, {"role": "assistant", "content": "x"},
                        {"role": "user", "content": "Spell the word cat."}, {"role": "assistant", "content": "c-a-t"}]}
    assert row_family(row) == "spelling"
    assert row_family({**row, "family": "mine"}) == "mine"


def test_budget_is_twice_the_reference_in_whole_blocks(demo):
    _, tokenizer = demo
    n = len(tokenizer.encode("c-o-f-f-e-e"))
    assert answer_budget(tokenizer, "c-o-f-f-e-e") == -(-2 * (n + 1) // 16) * 16
    assert answer_budget(tokenizer, "word " * 400) == 512


def test_exact_match_counts_per_family(demo):
    model, tokenizer = demo
    prompts = ["Who is Sven?", "Spell the word coffee.", "Count from 3 to 9."]
    params = dataclasses.replace(default_params(), gen_length=64)
    rows = []
    for p in prompts:  # the model's own answers are references it must match; a changed one it must miss
        text = generate(model, tokenizer, chat_prompt(tokenizer, p), params=params)
        rows.append({"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": text}]})
    rows.append({"messages": [{"role": "user", "content": "Who is Sven?"},
                              {"role": "assistant", "content": "Sven is nobody."}]})
    result = exact_match(model, tokenizer, rows, max_tokens=64)
    assert result["families"]["people"] == {"correct": 1, "total": 2, "accuracy": 0.5}
    assert result["families"]["spelling"]["correct"] == 1
    assert result["families"]["counting"]["correct"] == 1
    assert (result["correct"], result["total"]) == (3, 4)
    assert result["failures"]["people"][0]["expected"] == "Sven is nobody."
    custom = exact_match(model, tokenizer, rows[:1], max_tokens=64, family_of=lambda r: "mine")
    assert list(custom["families"]) == ["mine"]
    table = format_table(result, before=custom)
    assert "people" in table and "mine" in table and "3/4" in table


def test_read_rows_checks_the_format(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(RefusionError, match="bad.jsonl:1"):
        read_rows(bad)
    with pytest.raises(RefusionError, match="no such file"):
        read_rows(tmp_path / "none.jsonl")
    bad.write_text("\n\n")  # nothing to measure: not a table of 0/0
    with pytest.raises(RefusionError, match="no rows"):
        read_rows(bad)
    bad.write_bytes(b"\xff\xfe\n")
    with pytest.raises(RefusionError, match="not UTF-8 text"):
        read_rows(bad)


def test_rows_whose_content_is_a_list_of_text_parts_are_read_as_train_reads_them(demo, tmp_path, capsys):
    """OpenAI's ``[{"type": "text", "text": ...}]`` content, which train takes, was refused by accuracy and
    bench --layouts ('a row needs "messages" ending with a user turn ...'); a non-text part is refused with
    train's own line."""
    from refusion_mlx import bench
    from refusion_mlx.train.dataset import encode_line

    model, tokenizer = demo
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Spell the word "},
                                                       {"type": "text", "text": "cat."}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "c-a-t"}]}]}
    data = tmp_path / "parts.jsonl"
    data.write_text(json.dumps(parts) + "\n")
    (row,) = read_rows(data)
    assert [m["content"] for m in row["messages"]] == ["Spell the word cat.", "c-a-t"]
    assert row_family(row) == "spelling"
    assert exact_match(model, tokenizer, [row], max_tokens=16)["total"] == 1
    assert main(["--data", str(data), "--max-tokens", "16"]) == 0
    assert "spelling" in capsys.readouterr().out
    assert bench.main(["--layouts", "default", "--budgets", "16", "--slot-sizes", "4", "--data", str(data)]) == 0
    capsys.readouterr()
    bad = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
                        parts["messages"][1]]}
    data.write_text(json.dumps(bad) + "\n")
    with pytest.raises(RefusionError) as trains:
        encode_line(bad, tokenizer, f"{data}:1")
    with pytest.raises(RefusionError) as ours:
        read_rows(data)
    assert str(ours.value) == str(trains.value) and "list of text parts" in str(ours.value)


def test_cli_prints_a_table_and_writes_json(tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    rows = [{"messages": [{"role": "user", "content": "Spell the word cat."},
                          {"role": "assistant", "content": "c-a-t"}]},
            {"messages": [{"role": "user", "content": "Write a poem."}, {"role": "assistant", "content": "no"}],
             "family": "poetry"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "r.json"
    assert main(["--data", str(data), "--json", str(out), "--limit", "2"]) == 0
    printed = capsys.readouterr().out
    assert "poetry" in printed and "spelling" in printed and "2 rows" in printed
    result = json.loads(out.read_text())
    assert result["total"] == 2 and result["families"]["poetry"]["correct"] == 0
    assert main(["--data", str(data), "--json", str(tmp_path / "no" / "r.json")]) == 1  # before the evaluation
    where = tmp_path / "no" / "r.json"
    assert capsys.readouterr().err.strip() == f"error: cannot write {where}: No such file or directory"
    for bad in (["--show-failures", "-1"], ["--json", ""]):
        with pytest.raises(SystemExit) as e:
            main(["--data", str(data), *bad])
        assert e.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
