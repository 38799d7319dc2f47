"""The source core: prompts carry their token ids, bad rows are skipped and counted,
file data cycles with unique prompt ids, a curriculum draws from the level it is given."""

from __future__ import annotations

import json

import pytest

from pipeline.config import CurriculumConfig, DataConfig
from stages.data.files import RowError
from stages.data.source import PromptSource, iter_list_rows
from stages.data.tasks import load_task
from stages.models.tiny import build_char_tokenizer


class _Log:
    def __init__(self):
        self.events = []

    def warning(self, event, **kw):
        self.events.append(("warning", event, kw))

    def debug(self, event, **kw):
        self.events.append(("debug", event, kw))


class _Ctx:
    def __init__(self):
        self.log = _Log()


def open_source(data: DataConfig, rows=None, arch="llama", seed=0) -> PromptSource:
    src = PromptSource(rows)
    src.ctx = _Ctx()
    src.open(data, build_char_tokenizer(arch), "/models/m", seed, per_batch=2)
    return src


def test_file_prompts_carry_token_ids_and_skip_bad_rows(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([json.dumps({"prompt": "12=", "ground_truth": "1"}), "{oops",
                               json.dumps({"prompt": "3=", "ground_truth": "3"})]) + "\n")
    src = open_source(DataConfig(path=str(path), shuffle=False))
    first, second, third = (src._next_prompt() for _ in range(3))
    # llama char vocab: <bos> 1, "1" 5, "2" 6, "3" 7, "=" 70
    assert (first.text, first.token_ids, first.ground_truth, first.prompt_id) == ("12=", [1, 5, 6, 70], "1", "p0")
    assert (second.text, second.token_ids, second.prompt_id) == ("3=", [1, 7, 70], "p2")
    # the second epoch: ids continue past the file's 3 rows, so they stay unique
    assert (third.text, third.prompt_id, third.index) == ("12=", "p3", 3)
    assert src.skipped == {"malformed": 1}
    # validated before the run, so logged at debug level only
    assert [(lvl, ev) for lvl, ev, _ in src.ctx.log.events] == [("debug", "row_skipped")]


def test_chat_rows_are_rendered_once_by_the_source(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "7="}], "ground_truth": "7"}) + "\n")
    prompt = open_source(DataConfig(path=str(path)), arch="qwen2")._next_prompt()
    assert prompt.text == "<|im_start|>user\n7=<|im_end|>\n<|im_start|>assistant\n"
    assert prompt.token_ids[0] == 1 and prompt.token_ids[-1] == 67  # <|im_start|> ... "\n"
    assert prompt.ground_truth == "7"
    assert prompt.messages == [{"role": "user", "content": "7="}]  # for a reward model's own template


def test_task_rows_over_length_are_skipped_with_a_warning():
    kwargs = {"min_digits": 3, "max_digits": 5}
    src = open_source(DataConfig(task="copy", max_prompt_len=5, task_kwargs=kwargs))
    prompts = [src._next_prompt() for _ in range(4)]
    # "<digits>=" plus <bos>: 3 digits -> 5 tokens fit; 4 or 5 digits do not
    rows = load_task("copy", **kwargs).generate_rows(0, 100)
    fitting = [i for i, r in enumerate(rows) if len(r["prompt"]) == 4][:4]
    assert [p.text for p in prompts] == [rows[i]["prompt"] for i in fitting]
    assert [p.index for p in prompts] == fitting
    too_long = fitting[-1] + 1 - 4
    assert too_long > 0 and src.skipped == {"over_length": too_long}
    assert [lvl for lvl, _, _ in src.ctx.log.events] == ["warning"] * too_long


def test_a_source_with_no_usable_row_gives_up():
    src = open_source(DataConfig(), rows=[{"prompt": ""}])
    with pytest.raises(RowError) as info:
        src._next_prompt()
    assert info.value.reason == "exhausted" and "no usable rows left" in str(info.value)


def test_list_rows_cycle_with_unique_indices():
    it = iter_list_rows([{"prompt": "a"}, {"prompt": "b"}], "rows")
    seen = [next(it) for _ in range(5)]
    assert [i for i, _, _ in seen] == [0, 1, 2, 3, 4]
    assert [w for _, w, _ in seen[:3]] == ["rows row 1", "rows row 2", "rows row 1"]


def test_rows_passed_in_use_the_column_mapping():
    rows = [{"question": "5=", "answer": "5"}]
    src = open_source(DataConfig(prompt_key="question", answer_key="answer"), rows=rows)
    prompt = src._next_prompt()
    assert (prompt.text, prompt.ground_truth, prompt.token_ids) == ("5=", "5", [1, 9, 70])  # <bos> "5" "="


def test_curriculum_draws_from_the_level_it_is_given_with_unique_indices(tmp_path):
    path = tmp_path / "c.jsonl"
    rows = [("1=", 1), ("22=", 2), ("3=", 1), ("44=", 2), ("55=", 9)]
    path.write_text("".join(json.dumps({"prompt": p, "ground_truth": p[0], "difficulty": d}) + "\n" for p, d in rows))
    cur = CurriculumConfig(levels=[1, 2, 9], start=2)
    src = open_source(DataConfig(path=str(path), shuffle=False, curriculum=cur))
    assert src.level == 2
    # level 2's rows are file rows 2 and 4 (indices 1, 3), then its second epoch: 1 + 5, 3 + 5
    got = [src._next_prompt() for _ in range(3)]
    assert [(p.text, p.index, p.extra_info) for p in got] == [
        ("22=", 1, {"difficulty": 2}), ("44=", 3, {"difficulty": 2}), ("22=", 6, {"difficulty": 2})]
    src.level = 1  # what the controller's admission hands out after a demotion
    assert [(p.text, p.index) for p in (src._next_prompt() for _ in range(2))] == [("1=", 0), ("3=", 2)]
    src.level = 2  # each level continues where it stopped
    assert src._next_prompt().index == 8


def test_a_curriculum_level_without_rows_names_it(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"prompt": "1=", "ground_truth": "1", "difficulty": 1}) + "\n")
    src = open_source(DataConfig(path=str(path), curriculum=CurriculumConfig(levels=[1, 2])))
    src.level = 2
    with pytest.raises(RowError, match="no row with 'difficulty' = 2"):
        src._next_prompt()
