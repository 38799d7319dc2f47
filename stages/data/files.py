"""Streaming readers for prompt data: JSONL, Parquet and Hugging Face ``datasets`` directories.

Guarantees:
- No reader holds a file in memory. JSONL is read line by line (its index keeps one
  byte offset per line, 8 bytes a row); Parquet one row group at a time, decoding only
  the columns asked for; a ``datasets`` directory (written by ``Dataset.save_to_disk``:
  ``state.json`` naming ``data-*.arrow`` Arrow IPC stream shards) is memory-mapped, so
  the operating system pages rows in and out. The ``datasets`` package is not needed.
- Row numbers are 1-based positions in the data (JSONL: line numbers, blank lines
  included; a directory counts across its shards in ``state.json`` order). The same
  number names a row in the validation report and in logs.
- A JSONL line that is not JSON or is blank becomes a ``RowError`` in its place, so a bad
  line never shifts the numbering of the rows after it.
- ``iter_epoch(epoch, seed, shuffle)`` visits every row exactly once per epoch, in a
  seeded order that depends only on (seed, epoch): a permutation of all rows for JSONL
  and ``datasets`` directories; for Parquet the row groups in a permuted order and the
  rows of each group permuted (one group decoded at a time).
- Errors that concern the path itself raise ``FileNotFoundError``/``ValueError`` whose
  message names ``data.path``.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

# Rows decoded per batch while scanning Arrow and Parquet data.
SCAN_BATCH_ROWS = 1024
# A JSONL file's columns are the keys of its first JSON object within this many lines.
_PEEK_LINES = 100


class RowError(ValueError):
    """A data row is unusable; ``reason`` is the counter key, the message names the row."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class JsonlRows:
    """A JSONL file: one JSON object per line; ``columns`` are the first object's keys."""

    kind = "jsonl"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = path.name
        self.columns: list[str] = self._peek_columns()
        self._offsets: array | None = None  # byte offset of each line, built by ``index``

    def _peek_columns(self) -> list[str]:
        """The keys of the first JSON object among the first lines (JSONL has no schema)."""
        with self.path.open("rb") as fh:
            for number, line in enumerate(fh, start=1):
                if number > _PEEK_LINES:
                    break
                row = self._parse(line, number)
                if isinstance(row, dict):
                    return [str(k) for k in row]
        return []

    def scan(self, columns: Sequence[str] | None = None) -> Iterator[tuple[int, Any]]:
        """(row number, row or ``RowError``) in file order."""
        with self.path.open("rb") as fh:
            for number, line in enumerate(fh, start=1):
                yield number, self._parse(line, number)

    def index(self) -> int:
        """Record each line's byte offset (no JSON parsing); return the number of rows."""
        offsets = array("Q")
        pos = 0
        with self.path.open("rb") as fh:
            for line in fh:
                offsets.append(pos)
                pos += len(line)
        self._offsets = offsets
        return len(offsets)

    def iter_epoch(
        self, epoch: int, seed: int, shuffle: bool, columns: Sequence[str] | None = None
    ) -> Iterator[tuple[int, Any]]:
        if self._offsets is None:
            self.index()
        assert self._offsets is not None
        order = draw_order(len(self._offsets), (seed, epoch), shuffle)
        with self.path.open("rb") as fh:
            for i in order:
                fh.seek(self._offsets[i])
                yield int(i) + 1, self._parse(fh.readline(), int(i) + 1)

    def _parse(self, line: bytes, number: int) -> Any:
        if not line.strip():
            return RowError("empty", f"{self.name} row {number}: empty line")
        try:
            return json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
            return RowError("malformed", f"{self.name} row {number}: not valid JSON ({reason})")


class ParquetRows:
    """A Parquet file, read one row group at a time."""

    kind = "parquet"

    def __init__(self, path: Path) -> None:
        import pyarrow.parquet as pq

        self.path = path
        self.name = path.name
        try:
            self._file = pq.ParquetFile(path)
        except Exception as exc:  # pyarrow raises ArrowInvalid and friends for a bad file
            raise ValueError(f"data.path: {str(path)!r} is not a readable Parquet file ({exc})") from None
        self.columns: list[str] = list(self._file.schema_arrow.names)
        meta = self._file.metadata
        self._group_rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        self._group_start = np.concatenate([[0], np.cumsum(self._group_rows)]).astype(np.int64)

    def scan(self, columns: Sequence[str] | None = None) -> Iterator[tuple[int, Any]]:
        number = 0
        for batch in self._file.iter_batches(batch_size=SCAN_BATCH_ROWS, columns=_present(columns, self.columns)):
            for row in batch.to_pylist():
                number += 1
                yield number, row

    def index(self) -> int:
        return int(self._group_start[-1])

    def iter_epoch(
        self, epoch: int, seed: int, shuffle: bool, columns: Sequence[str] | None = None
    ) -> Iterator[tuple[int, Any]]:
        groups = draw_order(len(self._group_rows), (seed, epoch), shuffle)
        for g in groups:
            rows = self._file.read_row_group(int(g), columns=_present(columns, self.columns)).to_pylist()
            start = int(self._group_start[g])
            for i in draw_order(len(rows), (seed, epoch, int(g) + 1), shuffle):
                yield start + int(i) + 1, rows[i]


class ArrowDirRows:
    """A directory written by ``datasets``' ``Dataset.save_to_disk``, memory-mapped."""

    kind = "datasets"

    def __init__(self, path: Path) -> None:
        import pyarrow as pa

        self.path = path
        self.name = path.name
        shards = list_arrow_shards(path)
        tables = []
        for shard in shards:
            try:
                tables.append(pa.ipc.open_stream(pa.memory_map(str(shard), "r")).read_all())
            except Exception as exc:  # ArrowInvalid: not an IPC stream
                raise ValueError(f"data.path: {str(shard)!r} is not an Arrow stream file ({exc})") from None
        self._table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        self.columns: list[str] = list(self._table.column_names)

    def scan(self, columns: Sequence[str] | None = None) -> Iterator[tuple[int, Any]]:
        table = self._table.select(_present(columns, self.columns)) if columns is not None else self._table
        number = 0
        for batch in table.to_batches(max_chunksize=SCAN_BATCH_ROWS):
            for row in batch.to_pylist():
                number += 1
                yield number, row

    def index(self) -> int:
        return self._table.num_rows

    def iter_epoch(
        self, epoch: int, seed: int, shuffle: bool, columns: Sequence[str] | None = None
    ) -> Iterator[tuple[int, Any]]:
        table = self._table.select(_present(columns, self.columns)) if columns is not None else self._table
        for i in draw_order(table.num_rows, (seed, epoch), shuffle):
            yield int(i) + 1, table.slice(int(i), 1).to_pylist()[0]


class ShardedRows:
    """Several JSONL or Parquet files of one split (``data.path`` a glob such as
    ``train-*.parquet``, as a Hub dataset's shards are), read as one: row numbers run on
    across the shards in name order; an epoch visits the shards in a seeded order and
    each shard's rows in its own seeded order."""

    def __init__(self, shards: list[JsonlRows | ParquetRows], name: str) -> None:
        self.shards = shards
        self.name = name
        self.kind = shards[0].kind
        self.columns: list[str] = shards[0].columns
        self._starts: list[int] | None = None

    def scan(self, columns: Sequence[str] | None = None) -> Iterator[tuple[int, Any]]:
        start = 0
        for shard in self.shards:
            last = 0
            for last, row in shard.scan(columns):
                yield start + last, row
            start += last

    def index(self) -> int:
        counts = [shard.index() for shard in self.shards]
        self._starts = [sum(counts[:i]) for i in range(len(counts))]
        return sum(counts)

    def iter_epoch(
        self, epoch: int, seed: int, shuffle: bool, columns: Sequence[str] | None = None
    ) -> Iterator[tuple[int, Any]]:
        if self._starts is None:
            self.index()
        assert self._starts is not None
        for s in draw_order(len(self.shards), (seed, epoch), shuffle):
            for number, row in self.shards[int(s)].iter_epoch(epoch, seed * len(self.shards) + int(s), shuffle, columns):
                yield self._starts[int(s)] + number, row


DataRows = JsonlRows | ParquetRows | ArrowDirRows | ShardedRows


def open_data(path: str | Path) -> DataRows:
    """The reader for ``data.path``: a ``.parquet`` file, a ``save_to_disk`` directory,
    a glob over one split's shards (``train-*.parquet``), or any other file as JSONL.
    Raises ``FileNotFoundError``/``ValueError`` naming ``data.path``."""
    p = Path(path).expanduser()
    if "*" in p.name:
        files = sorted(f for f in p.parent.glob(p.name) if f.is_file())
        if not files:
            raise FileNotFoundError(f"data.path: no file matches {str(path)!r}")
        if len({f.suffix for f in files}) > 1:
            raise ValueError(f"data.path: {str(path)!r} matches files of several kinds ({files[0].name}, ...)")
        return ShardedRows([_open_file(f) for f in files], p.name)
    if p.is_dir():
        return ArrowDirRows(p)
    if not p.is_file():
        raise FileNotFoundError(f"data.path: {str(path)!r} does not exist (expected a JSONL or Parquet file, "
                                f"or a directory written by datasets' save_to_disk)")
    return _open_file(p)


def _open_file(p: Path) -> JsonlRows | ParquetRows:
    return ParquetRows(p) if p.suffix == ".parquet" else JsonlRows(p)


def list_arrow_shards(path: Path) -> list[Path]:
    """The ``data-*.arrow`` files of a ``save_to_disk`` directory, in ``state.json`` order."""
    if (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        except (OSError, ValueError):
            splits = []
        raise ValueError(
            f"data.path: {str(path)!r} holds several splits ({', '.join(map(str, splits))}); "
            f"point data.path at one of them, e.g. {str(path / (splits[0] if splits else 'train'))!r}"
        )
    state_file = path / "state.json"
    if not state_file.is_file():
        raise ValueError(
            f"data.path: {str(path)!r} is a directory without state.json; expected a directory "
            f"written by datasets' Dataset.save_to_disk, or a JSONL/Parquet file"
        )
    try:
        state = json.loads(state_file.read_text())
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"data.path: {str(state_file)!r} does not list the data files (_data_files): {exc}") from None
    if state.get("_indices_data_files"):
        raise ValueError(
            f"data.path: {str(path)!r} keeps an indices mapping; save it again after "
            f"dataset.flatten_indices() so its rows are stored in order"
        )
    if not names:
        raise ValueError(f"data.path: {str(path)!r} lists no data files in state.json")
    shards = [path / name for name in names]
    missing = [s.name for s in shards if not s.is_file()]
    if missing:
        raise FileNotFoundError(f"data.path: {str(path)!r} is missing {', '.join(missing)} listed in state.json")
    return shards


def draw_order(n: int, key: Sequence[int], shuffle: bool) -> np.ndarray:
    """Positions 0..n-1: in order, or a permutation seeded by ``key`` (seed, epoch[, group])."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return np.random.default_rng(list(key)).permutation(n)


def _present(columns: Sequence[str] | None, available: Sequence[str] | None) -> list[str] | None:
    """The asked-for columns the data has (all of them when none are asked for)."""
    if columns is None or available is None:
        return None
    return [c for c in dict.fromkeys(columns) if c in available]
