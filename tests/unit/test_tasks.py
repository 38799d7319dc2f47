"""Built-in digit tasks: determinism, row format and hand-checked scores."""

import re
import sys
import types

import pytest

from stages.data.tasks import TASKS, AddTask, load_task


def test_rows_are_deterministic_and_prefix_stable():
    for name in TASKS:
        task = load_task(name)
        first = task.generate_rows(seed=7, n=5)
        assert first == task.generate_rows(seed=7, n=5)
        assert task.generate_rows(seed=7, n=12)[:5] == first
        assert first != task.generate_rows(seed=8, n=5)


def test_row_format_and_answers():
    patterns = {
        "first_digit": r"\d{4,6}=",
        "copy": r"\d{4,6}=",
        "reverse": r"\d{4,6}=",
        "add": r"[1-9]\d{1,2}\+[1-9]\d{1,2}=",
    }
    for name, pattern in patterns.items():
        for row in load_task(name).generate_rows(seed=0, n=50):
            assert set(row) == {"prompt", "ground_truth", "data_source", "extra_info"}
            assert re.fullmatch(pattern, row["prompt"]), row
            assert row["data_source"] == name
            body = row["prompt"][:-1]
            if name == "first_digit":
                assert row["ground_truth"] == body[0]
            elif name == "copy":
                assert row["ground_truth"] == body
            elif name == "reverse":
                assert row["ground_truth"] == body[::-1]
            else:
                a, b = body.split("+")
                assert row["ground_truth"] == str(int(a) + int(b))


def test_first_digit_score():
    task = load_task("first_digit")
    assert task.compute_score("first_digit", "4", "4") == 1.0
    assert task.compute_score("first_digit", "4xyz", "4") == 1.0  # only the first char counts
    assert task.compute_score("first_digit", " 4", "4") == 0.0
    assert task.compute_score("first_digit", "", "4") == 0.0


def test_copy_and_reverse_partial_credit():
    copy, reverse = load_task("copy"), load_task("reverse")
    assert copy.compute_score("copy", "4821", "4821") == 1.0
    # "4831" vs "4821": 3 of 4 positions match -> 0.75
    assert copy.compute_score("copy", "4831", "4821") == 0.75
    # "48212" vs "4821": 4 matches / max(5, 4) = 0.8 (extra digit costs credit)
    assert copy.compute_score("copy", "48212", "4821") == 0.8
    # answer stops at the first non-digit: "48=21" -> "48": 2 / 4 = 0.5
    assert copy.compute_score("copy", "48=21", "4821") == 0.5
    assert copy.compute_score("copy", "abc", "4821") == 0.0
    # reverse scores against the reversed digits: "1284" vs "1284" exact
    assert reverse.compute_score("reverse", "1284", "1284") == 1.0


def test_add_partial_credit_aligned_at_units():
    add = AddTask()
    assert add.compute_score("add", "122", "122") == 1.0
    # "121" vs "122" from the units: 1/2 no, 2=2, 1=1 -> 2/3 match -> 0.5 * 2/3 = 0.3333333
    assert add.compute_score("add", "121", "122") == pytest.approx(1 / 3, abs=1e-12)
    # "22" vs "122" from the units: 2=2, 2=2 -> 2 / max(2, 3) -> 0.5 * 2/3
    assert add.compute_score("add", "22", "122") == pytest.approx(1 / 3, abs=1e-12)
    assert add.compute_score("add", "", "122") == 0.0


def test_task_kwargs_reach_the_task():
    rows = load_task("first_digit", min_digits=3, max_digits=3).generate_rows(0, 20)
    assert all(len(r["prompt"]) == 4 for r in rows)
    with pytest.raises(ValueError, match="min_digits"):
        load_task("copy", min_digits=5, max_digits=2)
    with pytest.raises(ValueError, match="data.task_kwargs: cannot build task 'add'"):
        load_task("add", digits=3)


def test_load_task_by_import_path(monkeypatch):
    module = types.ModuleType("my_tasks_for_test")

    class Echo:
        def __init__(self, word: str = "hi") -> None:
            self.word = word

        def generate_rows(self, seed, n):
            return [{"prompt": self.word, "ground_truth": self.word, "data_source": "echo", "extra_info": {}}] * n

        def compute_score(self, data_source, solution_str, ground_truth, extra_info=None):
            return float(solution_str == ground_truth)

    module.Echo = Echo
    module.ready = Echo("yo")
    monkeypatch.setitem(sys.modules, "my_tasks_for_test", module)
    assert load_task("my_tasks_for_test:Echo", word="ok").generate_rows(0, 1)[0]["prompt"] == "ok"
    assert load_task("my_tasks_for_test:ready").word == "yo"
    with pytest.raises(ValueError, match="takes no data.task_kwargs"):
        load_task("my_tasks_for_test:ready", word="x")


def test_load_task_errors_name_the_field():
    with pytest.raises(ValueError, match=r"data.task: unknown task 'nope'.*first_digit"):
        load_task("nope")
    with pytest.raises(ValueError, match="data.task: cannot import module"):
        load_task("no_such_module_xyz:Task")
    with pytest.raises(ValueError, match="data.task: module 'math' has no attribute 'Nope'"):
        load_task("math:Nope")
    with pytest.raises(ValueError, match="data.task: 'math:pi' gave a float"):
        load_task("math:pi")
