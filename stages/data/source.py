"""The source stage: prompt rows from a built-in task or local data (JSONL, Parquet, a
``datasets`` directory), as ``Prompt``s carrying the token ids the model will see.

Guarantees:
- every prompt is rendered and tokenized once, here (``stages/data/prompt_rows.py``: column
  mapping, chat template, special tokens); ``Prompt.token_ids`` is what the rollout
  generates from and ``Prompt.text`` the same prompt as text;
- a row that is empty, malformed or longer than ``data.max_prompt_len`` tokens is
  skipped with a counted reason; the run goes on. Data files were validated whole
  before the run started (``pipeline/preflight.py``), so their bad rows are logged at
  debug level here, a task's at warning level;
- data is read streaming (``stages/data/files.py``), never loaded whole;
- prompts enter the pipeline only when the controller's ledger grants room, so a run
  never produces more prompts than it will train (plus replacements for drops);
- a row's generation budget (``data.max_tokens_field`` / ``min_tokens_field``) rides on
  its ``Prompt`` (``max_tokens``, ``min_tokens``) to the rollout;
- every ``PromptBatch`` carries the optimizer step it is destined for, which the
  rollout uses for its staleness gate (with ``algorithm.drop_zero_variance_groups`` no
  later than the step the trainer is on: see ``generate``).
File data is cycled (reshuffled each epoch when ``data.shuffle``, seeded by
``run.seed``) until the run has what it needs; prompt ids stay unique across epochs.
Task datasets are endless.

With ``data.curriculum`` each level's rows are cycled on their own (a row's index is its
row number plus that level's epoch times the file's rows, still unique), and a micro-batch
is drawn from the level the controller hands out with its admission (the trainer decides
it: ``stages/data/curriculum.py``); until the trainer has reported one, the start level or the
checkpoint's. Each prompt carries its level in ``extra_info[data.curriculum.key]``.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import msgspec

from pipeline.checkpoint import ConsumedPrompts
from pipeline.plugins import register_stage
from pipeline.types import Prompt, PromptBatch
from stages.data.files import RowError, open_data
from stages.data.prompt_rows import (
    ColumnMap,
    PromptRenderer,
    budget_fields,
    load_tokenizer,
    render_rows,
    resolve_columns,
)

__all__ = ["PromptSource", "RowError", "iter_list_rows"]

# Consecutive unusable rows after which the source gives up (the data has none left).
_MAX_SKIPS_IN_A_ROW = 10_000


def iter_list_rows(rows: list[Any], name: str) -> Iterator[tuple[int, str, Any]]:
    """Endless (index, where, row) over a list of rows, in order; indices stay unique."""
    for epoch in itertools.count():
        for i, row in enumerate(rows):
            yield i + epoch * len(rows), f"{name} row {i + 1}", row
        if not rows:
            return


@register_stage("source")
class PromptSource:
    """Source core. ``rows`` (a list of dicts) may be passed directly, for custom graphs."""

    gives = PromptBatch  # what it puts on its edges (pipeline/contracts.py)

    def __init__(self, rows: list[dict[str, Any]] | None = None) -> None:
        self._rows = rows
        self._done: Callable[[int], bool] | None = None  # prompt indices a resumed run skips
        self.issued = ConsumedPrompts()  # indices of every prompt issued (a resumed run's included)
        self._issued_before = 0
        self.skipped: Counter[str] = Counter()
        self.emitted_prompts = 0
        self.level: int | None = None  # the curriculum level drawn from (data.curriculum)

    async def setup(self, ctx: Any) -> None:
        importing = time.monotonic()
        from stages.models.tiny import resolve_model_path

        imported = time.monotonic()
        self.ctx = ctx
        cfg = ctx.config
        # Dynamic sampling replaces dropped prompts out of step order (see generate).
        self._current_step_only = bool(getattr(cfg.algorithm, "drop_zero_variance_groups", False))
        model_path = resolve_model_path(cfg.model)
        if cfg.run.resume_from:
            from pipeline.checkpoint import load_resume_state

            # Exactly once: prompts trained or dropped before the checkpoint are skipped,
            # the ones in flight then are issued again, in their original order.
            state = load_resume_state(cfg.run.resume_from)
            self._done = state.consumed.as_set_checker()
            # The accounting covers the whole run: what the first part issued and finished counts.
            self.issued, self._issued_before = state.consumed, state.trained_prompts + sum(state.dropped.values())
            if state.curriculum is not None:
                self.level = int(state.curriculum["level"])
        began = time.monotonic()
        tokenizer = load_tokenizer(model_path)
        opening = time.monotonic()
        self.open(cfg.data, tokenizer, model_path, cfg.run.seed, cfg.dataflow.prompts_per_micro_batch)
        # In the launch's start-up report: imports (torch, transformers), the tokenizer, the data opened.
        self.startup_phases = {"imports": imported - importing, "tokenizer": opening - began,
                               "data": time.monotonic() - opening}

    def open(self, data: Any, tokenizer: Any, model_path: Any, seed: int, per_batch: int) -> None:
        """Start reading rows (``data`` is the ``DataConfig``); prompts are rendered with
        ``tokenizer`` ``per_batch`` rows at a time."""
        self.data = data
        self.per_batch = per_batch
        renderer = PromptRenderer(tokenizer, data.chat_template, model_path, data.max_prompt_len)
        cur = getattr(data, "curriculum", None)
        if cur is not None and self._rows is None:
            self.level = cur.start if self.level is None and cur.start is not None else self.level
            self.level = cur.levels[0] if self.level is None else self.level
            self._by_level = {}
            self._open_level = lambda level: self._skip_done_and_render(
                *self._build_level_rows(seed, cur.key, level), renderer)
            return
        self._rendered = self._skip_done_and_render(*self._build_rows(seed), renderer)

    def _skip_done_and_render(self, items: Iterator[tuple[int, str, Any]], cmap: ColumnMap, renderer: Any) -> Any:
        if self._done is not None:
            done = self._done
            items = (item for item in items if not done(item[0]))
        return render_rows(items, cmap, renderer, batch=self.per_batch)

    def _build_level_rows(self, seed: int, key: str, level: int) -> tuple[Iterator[tuple[int, str, Any]], ColumnMap]:
        """Endless (prompt index, where, raw row) over the data file's rows at ``level``."""
        data = open_data(self.data.path)
        cmap = resolve_columns(data.columns, self.data.prompt_key, self.data.answer_key, data.name,
                               budget=budget_fields(self.data))
        num_rows = data.index()

        def cycle() -> Iterator[tuple[int, str, Any]]:
            for epoch in itertools.count():
                found = False
                for number, row in data.iter_epoch(epoch, seed, self.data.shuffle, [*cmap.columns, key]):
                    if isinstance(row, dict) and row.get(key) == level:
                        found = True
                        yield number - 1 + epoch * num_rows, f"{data.name} row {number}", row
                if not found:
                    raise RowError("exhausted", f"data.curriculum.levels: {data.name} has no row with "
                                                f"{key!r} = {level}")

        return cycle(), cmap

    def _build_rows(self, seed: int) -> tuple[Iterator[tuple[int, str, Any]], ColumnMap]:
        """Endless (prompt index, where, raw row) and the column mapping of the rows."""
        if self._rows is not None:
            rows = list(self._rows)
            keys = [str(k) for k in rows[0]] if rows and isinstance(rows[0], dict) else []
            return iter_list_rows(rows, "rows"), resolve_columns(keys, self.data.prompt_key, self.data.answer_key, "rows",
                                                                 budget=budget_fields(self.data))
        if self.data.path:
            data = open_data(self.data.path)
            cmap = resolve_columns(data.columns, self.data.prompt_key, self.data.answer_key, data.name,
                                   self.data.pairs, budget_fields(self.data))
            num_rows = data.index()

            def cycle() -> Iterator[tuple[int, str, Any]]:
                for epoch in itertools.count():
                    for number, row in data.iter_epoch(epoch, seed, self.data.shuffle, cmap.columns):
                        yield number - 1 + epoch * num_rows, f"{data.name} row {number}", row
                    if num_rows == 0:
                        return

            return cycle(), cmap
        from stages.data.tasks import load_task

        task = load_task(self.data.task, **self.data.task_kwargs)
        if hasattr(task, "iter_rows"):
            rows = task.iter_rows(seed)
        else:
            rows = iter(task.generate_rows(seed, self.data.num_prompts or 100_000))
        return ((i, f"task {self.data.task} row {i + 1}", row) for i, row in enumerate(rows)), ColumnMap(
            max_tokens=self.data.max_tokens_field, min_tokens=self.data.min_tokens_field)

    def _next_prompt(self) -> Prompt:
        """The next usable row as a ``Prompt``."""
        run_of_skips = 0
        rendered, extra = self._rendered_now()
        for index, where, row in rendered:
            if not isinstance(row, RowError):
                try:
                    return self._to_prompt(index, where, row, extra)
                except RowError as err:
                    row = err
            self.skipped[row.reason] += 1
            log = self.ctx.log.debug if self.data.path and self._rows is None else self.ctx.log.warning
            log("row_skipped", reason=row.reason, detail=str(row))
            run_of_skips += 1
            if run_of_skips > _MAX_SKIPS_IN_A_ROW:
                break
        raise RowError("exhausted", f"data: no usable rows left (skipped so far: {dict(self.skipped)})")

    def _to_prompt(self, index: int, where: str, row: dict[str, Any], extra: dict[str, Any]) -> Prompt:
        """A rendered row as a ``Prompt`` (``RowError``: the row is skipped with its reason)."""
        chat = row["prompt"] if isinstance(row.get("prompt"), list) else []
        return Prompt(prompt_id=f"p{index}", index=index, text=row["text"], token_ids=row["token_ids"],
                      messages=chat, ground_truth=row["ground_truth"], data_source=row["data_source"],
                      extra_info={**row["extra_info"], **extra}, max_tokens=row.get("max_tokens"),
                      min_tokens=row.get("min_tokens"))

    def _rendered_now(self) -> tuple[Iterator[tuple[int, str, Any]], dict[str, Any]]:
        """The rendered rows to draw from now, and what each prompt's ``extra_info`` gains."""
        if self.level is None or self._rows is not None:
            return self._rendered, {}
        if self.level not in self._by_level:
            self._by_level[self.level] = self._open_level(self.level)
        return self._by_level[self.level], {self.data.curriculum.key: self.level}

    async def generate(self) -> AsyncIterator[PromptBatch]:
        batch_id = 0
        while True:
            want = self.per_batch
            if self.level is not None:
                granted, step, level = await self.ctx.controller.admit_prompts_at_level(want)
                self.level = self.level if level is None else level
            else:
                granted, step = await self.ctx.controller.admit_prompts(want)
            if granted == 0:
                return
            if getattr(self, "_current_step_only", False):
                # With groups dropped at the reward stage a prompt's step is unknown until
                # its group is kept, and replacements for step k are admitted after prompts
                # tagged k + 1, k + 2: a rollout holding those for versions that only step k's
                # replacements can produce would wait forever. Tag the step being trained:
                # generation never waits; the trainer's staleness gate still bounds it.
                step = min(step, await self.ctx.controller.trainer_version())
            prompts = [self._next_prompt() for _ in range(granted)]
            self.emitted_prompts += len(prompts)
            self.issued.add(p.index for p in prompts)
            yield PromptBatch(batch_id=batch_id, step=step, prompts=prompts)
            batch_id += 1

    def status(self) -> dict[str, Any]:
        level = {} if self.level is None else {"curriculum_level": self.level}
        return {"prompts": self.emitted_prompts, "skipped": dict(self.skipped), **level}

    def result(self) -> dict[str, Any]:
        """Status plus this source's own account of the prompts it issued (indices and
        count), which the driver checks against the trainer's (``reconcile_prompt_ids``)."""
        return {**self.status(), "issued": msgspec.to_builtins(self.issued),
                "issued_count": self._issued_before + self.emitted_prompts}
