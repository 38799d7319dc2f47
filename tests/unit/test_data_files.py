"""Streaming readers: JSONL, Parquet and datasets directories keep file row numbers,
read only the asked-for columns, and visit every row once per epoch."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stages.data.files import ArrowDirRows, JsonlRows, ParquetRows, RowError, draw_order, open_data


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def write_datasets_dir(path, shards, split=None):
    """The layout ``Dataset.save_to_disk`` writes: Arrow IPC *stream* shards named in
    state.json, plus dataset_info.json."""
    path.mkdir(parents=True)
    names = []
    for i, table in enumerate(shards):
        name = f"data-{i:05d}-of-{len(shards):05d}.arrow"
        with pa.OSFile(str(path / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        names.append({"filename": name})
    state = {"_data_files": names, "_fingerprint": "0", "_format_columns": None, "_format_kwargs": {},
             "_format_type": None, "_output_all_columns": False, "_split": split}
    (path / "state.json").write_text(json.dumps(state))
    (path / "dataset_info.json").write_text(json.dumps({"features": {}}))
    return path


def test_jsonl_scan_keeps_line_numbers_for_bad_and_blank_lines(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"prompt": "a", "ground_truth": "1"}), "{not json", "",
                                              json.dumps({"prompt": "b"})])
    data = open_data(path)
    assert isinstance(data, JsonlRows)
    assert data.columns == ["prompt", "ground_truth"]  # the first object's keys
    rows = list(data.scan())
    assert [n for n, _ in rows] == [1, 2, 3, 4]
    assert rows[0][1] == {"prompt": "a", "ground_truth": "1"}
    assert isinstance(rows[1][1], RowError) and rows[1][1].reason == "malformed"
    assert "d.jsonl row 2: not valid JSON" in str(rows[1][1])
    assert isinstance(rows[2][1], RowError) and rows[2][1].reason == "empty"
    assert rows[3] == (4, {"prompt": "b"})


def test_jsonl_epochs_visit_every_line_once_by_offset(tmp_path):
    lines = [json.dumps({"prompt": f"p{i}"}) for i in range(7)]
    data = open_data(write_jsonl(tmp_path / "d.jsonl", lines))
    assert data.index() == 7
    first = list(data.iter_epoch(0, seed=3, shuffle=True))
    assert sorted(n for n, _ in first) == list(range(1, 8))
    # each row read back by its byte offset is the line with that number
    assert all(row == {"prompt": f"p{n - 1}"} for n, row in first)
    assert [n for n, _ in data.iter_epoch(0, seed=3, shuffle=True)] == [n for n, _ in first]  # seeded
    assert [n for n, _ in data.iter_epoch(0, seed=3, shuffle=False)] == list(range(1, 8))


def test_parquet_reads_row_groups_and_only_asked_columns(tmp_path):
    path = tmp_path / "d.parquet"
    table = pa.table({"q": [f"x{i}" for i in range(10)], "a": [str(i) for i in range(10)], "big": ["z" * 5] * 10})
    pq.write_table(table, path, row_group_size=4)  # groups of 4, 4, 2 rows
    data = open_data(path)
    assert isinstance(data, ParquetRows)
    assert data.columns == ["q", "a", "big"]
    assert data.index() == 10
    scanned = list(data.scan(["q", "a", "absent"]))
    assert scanned[0] == (1, {"q": "x0", "a": "0"})  # "big" is not decoded, "absent" ignored
    assert [n for n, _ in scanned] == list(range(1, 11))
    epoch = list(data.iter_epoch(1, seed=0, shuffle=True, columns=["q"]))
    assert sorted(n for n, _ in epoch) == list(range(1, 11))
    assert all(row == {"q": f"x{n - 1}"} for n, row in epoch)  # row numbers survive the shuffle


def test_datasets_dir_reads_shards_in_state_order(tmp_path):
    shards = [pa.table({"prompt": ["a", "b"], "ground_truth": ["1", "2"]}),
              pa.table({"prompt": ["c"], "ground_truth": ["3"]})]
    data = open_data(write_datasets_dir(tmp_path / "ds", shards))
    assert isinstance(data, ArrowDirRows)
    assert data.columns == ["prompt", "ground_truth"]
    assert data.index() == 3
    assert list(data.scan(["prompt"])) == [(1, {"prompt": "a"}), (2, {"prompt": "b"}), (3, {"prompt": "c"})]
    epoch = dict(data.iter_epoch(0, seed=1, shuffle=True))
    assert epoch == {1: {"prompt": "a", "ground_truth": "1"}, 2: {"prompt": "b", "ground_truth": "2"},
                     3: {"prompt": "c", "ground_truth": "3"}}


def test_datasets_dict_root_asks_for_a_split(tmp_path):
    root = tmp_path / "dd"
    write_datasets_dir(root / "train", [pa.table({"prompt": ["a"]})], split="train")
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(ValueError, match=r"data.path: .* holds several splits \(train, test\); point data.path at one"):
        open_data(root)
    assert open_data(root / "train").index() == 1


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p, "does not exist"),
        (lambda p: (p.mkdir(), p)[1], "a directory without state.json"),
        (lambda p: (p.write_bytes(b"not parquet"), p)[1], "is not a readable Parquet file"),
    ],
)
def test_bad_paths_name_data_path(tmp_path, make, message):
    path = make(tmp_path / "x.parquet")
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        open_data(path)
    assert str(info.value).startswith("data.path: ") and message in str(info.value)


def test_draw_order_is_a_seeded_permutation():
    a = draw_order(50, (7, 0), shuffle=True)
    assert sorted(a.tolist()) == list(range(50))
    assert a.tolist() == draw_order(50, (7, 0), shuffle=True).tolist()
    assert a.tolist() != draw_order(50, (7, 1), shuffle=True).tolist()  # a new order each epoch
    assert draw_order(4, (7, 0), shuffle=False).tolist() == [0, 1, 2, 3]
