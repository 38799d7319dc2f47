"""The job of ``bench gpu_e2e --model NAME``: the config's job (``configs/gpu_small.yaml``) at a real
shape of ``stages.models.shapes``.

The checkpoint is built locally (reused from ``~/.cache/conveyor/shapes``); the prompts
are the config's task rows, each as one user message, written to a JSONL file that
Conveyor reads through ``data.path`` and renders with the checkpoint's chat template, and
that TRL gets as the same rows (``build_job_rows``), rendered by it with that template;
the reward stays the task's, the lengths the config's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def build_job_rows(cfg: Any, count: int, chat: bool) -> list[dict[str, Any]]:
    """The config's first ``count`` task rows; ``chat``: each prompt as one user message."""
    from stages.data.tasks import load_task

    rows = load_task(cfg.data.task, **cfg.data.task_kwargs).generate_rows(cfg.run.seed, count)
    return [{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows] if chat else rows


def prepare_job(model: str, steps: int, root: Path, config: Path) -> tuple[str, ...]:
    """The overrides that put the job of ``config`` at shape ``model``: its checkpoint
    (built unless cached) and ``steps`` steps' task rows as chat messages in
    ``root/prompts.jsonl``."""
    from pipeline.config import load_config
    from stages.models.shapes import build_in_subprocess

    cfg = load_config(config)
    path = build_in_subprocess(model)
    data = write_chat_rows(cfg, steps * cfg.train.prompts_per_step, root / "prompts.jsonl")
    return (f"model.path={path}", f"data.path={data}")


def write_chat_rows(cfg: Any, count: int, path: Path) -> Path:
    """``build_job_rows(cfg, count, chat=True)`` as a JSONL file at ``path`` (prompt,
    ground_truth, data_source)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = build_job_rows(cfg, count, chat=True)
    path.write_text("".join(json.dumps({k: r[k] for k in ("prompt", "ground_truth", "data_source")}) + "\n"
                            for r in rows))
    return path


def describe_shape(model: str | None, config: Path) -> dict[str, Any]:
    """The result's ``shape``: the real shape's architecture, published config values and
    parameter count, or (no ``model``) the config's own tiny model."""
    if model is None:
        import msgspec

        from pipeline.config import load_config

        return {"name": "tiny", "tiny": msgspec.to_builtins(load_config(config).model.tiny)}
    from stages.models.shapes import get_shape

    shape = get_shape(model)
    return {"name": model, "architecture": shape.architecture, "model_type": shape.model_type,
            "published_params": shape.published_params, "qk_norm": shape.qk_norm, "config": shape.config,
            "sampling": shape.sampling}
