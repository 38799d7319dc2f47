"""Prompt rows: from a data row to the exact token ids the model sees, and the report
that validates a whole data file before a run starts.

The prompt is ``row[data.prompt_key]`` (a string, or OpenAI-format chat messages), the
answer ``row[data.answer_key]`` (dotted keys read nested objects, as in verl);
``data.chat_template`` (``auto`` or ``none``) says how chat rows are rendered. Column
fallbacks and rendering rules: docs/architecture.md, "Prompt rows".

Guarantees:
- ``Prompt.token_ids`` are computed once here and are what the model sees;
  ``data.max_prompt_len`` counts them; a plain prompt is never wrapped in a chat turn;
- a per-row generation budget (``data.max_tokens_field`` / ``min_tokens_field``) is a
  whole number or null; anything else makes the row ``malformed``, named;
- a column the config names but the data lacks is a ``ConfigError`` listing the
  columns the data has; chat rows without a usable chat template are a ``ConfigError``
  naming ``data.chat_template`` and the model path;
- ``scan_data`` reads every row once, streaming, and counts it usable or under one skip
  reason (``empty``, ``malformed``, ``over_length``, ``chat_template_error``) with its
  row number: usable + skipped = total.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config import ConfigError, DataConfig
from stages.data.files import SCAN_BATCH_ROWS, DataRows, RowError, open_data

# Row numbers kept per skip reason in the report (the first ones met).
FIRST_ROWS_SHOWN = 5
DATA_SOURCE, EXTRA_INFO = "data_source", "extra_info"
CHAT_COLUMN = "messages"  # the OpenAI chat format's column: it holds lists of messages only


@dataclass(frozen=True)
class ColumnMap:
    """Where a row keeps its prompt and answer; ``answer`` is a key path, () for none."""

    prompt: str = "prompt"
    answer: tuple[str, ...] = ("ground_truth",)
    pair: tuple[str, ...] = ()  # (chosen, rejected) columns of preference pairs (data.pairs)
    max_tokens: str | None = None  # data.max_tokens_field: the row's generation budget
    min_tokens: str | None = None  # data.min_tokens_field

    @property
    def columns(self) -> list[str]:
        """The columns to read (Parquet and Arrow readers decode only these)."""
        budget = [c for c in dict.fromkeys((self.max_tokens, self.min_tokens)) if c is not None]
        return [self.prompt, *self.answer[:1], *self.pair, *budget, DATA_SOURCE, EXTRA_INFO]


def resolve_columns(available: Sequence[str], prompt_key: str, answer_key: str, name: str,
                    pairs: Any = None, budget: tuple[str | None, str | None] = (None, None),
                    section: str = "data") -> ColumnMap:
    """The ``ColumnMap`` for data with ``available`` columns; see the module rules.
    ``pairs`` (``data.pairs``): rows also hold a chosen and a rejected response.
    ``budget``: (``data.max_tokens_field``, ``data.min_tokens_field``), each None or a
    column the data must have. ``section``: the config section the keys belong to
    (``eval`` for the held-out set), named in errors."""
    listed = ", ".join(available) if available else "none found"
    if prompt_key in available:
        prompt = prompt_key
    elif prompt_key == "prompt" and CHAT_COLUMN in available:
        prompt = CHAT_COLUMN
    else:
        raise ConfigError(
            f"{section}.prompt_key: {name} has no column {prompt_key!r} (its columns: {listed}); set "
            f"{section}.prompt_key to the column holding the prompt (a string or a list of chat messages)"
        )
    path = tuple(answer_key.split("."))
    if path[0] in available:
        answer = path
    elif answer_key == "ground_truth":
        answer = ("reward_model", "ground_truth") if "reward_model" in available else ()
    else:
        raise ConfigError(
            f"{section}.answer_key: {name} has no column {path[0]!r} (its columns: {listed}); set "
            f"{section}.answer_key to the column holding the answer the reward compares with"
        )
    pair = () if pairs is None else (pairs.chosen_key, pairs.rejected_key)
    for key, field_name in zip(pair, ("chosen_key", "rejected_key"), strict=False):
        if key not in available:
            raise ConfigError(f"data.pairs.{field_name}: {name} has no column {key!r} (its columns: {listed})")
    for key, field_name in zip(budget, ("max_tokens_field", "min_tokens_field"), strict=True):
        if key is not None and key not in available:
            raise ConfigError(f"data.{field_name}: {name} has no column {key!r} (its columns: {listed}); it "
                              f"names the column holding each row's generation budget in tokens")
    return ColumnMap(prompt, answer, pair, *budget)


def budget_fields(data_cfg: Any) -> tuple[str | None, str | None]:
    """(``data.max_tokens_field``, ``data.min_tokens_field``) of a ``DataConfig``."""
    return getattr(data_cfg, "max_tokens_field", None), getattr(data_cfg, "min_tokens_field", None)


def read_budget(row: dict[str, Any], cmap: ColumnMap, where: str) -> tuple[int | None, int | None]:
    """A row's (max, min) generation budget in tokens, None where it has none; raises
    ``RowError`` (``malformed``, naming the row and field) for a value that is not a
    whole number >= 1 (the maximum) or >= 0 (the minimum), or a minimum above the maximum."""
    out: list[int | None] = []
    for key, low in ((cmap.max_tokens, 1), (cmap.min_tokens, 0)):
        value = None if key is None else row.get(key)
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # Parquet and pandas write whole numbers as floats beside nulls
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise RowError("malformed", f"{where}: field {key!r} must be a whole number of tokens >= {low} "
                                        f"(or null: no budget), got {_short(value)}")
        out.append(value)
    high, low_ = out
    if high is not None and low_ is not None and low_ > high:
        raise RowError("malformed", f"{where}: field {cmap.min_tokens!r} ({low_}) is above field "
                                    f"{cmap.max_tokens!r} ({high})")
    return high, low_


def extract_row(row: Any, cmap: ColumnMap, where: str) -> dict[str, Any]:
    """A row's ``prompt`` (str or messages), ``ground_truth``, ``data_source`` and
    ``extra_info``; raises ``RowError`` naming ``where`` for an unusable row."""
    if isinstance(row, RowError):
        raise row
    if not isinstance(row, dict):
        raise RowError("malformed", f"{where}: expected an object with a {cmap.prompt!r} field, got {type(row).__name__}")
    if cmap.prompt not in row:
        raise RowError("malformed", f"{where}: no field {cmap.prompt!r} (fields: {', '.join(map(str, row)) or 'none'})")
    prompt = row[cmap.prompt]
    if cmap.prompt == CHAT_COLUMN and not isinstance(prompt, list):
        raise RowError("malformed", f"{where}: field {cmap.prompt!r} must be a list of chat messages (the chat "
                                    f"format's column), got {type(prompt).__name__} {_short(prompt)}")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise RowError("empty", f"{where}: field {cmap.prompt!r} is empty")
    elif isinstance(prompt, list):
        check_messages(prompt, cmap.prompt, where)
    else:
        raise RowError("malformed", f"{where}: field {cmap.prompt!r} must be a string or a list of chat "
                                    f"messages, got {type(prompt).__name__}")
    extra = row.get(EXTRA_INFO) or {}
    if not isinstance(extra, dict):
        raise RowError("malformed", f"{where}: field 'extra_info' must be an object, got {type(extra).__name__}")
    source = row.get(DATA_SOURCE) or ""
    if not isinstance(source, str):
        raise RowError("malformed", f"{where}: field 'data_source' must be a string, got {type(source).__name__}")
    answer: Any = row if cmap.answer else None
    for key in cmap.answer:
        answer = answer.get(key) if isinstance(answer, dict) else None
    out = {"prompt": prompt, "ground_truth": answer, "data_source": source, "extra_info": extra}
    if cmap.max_tokens is not None or cmap.min_tokens is not None:
        out["max_tokens"], out["min_tokens"] = read_budget(row, cmap, where)
    for key in cmap.pair:
        out[key] = check_response(row, key, isinstance(prompt, str), where)
    return out


def check_response(row: dict[str, Any], key: str, plain: bool, where: str) -> str | list[Any]:
    """A preference pair's response ``row[key]``: a non-empty string after a plain prompt,
    a list of chat messages after a chat prompt; ``RowError`` naming the row and field."""
    if key not in row or row[key] is None:
        raise RowError("malformed", f"{where}: no field {key!r} (a preference pair needs it)")
    value = row[key]
    if plain and not isinstance(value, str):
        raise RowError("malformed", f"{where}: field {key!r} must be a string (the prompt is plain text), "
                                    f"got {type(value).__name__}")
    if not plain and not isinstance(value, list):
        raise RowError("malformed", f"{where}: field {key!r} must be a list of chat messages (the prompt is "
                                    f"chat), got {type(value).__name__}")
    if isinstance(value, str) and not value:
        raise RowError("empty", f"{where}: field {key!r} is empty")
    if isinstance(value, list):
        check_messages(value, key, where)
    return value


def check_messages(messages: list[Any], column: str, where: str) -> None:
    """Raise ``RowError`` unless ``messages`` is a non-empty list of {role, content} strings."""
    if not messages:
        raise RowError("empty", f"{where}: field {column!r} is an empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RowError("malformed", f"{where}: {column}[{i}] must be an object with string 'role' and "
                                        f"'content', got {_short(m)}")
    if not any(m["content"].strip() for m in messages):
        raise RowError("empty", f"{where}: every message of field {column!r} is empty")


class PromptRenderer:
    """Renders extracted rows into prompt text and token ids (see the module rules)."""

    def __init__(self, tokenizer: Any, chat_template: str, model_path: str | Path, max_len: int) -> None:
        self.tok = tokenizer
        self.chat_template = chat_template
        self.model_path = str(model_path)
        self.max_len = max_len

    def render(self, rows: Sequence[tuple[str, dict[str, Any]]]) -> list[dict[str, Any] | RowError]:
        """(where, extracted row) -> the row with ``text`` and ``token_ids``, or its
        ``RowError``; tokenizes the batch in two calls (plain and templated text)."""
        out: list[dict[str, Any] | RowError] = [RowError("pending", "")] * len(rows)
        plain: list[tuple[int, str]] = []
        chat: list[tuple[int, str]] = []
        for i, (where, row) in enumerate(rows):
            prompt = row["prompt"]
            if isinstance(prompt, str):
                plain.append((i, prompt))
                continue
            self.check_chat_template(where)
            try:
                text = self.tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            except Exception as exc:  # a template may raise on roles it does not support
                out[i] = RowError("chat_template_error", f"{where}: the chat template failed on this row "
                                                         f"({type(exc).__name__}: {_short(str(exc))})")
                continue
            chat.append((i, text))
        for group, special in ((plain, True), (chat, False)):
            if not group:
                continue
            ids = self.tok([text for _, text in group], add_special_tokens=special)["input_ids"]
            for (i, text), token_ids in zip(group, ids, strict=True):
                where, row = rows[i]
                if len(token_ids) > self.max_len:
                    out[i] = RowError("over_length", f"{where}: prompt has {len(token_ids)} tokens, "
                                                     f"data.max_prompt_len is {self.max_len}")
                else:
                    out[i] = {**row, "text": text, "token_ids": list(token_ids)}
        return out

    def check_chat_template(self, where: str) -> None:
        """Raise ``ConfigError`` when a chat row cannot be rendered with this config."""
        if self.chat_template == "none":
            raise ConfigError(
                f"data.chat_template: 'none' cannot render chat messages ({where} holds a list of "
                f"messages); set data.chat_template: auto, or give plain string prompts"
            )
        if getattr(self.tok, "chat_template", None) is None:
            raise ConfigError(
                f"data.chat_template: the tokenizer of {self.model_path} has no chat template, but "
                f"{where} holds chat messages; use a checkpoint with a chat template (an instruct "
                f"model), or give plain string prompts"
            )


def render_rows(
    items: Iterable[tuple[Any, str, Any]], cmap: ColumnMap, renderer: PromptRenderer, batch: int = SCAN_BATCH_ROWS
) -> Iterator[tuple[Any, str, dict[str, Any] | RowError]]:
    """(tag, where, raw row) -> (tag, where, rendered row or ``RowError``), in order,
    streaming in batches of ``batch`` rows (one tokenizer call per batch and kind)."""
    pending: list[tuple[Any, str, Any]] = []

    def flush() -> Iterator[tuple[Any, str, dict[str, Any] | RowError]]:
        results: list[dict[str, Any] | RowError] = []
        ok: list[tuple[str, dict[str, Any]]] = []
        slots: list[int] = []
        for _, where, raw in pending:
            try:
                ok.append((where, extract_row(raw, cmap, where)))
            except RowError as err:
                results.append(err)
            else:
                slots.append(len(results))
                results.append(err_pending)
        for slot, rendered in zip(slots, renderer.render(ok), strict=True):
            results[slot] = rendered
        done = [(tag, where, res) for (tag, where, _), res in zip(pending, results, strict=True)]
        pending.clear()
        return iter(done)

    err_pending = RowError("pending", "")
    for item in items:
        pending.append(item)
        if len(pending) >= batch:
            yield from flush()
    if pending:
        yield from flush()


@dataclass
class DataReport:
    """What ``scan_data`` found: rows in total, usable, skipped by reason (first rows)."""

    name: str
    kind: str
    columns: ColumnMap
    rows_total: int = 0
    chat_rows: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    first_rows: dict[str, list[int]] = field(default_factory=dict)
    first_errors: dict[str, str] = field(default_factory=dict)

    @property
    def rows_usable(self) -> int:
        return self.rows_total - sum(self.skipped.values())

    def add(self, number: int, result: dict[str, Any] | RowError) -> None:
        self.rows_total += 1
        if isinstance(result, RowError):
            self.skipped[result.reason] += 1
            rows = self.first_rows.setdefault(result.reason, [])
            if len(rows) < FIRST_ROWS_SHOWN:
                rows.append(number)
            self.first_errors.setdefault(result.reason, str(result))
        elif not isinstance(result["prompt"], str):
            self.chat_rows += 1

    def to_summary(self) -> dict[str, Any]:
        """Flat keys for ``summary.json``: ``data/rows_total``, ``data/rows_skipped/<reason>``..."""
        out: dict[str, Any] = {"data/rows_total": self.rows_total, "data/rows_usable": self.rows_usable}
        for reason, count in sorted(self.skipped.items()):
            out[f"data/rows_skipped/{reason}"] = count
            out[f"data/rows_skipped_first/{reason}"] = self.first_rows.get(reason, [])
        return out

    def describe(self, label: str = "data") -> str:
        """Console lines: the data's totals, its column mapping, then each skip reason;
        ``label``: the config section the data belongs to."""
        answer = ".".join(self.columns.answer) or "none"
        lines = [f"{label}: {self.name} ({self.kind}): {self.rows_total} rows, {self.rows_usable} usable "
                 f"({self.chat_rows} chat); prompt column {self.columns.prompt!r}, answer {answer!r}"]
        for reason, count in self.skipped.most_common():
            rows = ", ".join(map(str, self.first_rows.get(reason, [])))
            label = "row" if count == 1 else "rows"
            more = ", ..." if count > FIRST_ROWS_SHOWN else ""
            lines.append(f"  skipped {count} {reason} ({label} {rows}{more}); first: {self.first_errors[reason]}")
        return "\n".join(lines)


def scan_data(data: DataRows, cmap: ColumnMap, renderer: PromptRenderer) -> DataReport:
    """Validate every row of ``data`` (streaming); see the module guarantees."""
    report = DataReport(data.name, data.kind, cmap)
    items = ((n, f"{data.name} row {n}", row) for n, row in data.scan(cmap.columns))
    for number, _, result in render_rows(items, cmap, renderer):
        report.add(number, result)
    return report


def check_data_file(data_cfg: DataConfig, tokenizer: Any, model_path: str | Path, section: str = "data") -> DataReport:
    """Open ``data.path``, map its columns and validate every row; raise ``ConfigError``
    (naming the field) for a missing or unreadable path, wrong column names, chat rows
    the tokenizer cannot render, or data without one usable row. ``section``: where
    ``path`` and the column keys come from (``eval``: the held-out set's, read with
    ``data``'s chat template and prompt length)."""
    assert data_cfg.path is not None
    data = open_checked(data_cfg.path, section)
    cmap = resolve_columns(data.columns, data_cfg.prompt_key, data_cfg.answer_key, data.name, data_cfg.pairs,
                           budget_fields(data_cfg), section)
    renderer = PromptRenderer(tokenizer, data_cfg.chat_template, model_path, data_cfg.max_prompt_len)
    report = scan_data(data, cmap, renderer)
    if report.rows_usable == 0:
        raise ConfigError(f"{section}.path: no usable row in {data_cfg.path}\n{report.describe()}")
    return report


def open_checked(path: str, section: str = "data") -> DataRows:
    """``open_data(path)``; a missing or unreadable path is a ``ConfigError`` naming ``<section>.path``."""
    try:
        return open_data(path)
    except (OSError, ValueError) as exc:
        text = str(exc).removeprefix("data.path: ")
        raise ConfigError(f"{section}.path: {text}") from None


def load_tokenizer(model_path: str | Path) -> Any:
    """The checkpoint's own tokenizer; ``ValueError`` naming ``model.path`` if it cannot load."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_path))
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError... for a bad dir
        raise ValueError(f"model.path: cannot load the tokenizer of {str(model_path)!r} "
                         f"({type(exc).__name__}: {_short(str(exc))})") from None


def _short(value: Any, limit: int = 120) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
