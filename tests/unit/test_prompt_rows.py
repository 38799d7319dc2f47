"""Prompt rows: column mapping, chat templates and the whole-file validation report."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import ConfigError, DataConfig
from stages.data.files import RowError, open_data
from stages.data.prompt_rows import (
    ColumnMap,
    PromptRenderer,
    check_data_file,
    extract_row,
    render_rows,
    resolve_columns,
    scan_data,
)
from stages.models.tiny import build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizers():
    return {arch: build_char_tokenizer(arch) for arch in ("llama", "qwen2", "gemma3")}


def render_one(tok, prompt, mode="auto", max_len=64, model="/models/m"):
    renderer = PromptRenderer(tok, mode, model, max_len)
    [(_, _, out)] = render_rows([(0, "d.jsonl row 1", {"prompt": prompt})], ColumnMap(), renderer)
    return out


# ------------------------------------------------------------------ column mapping

def test_prompt_column_falls_back_to_messages_only_for_the_default_key():
    assert resolve_columns(["messages", "ground_truth"], "prompt", "ground_truth", "f").prompt == "messages"
    assert resolve_columns(["prompt", "messages"], "prompt", "ground_truth", "f").prompt == "prompt"
    with pytest.raises(ConfigError) as info:
        resolve_columns(["question", "answer"], "query", "ground_truth", "f.jsonl")
    assert str(info.value).startswith("data.prompt_key: f.jsonl has no column 'query'")
    assert "its columns: question, answer" in str(info.value)


def test_answer_column_mapping():
    assert resolve_columns(["q", "sol"], "q", "sol", "f").answer == ("sol",)
    assert resolve_columns(["q", "rm"], "q", "rm.gt", "f").answer == ("rm", "gt")  # dotted: nested key
    # verl's layout, found when answer_key is left at its default
    assert resolve_columns(["prompt", "reward_model"], "prompt", "ground_truth", "f").answer == (
        "reward_model", "ground_truth")
    assert resolve_columns(["prompt"], "prompt", "ground_truth", "f").answer == ()  # no answer: None
    with pytest.raises(ConfigError, match=r"^data.answer_key: f has no column 'solution' \(its columns: prompt\)"):
        resolve_columns(["prompt"], "prompt", "solution", "f")


@pytest.mark.parametrize(
    ("row", "reason", "text"),
    [
        ({"prompt": ""}, "empty", "field 'prompt' is empty"),
        ({"prompt": 5}, "malformed", "field 'prompt' must be a string or a list of chat messages, got int"),
        ({"text": "hi"}, "malformed", "no field 'prompt' (fields: text)"),
        ([1, 2], "malformed", "expected an object"),
        ({"prompt": []}, "empty", "empty list of messages"),
        ({"prompt": [{"role": "user"}]}, "malformed", "prompt[0] must be an object with string 'role' and 'content'"),
        ({"prompt": [{"role": "user", "content": " "}]}, "empty", "every message of field 'prompt' is empty"),
        ({"prompt": "ok", "extra_info": 3}, "malformed", "field 'extra_info' must be an object"),
        ({"prompt": "ok", "data_source": 3}, "malformed", "field 'data_source' must be a string"),
    ],
)
def test_bad_rows_name_row_and_reason(row, reason, text):
    with pytest.raises(RowError) as info:
        extract_row(row, ColumnMap(), "data.jsonl row 7")
    assert info.value.reason == reason
    assert "data.jsonl row 7" in str(info.value) and text in str(info.value)


def test_good_rows_are_normalised():
    assert extract_row({"prompt": "12=", "ground_truth": "1"}, ColumnMap(), "r") == {
        "prompt": "12=", "ground_truth": "1", "data_source": "", "extra_info": {}}
    verl_row = {"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"},
                "data_source": "gsm8k", "extra_info": {"i": 4}}
    out = extract_row(verl_row, ColumnMap("prompt", ("reward_model", "ground_truth")), "r")
    assert out == {"prompt": [{"role": "user", "content": "1+1?"}], "ground_truth": "2", "data_source": "gsm8k",
                   "extra_info": {"i": 4}}


# ------------------------------------------------------------------ chat templates

def test_plain_prompt_stays_raw_text_with_the_tokenizers_bos(tokenizers):
    out = render_one(tokenizers["llama"], "12=")
    # llama char vocab: <pad> 0, <bos> 1, <eos> 2, <unk> 3, then "0".."9" -> 4..13, "=" -> 70
    assert out["text"] == "12=" and out["token_ids"] == [1, 5, 6, 70]
    # qwen2 has no BOS: nothing is prepended
    assert render_one(tokenizers["qwen2"], "12=")["token_ids"] == [5, 6, 70]


def test_chat_rows_get_the_template_and_the_generation_prompt(tokenizers):
    out = render_one(tokenizers["qwen2"], [{"role": "user", "content": "12="}])
    assert out["text"] == "<|im_start|>user\n12=<|im_end|>\n<|im_start|>assistant\n"
    # <|im_start|> 1, <|im_end|> 2; a..z -> 14..39, "\n" -> 67, "1" 5, "2" 6, "=" 70; no BOS added
    user, assistant = [34, 32, 18, 31], [14, 32, 32, 22, 32, 33, 14, 27, 33]
    assert out["token_ids"] == [1, *user, 67, 5, 6, 70, 2, 67, 1, *assistant, 67]


def test_a_template_that_writes_bos_gets_exactly_one(tokenizers):
    tok = tokenizers["gemma3"]
    out = render_one(tok, [{"role": "user", "content": "hi"}])
    assert out["text"].startswith("<bos><start_of_turn>user\nhi")
    assert out["token_ids"].count(tok.bos_token_id) == 1 and out["token_ids"][0] == tok.bos_token_id


def test_max_prompt_len_counts_template_tokens(tokenizers):
    chat = [{"role": "user", "content": "12="}]
    assert "token_ids" in render_one(tokenizers["qwen2"], chat, max_len=22)  # 22 ids, as above
    err = render_one(tokenizers["qwen2"], chat, max_len=21)
    assert isinstance(err, RowError) and err.reason == "over_length"
    assert "prompt has 22 tokens, data.max_prompt_len is 21" in str(err)


def test_chat_rows_without_a_template_are_a_config_error_naming_the_model(tokenizers):
    with pytest.raises(ConfigError) as info:
        render_one(tokenizers["llama"], [{"role": "user", "content": "hi"}], model="/ckpt/base-llama")
    assert str(info.value).startswith("data.chat_template: the tokenizer of /ckpt/base-llama has no chat template")
    with pytest.raises(ConfigError, match=r"^data.chat_template: 'none' cannot render chat messages"):
        render_one(tokenizers["qwen2"], [{"role": "user", "content": "hi"}], mode="none")


def test_a_template_that_raises_skips_the_row():
    tok = build_char_tokenizer("qwen2")
    tok.chat_template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}x"
    err = render_one(tok, [{"role": "system", "content": "be brief"}])
    assert isinstance(err, RowError) and err.reason == "chat_template_error" and "no system role" in str(err)


# ------------------------------------------------------------------ validation report

def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_report_counts_every_row_by_reason_with_first_row_numbers(tmp_path, tokenizers):
    chat = {"messages": [{"role": "user", "content": "1="}], "ground_truth": "1"}
    rows = [chat, "{bad", {"messages": 5}, chat, {"messages": []}, "", chat,
            {"messages": [{"role": "user", "content": "9" * 40}]}]
    data = open_data(_jsonl(tmp_path / "c.jsonl", rows))
    cmap = resolve_columns(data.columns, "prompt", "ground_truth", data.name)
    report = scan_data(data, cmap, PromptRenderer(tokenizers["qwen2"], "auto", "m", 32))
    # rows 1, 4, 7 usable; 2 (not JSON) and 3 (a number) malformed; 5 and 6 empty;
    # 8 has 40 digits + 19 template ids (6 + 2 + 11) = 59 > 32 tokens
    assert (report.rows_total, report.rows_usable, report.chat_rows) == (8, 3, 3)
    assert report.skipped == {"malformed": 2, "empty": 2, "over_length": 1}
    assert report.first_rows == {"malformed": [2, 3], "empty": [5, 6], "over_length": [8]}
    assert report.to_summary() == {
        "data/rows_total": 8, "data/rows_usable": 3,
        "data/rows_skipped/empty": 2, "data/rows_skipped_first/empty": [5, 6],
        "data/rows_skipped/malformed": 2, "data/rows_skipped_first/malformed": [2, 3],
        "data/rows_skipped/over_length": 1, "data/rows_skipped_first/over_length": [8],
    }
    text = report.describe()
    assert "c.jsonl (jsonl): 8 rows, 3 usable (3 chat); prompt column 'messages', answer 'ground_truth'" in text
    assert "skipped 2 malformed (rows 2, 3); first: c.jsonl row 2: not valid JSON" in text
    assert "skipped 1 over_length (row 8)" in text


def test_a_chat_column_holding_a_string_is_a_malformed_row_not_a_plain_prompt():
    chat = ColumnMap(prompt="messages")
    with pytest.raises(RowError) as info:
        extract_row({"messages": "1="}, chat, "c.jsonl row 2")
    assert info.value.reason == "malformed"
    assert str(info.value).startswith("c.jsonl row 2: field 'messages' must be a list of chat messages")
    # A column of another name may mix plain and chat prompts, as before.
    assert extract_row({"prompt": "1="}, ColumnMap(), "r")["prompt"] == "1="


def test_report_names_a_chat_row_holding_a_string(tmp_path, tokenizers):
    chat = {"messages": [{"role": "user", "content": "1="}], "ground_truth": "1"}
    rows = [chat, {"messages": "1=", "ground_truth": "1"}, chat]
    data = open_data(_jsonl(tmp_path / "c.jsonl", rows))
    cmap = resolve_columns(data.columns, "prompt", "ground_truth", data.name)
    report = scan_data(data, cmap, PromptRenderer(tokenizers["qwen2"], "auto", "m", 32))
    # rows 1 and 3 usable; row 2 holds a string where the chat format holds a list
    assert (report.rows_total, report.rows_usable, report.chat_rows) == (3, 2, 2)
    assert report.skipped == {"malformed": 1} and report.first_rows == {"malformed": [2]}
    assert "first: c.jsonl row 2: field 'messages' must be a list of chat messages" in report.describe()


def test_report_keeps_the_first_five_row_numbers(tmp_path, tokenizers):
    data = open_data(_jsonl(tmp_path / "d.jsonl", [{"prompt": "1"}] + [{"prompt": ""}] * 7))
    report = scan_data(data, ColumnMap(), PromptRenderer(tokenizers["llama"], "auto", "m", 8))
    assert report.skipped == {"empty": 7} and report.first_rows == {"empty": [2, 3, 4, 5, 6]}
    assert "skipped 7 empty (rows 2, 3, 4, 5, 6, ...)" in report.describe()


def test_a_file_without_a_usable_row_is_refused(tmp_path, tokenizers):
    path = _jsonl(tmp_path / "bad.jsonl", [{"prompt": ""}, "{x"])
    with pytest.raises(ConfigError) as info:
        check_data_file(DataConfig(path=str(path)), tokenizers["llama"], "m")
    assert str(info.value).startswith(f"data.path: no usable row in {path}")
    assert "skipped 1 empty (row 1)" in str(info.value) and "skipped 1 malformed (row 2)" in str(info.value)


def test_verl_parquet_layout_maps_without_settings(tmp_path, tokenizers):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({
        "data_source": ["gsm8k", "gsm8k"],
        "prompt": [[{"role": "user", "content": "1+1="}], [{"role": "user", "content": "2+2="}]],
        "reward_model": [{"style": "rule", "ground_truth": "2"}, {"style": "rule", "ground_truth": "4"}],
    }), path)
    report = check_data_file(DataConfig(path=str(path)), tokenizers["qwen2"], "m")
    assert (report.rows_total, report.rows_usable, report.chat_rows) == (2, 2, 2)
    assert report.columns == ColumnMap("prompt", ("reward_model", "ground_truth"))
    data = open_data(path)
    [(_, _, row)] = render_rows([(0, "r", dict(data.iter_epoch(0, 0, False, report.columns.columns))[2])],
                                report.columns, PromptRenderer(tokenizers["qwen2"], "auto", "m", 64))
    assert row["ground_truth"] == "4" and row["data_source"] == "gsm8k"
    assert row["text"] == "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"
