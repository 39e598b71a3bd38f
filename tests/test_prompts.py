"""Prompt sets: built-in lists, user files, Hub columns, limits, and the train/eval split."""

from __future__ import annotations

import sys
import types

import pytest

from jagg_core import prompts as prompts_module
from jagg_core.config import PromptsConfig
from jagg_core.errors import UserError
from jagg_core.prompts import builtin_prompt_sets, load_prompts, run_prompts, split_prompts


@pytest.mark.parametrize("name", ["general", "text_rendering", "compositional", "geneval"])
def test_builtin_sets_hold_a_few_hundred_distinct_prompts(name):
    prompts = load_prompts(name)
    assert name in builtin_prompt_sets()
    assert 200 <= len(prompts) == len(set(prompts))
    assert all(p == p.strip() and p for p in prompts)


def test_text_rendering_prompts_quote_the_text():
    from jagg_core.rewards.ocr import quoted_text

    assert all(quoted_text(p) for p in load_prompts("text_rendering"))


def test_txt_csv_and_jsonl_files(tmp_path):
    (tmp_path / "p.txt").write_text("a cat\n\n   \n  a   dog  \n")
    (tmp_path / "p.csv").write_text('id,prompt\n1,a cat\n2,"a dog, running"\n3,\n')
    (tmp_path / "p.jsonl").write_text('{"prompt": "a cat", "seed": 1}\n\n{"prompt": "a dog"}\n')
    assert load_prompts(str(tmp_path / "p.txt")) == ["a cat", "a dog"]
    assert load_prompts(str(tmp_path / "p.csv")) == ["a cat", "a dog, running"]
    assert load_prompts(str(tmp_path / "p.jsonl")) == ["a cat", "a dog"]


@pytest.mark.parametrize("filename,content,match", [
    ("empty.txt", "\n  \n", "holds no prompts"),
    ("cols.csv", "text,id\nhello,1\n", "needs a 'prompt' column; it has: text, id"),
    ("bad.jsonl", '{"prompt": "ok"}\n{not json}\n', "line 2 .* is not valid JSON"),
    ("nokey.jsonl", '{"text": "ok"}\n', "line 1 .* must be an object with a 'prompt' key"),
    ("number.jsonl", '{"prompt": 3}\n', "prompt 1 .* is a int, not text"),
    ("notes.md", "a cat\n", "must end in .txt, .csv, .jsonl"),
])
def test_malformed_files_are_user_errors(tmp_path, filename, content, match):
    (tmp_path / filename).write_text(content)
    with pytest.raises(UserError, match=match):
        load_prompts(str(tmp_path / filename))


def test_binary_missing_and_unknown_sources(tmp_path):
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(UserError, match="is not UTF-8 text"):
        load_prompts(str(tmp_path / "bin.txt"))
    with pytest.raises(UserError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.txt"))
    with pytest.raises(UserError, match=r"unknown prompt source 'nope'; give a built-in set \(.*general"):
        load_prompts("nope")


def test_oversized_sources_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(prompts_module, "MAX_PROMPTS", 3)
    (tmp_path / "many.txt").write_text("a\nb\nc\nd\n")
    with pytest.raises(UserError, match="holds 4 prompts; the limit is 3"):
        load_prompts(str(tmp_path / "many.txt"))
    monkeypatch.setattr(prompts_module, "MAX_FILE_BYTES", 4)
    with pytest.raises(UserError, match="the limit is"):
        load_prompts(str(tmp_path / "many.txt"))


class FakeDataset:
    def __init__(self, columns):
        self.columns = columns
        self.column_names = list(columns)
        self.num_rows = len(next(iter(columns.values())))

    def __getitem__(self, column):
        return self.columns[column]


def fake_datasets(monkeypatch, load):
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load))


def test_hub_dataset_column(monkeypatch):
    calls = []

    def load(name, split):
        calls.append((name, split))
        return FakeDataset({"prompt": ["a", " "], "caption": ["x", "y"]})

    fake_datasets(monkeypatch, load)
    assert load_prompts("hf://user/set") == ["a"]
    assert load_prompts("hf://user/set:caption") == ["x", "y"]
    assert calls == [("user/set", "train")] * 2
    with pytest.raises(UserError, match="has no column 'text'; it has: prompt, caption"):
        load_prompts("hf://user/set:text")


def test_hub_dataset_offline_is_one_line(monkeypatch):
    def load(name, split):
        raise ConnectionError("Couldn't reach 'user/set' on the Hub (LocalEntryNotFoundError)\nmore detail")

    fake_datasets(monkeypatch, load)
    with pytest.raises(UserError) as err:
        load_prompts("hf://user/set")
    assert "\n" not in str(err.value) and "'user/set'" in str(err.value)


def test_split_is_deterministic_disjoint_and_order_free():
    prompts = [f"p{i}" for i in range(50)] + ["p3", "p3"]
    train, held_out = split_prompts(prompts, 8, seed=7)
    assert len(held_out) == len(set(held_out)) == 8
    assert not set(train) & set(held_out)
    assert set(train) | set(held_out) == set(prompts)
    assert split_prompts(prompts, 8, seed=7) == (train, held_out)
    assert split_prompts(list(reversed(prompts)), 8, seed=7)[1] == held_out
    assert split_prompts(prompts, 8, seed=8)[1] != held_out


def test_split_needs_prompts_left_for_training():
    with pytest.raises(UserError, match="only 3 distinct prompts"):
        split_prompts(["a", "b", "c", "a"], 3, seed=0)


def test_eval_prompts_of_ones_own_are_the_eval_set_and_leave_training(tmp_path):
    typed = tmp_path / "eval.txt"
    typed.write_text("a red circle on a blue background, top left\na red circle on a blue background, top left\nnew\n")
    train, held_out = run_prompts(PromptsConfig(source="shapes", eval_source=str(typed)))
    assert held_out == ["a red circle on a blue background, top left", "new"]
    assert "a red circle on a blue background, top left" not in train and len(train) > 100
    assert run_prompts(PromptsConfig(source="shapes", eval_count=8)) == split_prompts(load_prompts("shapes"), 8, 0)
    with pytest.raises(UserError, match="every training prompt is also an eval prompt"):
        run_prompts(PromptsConfig(source=str(typed), eval_source=str(typed)))


def test_a_limit_trains_on_a_seeded_draw_of_that_many_distinct_prompts_and_leaves_the_eval_set(tmp_path):
    source = tmp_path / "prompts.txt"
    source.write_text("\n".join([f"p{i}" for i in range(40)] + ["p3", "p3"]) + "\n")
    full_train, held_out = run_prompts(PromptsConfig(source=str(source), eval_count=4))
    train, limited_eval = run_prompts(PromptsConfig(source=str(source), eval_count=4, limit=10))
    assert limited_eval == held_out and len(set(train)) == 10 and set(train) < set(full_train)
    assert train == [p for p in full_train if p in set(train)]  # their order and repeats kept
    assert run_prompts(PromptsConfig(source=str(source), eval_count=4, limit=10))[0] == train
    assert set(run_prompts(PromptsConfig(source=str(source), eval_count=4, limit=10, split_seed=1))[0]) != set(train)
    assert run_prompts(PromptsConfig(source=str(source), eval_count=4, limit=36))[0] == full_train  # 36 distinct
