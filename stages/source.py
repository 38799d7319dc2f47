"""The source stage: prompt rows from a built-in task or a local JSONL/Parquet file.

Guarantees:
- a row that is empty, malformed or longer than ``data.max_prompt_len`` tokens is
  skipped with a counted reason and a log line naming the row; the run goes on;
- prompts enter the pipeline only when the controller's ledger grants room, so a run
  never produces more prompts than it will train (plus replacements for drops);
- every ``PromptBatch`` carries the optimizer step it is destined for, which the
  rollout uses for its staleness gate.
File datasets are cycled (reshuffled each epoch when ``data.shuffle``) until the run has
what it needs; task datasets are endless.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from pipeline.types import Prompt, PromptBatch


class RowError(ValueError):
    """A data row is unusable; ``reason`` is the counter key, the message names the row."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def read_file_rows(path: Path) -> list[Any]:
    """All rows of a JSONL or Parquet file; a JSONL line that is not JSON becomes a
    ``RowError`` in its place (so row numbers stay those of the file)."""
    if not path.is_file():
        raise FileNotFoundError(f"data.path: {str(path)!r} is not a file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    rows: list[Any] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                rows.append(RowError("empty", f"{path.name} row {lineno}: empty line"))
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                rows.append(RowError("malformed", f"{path.name} row {lineno}: not valid JSON ({exc.msg})"))
    return rows


def validate_row(row: Any, where: str, max_len: int, count_tokens: Callable[[str], int]) -> dict[str, Any]:
    """Check one row's fields; return it normalised or raise ``RowError``."""
    if isinstance(row, RowError):
        raise row
    if not isinstance(row, dict):
        raise RowError("malformed", f"{where}: expected an object with a 'prompt' field, got {type(row).__name__}")
    prompt = row.get("prompt")
    if not isinstance(prompt, str):
        raise RowError("malformed", f"{where}: field 'prompt' must be a string, got {type(prompt).__name__}")
    if not prompt.strip():
        raise RowError("empty", f"{where}: field 'prompt' is empty")
    extra = row.get("extra_info") or {}
    if not isinstance(extra, dict):
        raise RowError("malformed", f"{where}: field 'extra_info' must be an object, got {type(extra).__name__}")
    source = row.get("data_source") or ""
    if not isinstance(source, str):
        raise RowError("malformed", f"{where}: field 'data_source' must be a string, got {type(source).__name__}")
    n = count_tokens(prompt)
    if n > max_len:
        raise RowError("over_length", f"{where}: prompt has {n} tokens, data.max_prompt_len is {max_len}")
    return {"prompt": prompt, "ground_truth": row.get("ground_truth"), "data_source": source, "extra_info": extra}


def iter_file_rows(rows: list[Any], name: str, seed: int, shuffle: bool) -> Iterator[tuple[str, int, Any]]:
    """Endless (where, index, row), cycling epochs; ``where`` names the file and row."""
    rng = random.Random(seed)
    order = list(range(len(rows)))
    epoch = 0
    while order:
        if shuffle:
            rng.shuffle(order)
        for i in order:
            yield f"{name} row {i + 1}", i + epoch * len(rows), rows[i]
        epoch += 1


class PromptSource:
    """Source core. ``rows`` (a list of dicts) may be passed directly, for custom graphs."""

    def __init__(self, rows: list[dict[str, Any]] | None = None) -> None:
        self._rows = rows
        self.skipped: Counter[str] = Counter()
        self.emitted_prompts = 0

    async def setup(self, ctx: Any) -> None:
        from stages.tiny import resolve_model_path

        self.ctx = ctx
        cfg = ctx.config
        self.data = cfg.data
        self.per_batch = cfg.dataflow.prompts_per_micro_batch
        model_path = resolve_model_path(cfg.model)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
        self._count_tokens = lambda text: len(tok(text, add_special_tokens=True)["input_ids"])
        self._rows_iter = self._build_rows(cfg.run.seed)

    def _build_rows(self, seed: int) -> Iterator[tuple[str, int, Any]]:
        if self._rows is not None:
            return iter_file_rows(list(self._rows), "rows", seed, self.data.shuffle)
        if self.data.path:
            path = Path(self.data.path).expanduser()
            return iter_file_rows(read_file_rows(path), path.name, seed, self.data.shuffle)
        from stages.tasks import load_task

        task = load_task(self.data.task, **self.data.task_kwargs)
        if hasattr(task, "iter_rows"):
            rows = task.iter_rows(seed)
        else:
            rows = iter(task.generate_rows(seed, self.data.num_prompts or 100_000))
        return ((f"task {self.data.task} row {i + 1}", i, row) for i, row in enumerate(rows))

    def _next_prompt(self) -> Prompt:
        """The next valid row as a ``Prompt`` (ids stay unique when a file is cycled)."""
        run_of_skips = 0
        for where, index, row in self._rows_iter:
            try:
                clean = validate_row(row, where, self.data.max_prompt_len, self._count_tokens)
            except RowError as err:
                self.skipped[err.reason] += 1
                self.ctx.log.warning("row_skipped", reason=err.reason, detail=str(err))
                run_of_skips += 1
                if run_of_skips > 10_000:
                    break
                continue
            return Prompt(prompt_id=f"p{index}", index=index, text=clean["prompt"],
                          ground_truth=clean["ground_truth"], data_source=clean["data_source"],
                          extra_info=clean["extra_info"])
        raise RowError("exhausted", f"data: no valid rows left (skipped so far: {dict(self.skipped)})")

    async def generate(self) -> AsyncIterator[PromptBatch]:
        batch_id = 0
        while True:
            want = self.per_batch
            granted, step = await self.ctx.controller.admit_prompts.remote(want)
            if granted == 0:
                return
            prompts = [self._next_prompt() for _ in range(granted)]
            self.emitted_prompts += len(prompts)
            yield PromptBatch(batch_id=batch_id, step=step, prompts=prompts)
            batch_id += 1

    def status(self) -> dict[str, Any]:
        return {"prompts": self.emitted_prompts, "skipped": dict(self.skipped)}

    def result(self) -> dict[str, Any]:
        return self.status()
