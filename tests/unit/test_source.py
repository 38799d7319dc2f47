"""Source rows: malformed, empty and over-long rows are refused with a named reason."""

from __future__ import annotations

import json

import pytest

from stages.source import RowError, iter_file_rows, read_file_rows, validate_row


def count_chars(text: str) -> int:
    return len(text) + 1  # a char tokenizer plus <bos>


@pytest.mark.parametrize(
    ("row", "reason", "text"),
    [
        ({"prompt": ""}, "empty", "field 'prompt' is empty"),
        ({"prompt": 5}, "malformed", "field 'prompt' must be a string, got int"),
        ({"text": "hi"}, "malformed", "field 'prompt' must be a string, got NoneType"),
        ([1, 2], "malformed", "expected an object"),
        ({"prompt": "x" * 10}, "over_length", "prompt has 11 tokens, data.max_prompt_len is 8"),
        ({"prompt": "ok", "extra_info": 3}, "malformed", "field 'extra_info' must be an object"),
    ],
)
def test_bad_rows_name_row_and_reason(row, reason, text):
    with pytest.raises(RowError) as info:
        validate_row(row, "data.jsonl row 7", 8, count_chars)
    assert info.value.reason == reason
    assert "data.jsonl row 7" in str(info.value) and text in str(info.value)


def test_good_row_is_normalised():
    row = validate_row({"prompt": "12=", "ground_truth": "1"}, "r", 8, count_chars)
    assert row == {"prompt": "12=", "ground_truth": "1", "data_source": "", "extra_info": {}}


def test_jsonl_keeps_row_numbers_for_bad_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "a"}) + "\n{not json\n\n" + json.dumps({"prompt": "b"}) + "\n")
    rows = read_file_rows(path)
    assert len(rows) == 4
    assert isinstance(rows[1], RowError) and "d.jsonl row 2: not valid JSON" in str(rows[1])
    assert isinstance(rows[2], RowError) and rows[2].reason == "empty"


def test_parquet_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "ground_truth": ["1", "2"]}), path)
    assert [r["prompt"] for r in read_file_rows(path)] == ["a", "b"]


def test_file_rows_cycle_with_unique_indices():
    it = iter_file_rows([{"prompt": "a"}, {"prompt": "b"}], "f", seed=0, shuffle=True)
    seen = [next(it) for _ in range(6)]
    assert sorted(i for _, i, _ in seen) == [0, 1, 2, 3, 4, 5]  # ids stay unique across epochs
    assert {r["prompt"] for _, _, r in seen} == {"a", "b"}
