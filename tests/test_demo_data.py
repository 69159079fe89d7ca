"""The demo's training data builder (examples/demo_model/build_data.py): the
conversations it evaluates on and the same questions asked alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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


def tool_data_module():
    return demo_example_module("tool_data")


PEOPLE = {"Sven": ("Hanoi", "baker", "turtle", "Pepper"), "Lena": ("Kyiv", "painter", "turtle", "Tom"),
          "Omar": ("Osaka", "baker", "cat", "Biscuit")}


def write_mix_with_people(folder: Path) -> None:
    """A mix in the shared mix's shape with people (their full descriptions), arithmetic and spelling."""
    td = tool_data_module()
    rows = []
    for name, person in PEOPLE.items():
        for t, template in enumerate(td.PERSON_TEMPLATES):
            rows.append({"messages": [{"role": "user", "content": template.format(n=name)},
                                      {"role": "assistant", "content": td.person_answer(t, name, person)}]})
    for a, b in ((12, 30), (7, 9), (45, 3)):
        question, _, _, answer = td.arithmetic(a, 0, b, 1)
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    for word in ("apple", "river", "stone", "cloud"):
        rows.append({"messages": [{"role": "user", "content": f"Spell the word {word}."},
                                  {"role": "assistant", "content": "-".join(word)}]})
    folder.mkdir()
    for split in ("train", "valid"):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_tool_rows_hold_out_the_checked_questions(tmp_path):
    td = tool_data_module()
    write_mix_with_people(tmp_path / "tasks")
    assert td.people_facts(read(tmp_path / "tasks" / "train.jsonl")) == PEOPLE
    td.build(tmp_path / "tasks", tmp_path / "out", seed=2, n_calls=300, n_answers=300, n_direct=100, n_json=100,
             n_valid=40)
    checks = td.eval_files(tmp_path / "tasks", tmp_path / "checks", n_arithmetic=20, n_new=10, n_direct=10)
    assert checks["tools_alone"] == checks["tools_later"] == checks["tool_answers"] == 3 + 10 + 20
    asked = set()  # every question a training row with tools answers with a call
    for row in read(tmp_path / "out" / "train.jsonl"):
        msgs = row["messages"]
        asked |= {m["content"] for m, nxt in zip(msgs, msgs[1:]) if m["role"] == "user" and nxt.get("tool_calls")}
    held = [row["messages"][-2]["content"] for row in read(tmp_path / "checks" / "tools_alone.jsonl")]
    assert asked and not asked & set(held)
    trained_json = {r["messages"][0]["content"] for r in read(tmp_path / "out" / "train.jsonl") if r["family"] == "json"}
    assert trained_json and not trained_json & {r["messages"][0]["content"]
                                                for r in read(tmp_path / "checks" / "json.jsonl")}
    later = read(tmp_path / "checks" / "tools_later.jsonl")
    assert all(len(r["messages"]) >= 4 for r in later)
    def question_and_call(row):
        fn = row["messages"][-1]["tool_calls"][0]["function"]
        args = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) else fn["arguments"]
        return row["messages"][-2]["content"], fn["name"], args

    assert [question_and_call(r) for r in later] == [question_and_call(r) for r in
                                                     read(tmp_path / "checks" / "tools_alone.jsonl")]


def test_tool_rows_are_round_trips_in_the_mixs_words(tmp_path):
    """A call, the tool's result, the answer: lookup_person returns the JSON
    family's object, and the answer is the mix's for that question."""
    td = tool_data_module()
    write_mix_with_people(tmp_path / "tasks")
    td.build(tmp_path / "tasks", tmp_path / "out", seed=0, n_calls=50, n_answers=200, n_direct=50, n_json=20,
             n_valid=10)
    rows = read(tmp_path / "out" / "train.jsonl")
    assert {r["family"] for r in rows} == {"tool_call", "tool_answer", "tool_direct", "json"}
    mix = {r["messages"][0]["content"]: r["messages"][1]["content"] for r in read(tmp_path / "tasks" / "train.jsonl")}
    checked = 0
    for row in rows:
        msgs = row["messages"]
        if row["family"] == "tool_answer":
            question, call, result, answer = msgs[-4:]
            fn = call["tool_calls"][0]["function"]
            assert fn["name"] in {t["function"]["name"] for t in row["tools"]}
            args = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) else fn["arguments"]
            if fn["name"] == "lookup_person" and args["name"] in PEOPLE:
                assert result["content"] == td.facts_json(args["name"], PEOPLE[args["name"]])
                assert answer["content"] == mix[question["content"]]
                checked += 1
        elif row["family"] == "tool_direct":
            assert not msgs[-1].get("tool_calls") and msgs[-1]["content"] == mix[msgs[-2]["content"]]
        elif row["family"] == "json":
            obj = json.loads(msgs[1]["content"])
            assert obj["name"] in msgs[0]["content"] and msgs[1]["content"] == td.facts_json(obj["name"],
                                                                                            PEOPLE[obj["name"]])
    assert checked > 10


def test_tool_rows_encode_for_the_trainer_and_are_deterministic(tmp_path):
    from refusion_mlx.models.loading import load_tokenizer
    from refusion_mlx.train.dataset import encode_line

    td = tool_data_module()
    write_mix_with_people(tmp_path / "tasks")
    for run in ("a", "b"):
        td.build(tmp_path / "tasks", tmp_path / run, seed=4, n_calls=40, n_answers=40, n_direct=20, n_json=10,
                 n_valid=10, systems=0.5)
    assert (tmp_path / "a" / "train.jsonl").read_text() == (tmp_path / "b" / "train.jsonl").read_text()
    # a share of the rows with tools start with a system message; the held-out ones only in valid.jsonl
    firsts = {split: [r["messages"][0] for r in read(tmp_path / "a" / f"{split}.jsonl") if r.get("tools")]
              for split in ("train", "valid")}
    systems = {split: {m["content"] for m in ms if m["role"] == "system"} for split, ms in firsts.items()}
    assert systems["train"] and systems["train"] <= set(td.SYSTEMS) and systems["valid"] <= set(td.HELD_OUT_SYSTEMS)
    assert any(m["role"] == "user" for m in firsts["train"])
    tok = load_tokenizer(demo_example_module("grow_vocab").tool_tokenizer(tmp_path / "tokenizer"))
    calls = [r for r in read(tmp_path / "a" / "train.jsonl") if r["family"] == "tool_call"]
    for i, row in enumerate(calls):
        record = encode_line(row, tok, f"row {i}")
        assert record.response[0] == tok.convert_tokens_to_ids("<tool_call>")
        assert record.response[-2:] == [tok.convert_tokens_to_ids("</tool_call>"), tok.eos_token_id]
        assert len(record) <= 1024  # retrain.py's --max-seq-length for phase 3


def test_made_up_names_are_new_and_leave_the_held_out_rows_alone(tmp_path):
    """--made-up-names: unknown people in training rows get made-up names, never one of the mix's people or a
    held-out name; without it the rows are as before (earlier stages rebuild the same data)."""
    td = tool_data_module()
    write_mix_with_people(tmp_path / "tasks")
    sizes = dict(seed=4, n_calls=60, n_answers=20, n_direct=10, n_json=10, n_valid=10)
    td.build(tmp_path / "tasks", tmp_path / "plain", **sizes)
    td.build(tmp_path / "tasks", tmp_path / "plain2", made_up=0.0, **sizes)
    td.build(tmp_path / "tasks", tmp_path / "made", made_up=1.0, **sizes)
    assert (tmp_path / "plain" / "train.jsonl").read_text() == (tmp_path / "plain2" / "train.jsonl").read_text()

    def called(split, part="train"):
        return [json.loads(c["function"]["arguments"]) if isinstance(c["function"]["arguments"], str)
                else c["function"]["arguments"]
                for r in read(tmp_path / split / f"{part}.jsonl") for m in r["messages"] for c in m.get("tool_calls") or ()
                if c["function"]["name"] == "lookup_person"]

    known = set(td.people_facts(read(tmp_path / "tasks" / "train.jsonl")))
    names = {a["name"] for a in called("made")}
    new = names - known
    assert new and not new & set(td.NEW_NAMES) and not names & set(td.HELD_OUT_NAMES)
    assert all(n.isalpha() and n[0].isupper() and 4 <= len(n) <= 9 for n in new)
    assert {a["name"] for a in called("plain")} - known <= set(td.NEW_NAMES)
    # the held-out rows ask about held-out names only
    assert {a["name"] for a in called("made", "valid")} - known <= set(td.HELD_OUT_NAMES)


def test_other_tool_rows_answer_in_text_from_whatever_the_tool_returned(tmp_path):
    """tool_other: after a result of another shape (part of a person, "not found", another tool's), the
    answer is text that says only what came back; tool_other_call: the other tools' calls copy the question's
    place or topic; the checks' places and topics are never trained."""
    td = tool_data_module()
    write_mix_with_people(tmp_path / "tasks")
    td.build(tmp_path / "tasks", tmp_path / "out", seed=3, n_calls=0, n_answers=0, n_direct=0, n_json=0,
             n_other=300, n_other_calls=100, n_valid=20)
    rows = read(tmp_path / "out" / "train.jsonl")
    assert {r["family"] for r in rows} == {"tool_other", "tool_other_call"}
    partial = other = 0
    for row in rows:
        msgs, offered = row["messages"], {t["function"]["name"] for t in row["tools"]}
        if row["family"] == "tool_other_call":
            fn = msgs[-1]["tool_calls"][0]["function"]
            assert fn["name"] in offered and fn["name"] != "lookup_person" and fn["name"] != "calculator"
            args = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) else fn["arguments"]
            assert all(str(v) in msgs[-2]["content"] for v in args.values())
            continue
        call, result, answer = msgs[-3:]
        assert call["tool_calls"] and result["role"] == "tool" and not answer.get("tool_calls")
        assert answer["content"] and "<tool_call>" not in answer["content"]
        if call["tool_calls"][0]["function"]["name"] == "lookup_person":
            partial += 1
            try:
                facts = json.loads(result["content"])
            except json.JSONDecodeError:
                facts = None
            if isinstance(facts, dict) and "name" in facts:
                assert set(facts) <= {"name", "city", "job", "pet", "pet_name"}
                for key in ("city", "job", "pet_name"):  # the answer says no fact the tool did not return
                    for person in PEOPLE.values():
                        value = person[("city", "job", "pet", "pet_name").index(key)]
                        if value in answer["content"]:
                            assert value in result["content"]
            else:
                assert answer["content"].startswith("I could not find")
        else:
            other += 1
    assert partial > 50 and other > 50
    checks = td.eval_files(tmp_path / "tasks", tmp_path / "checks", n_arithmetic=4, n_new=2, n_direct=2, n_other=30)
    assert checks["tool_other"] == checks["tool_other_calls"] == 30
    trained = " ".join(m.get("content") or "" for r in rows for m in r["messages"])
    held = " ".join(r["messages"][-2]["content"] for r in read(tmp_path / "checks" / "tool_other_calls.jsonl"))
    assert any(p in held for p in td.HELD_OUT_PLACES + td.HELD_OUT_TOPICS)
    assert not any(p in trained for p in td.HELD_OUT_PLACES + td.HELD_OUT_TOPICS)


def test_a_tasks_folder_without_the_training_rows_is_one_line(tmp_path):
    """``--tasks examples/demo_model/tasks`` (the repository's validation rows alone): one line, no traceback."""
    bd = build_data_module()
    write_tasks(tmp_path / "tasks")
    (tmp_path / "tasks" / "train.jsonl").unlink()
    with pytest.raises(SystemExit) as e:
        bd.build(tmp_path / "tasks", tmp_path / "out")
    assert str(e.value).startswith("error: --tasks ") and "has no train.jsonl" in str(e.value)
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()
