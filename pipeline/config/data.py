"""``data``: where prompts come from (a built-in task, a file or a Hub dataset), their
columns, per-row generation budgets, a curriculum and preference pairs."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from pipeline.config.base import NonNegInt, PosInt, _section


class CurriculumConfig(msgspec.Struct, **_section()):
    """A curriculum over ``data.path`` rows (``stages/data/curriculum.py`` holds the rules).

    Each row carries an integer level under ``key`` (top-level column); ``levels`` is the
    order they are taught in, starting at ``start`` (default: the first). Prompts are
    drawn from the current level only. Once ``window`` rewards of samples at the current
    level are in, their mean promotes to the next level at ``promote_at`` or above, and
    demotes to the one before below ``demote_below`` (null: never demote); either move
    starts a fresh window."""

    key: Annotated[str, Meta(min_length=1)] = "difficulty"
    levels: Annotated[list[int], Meta(min_length=1)]
    start: int | None = None
    promote_at: float = 0.8
    demote_below: float | None = None
    window: PosInt = 64


class PairsConfig(msgspec.Struct, **_section()):
    """Preference pairs for DPO (``stages/data/pairs.py``): each row holds the prompt
    (``data.prompt_key``) and two responses under ``chosen_key`` and ``rejected_key``:
    strings for a plain prompt, lists of chat messages (the assistant turn) for a chat
    prompt."""

    chosen_key: Annotated[str, Meta(min_length=1)] = "chosen"
    rejected_key: Annotated[str, Meta(min_length=1)] = "rejected"


class DataConfig(msgspec.Struct, **_section()):
    """Prompts: a built-in task (or ``module:attr`` task), or ``path``: a local JSONL or
    Parquet file or a ``datasets`` ``save_to_disk`` directory (``stages/data/prompt_rows.py``).

    ``prompt_key``: the column holding the prompt, a string or a list of chat messages
    (left at ``prompt``, a ``messages`` column is used when there is no ``prompt``).
    ``answer_key``: the column (dotted: a nested key) passed to the reward as
    ``ground_truth``. ``chat_template``: ``auto`` renders chat rows with the tokenizer's
    template and the generation prompt (plain string prompts stay as written);
    ``none`` accepts plain prompts only. ``max_prompt_len`` counts the prompt's token
    ids, template and special tokens included. ``path`` may also be a Hub dataset id
    (``openai/gsm8k``): the ``split`` of ``config_name`` (None: the default or only one)
    at ``revision`` is fetched into the Hugging Face cache before the run starts
    (``pipeline/hub.py``; ``split`` and ``config_name`` concern Hub ids only).
    ``max_tokens_field`` / ``min_tokens_field``: columns holding a per-row generation
    budget (long-tail length schedules, ``bench longtail``): the rollout generates at most
    ``row[max_tokens_field]`` tokens for that row's samples, clamped to
    ``rollout.max_tokens``, and at least ``row[min_tokens_field]`` (stop tokens are held
    back until then; clamped to the row's maximum). Both may name the same column: exact
    lengths. A null value is no budget for that row (``rollout.max_tokens``, no minimum);
    any other value than a whole number (>= 1 for the maximum, >= 0 for the minimum) makes
    the row a ``malformed`` row, named in the data report."""

    task: str = "first_digit"
    path: str | None = None
    split: Annotated[str, Meta(min_length=1)] = "train"
    config_name: str | None = None
    revision: str | None = None
    prompt_key: Annotated[str, Meta(min_length=1)] = "prompt"
    answer_key: Annotated[str, Meta(min_length=1)] = "ground_truth"
    chat_template: Literal["auto", "none"] = "auto"
    max_prompt_len: PosInt = 512
    num_prompts: NonNegInt = 0  # 0 = as many as the run needs
    shuffle: bool = True
    task_kwargs: dict[str, Any] = {}
    max_tokens_field: Annotated[str, Meta(min_length=1)] | None = None
    min_tokens_field: Annotated[str, Meta(min_length=1)] | None = None
    curriculum: CurriculumConfig | None = None  # needs data.path
    pairs: PairsConfig | None = None  # preference pairs (algorithm.name: dpo); needs data.path
