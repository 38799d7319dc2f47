"""A stand-in Hugging Face Hub cache built on disk, for tests that resolve Hub names
offline: the layout ``huggingface_hub`` reads (``<kind>s--org--name/snapshots/<commit>/...``
and ``refs/<branch>`` holding the commit), nothing downloaded."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def use_hub_cache(home: Path, monkeypatch: Any) -> Path:
    """An empty Hub cache under ``home`` as ``HF_HOME``, offline (``HF_HUB_OFFLINE=1``).
    huggingface_hub reads both at import into ``constants``, so those are set too."""
    from huggingface_hub import constants

    cache = home / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def add_to_hub_cache(cache: Path, repo_id: str, files: dict[str, str | bytes | Path], *, kind: str = "model",
                     commit: str = COMMIT, branch: str = "main") -> Path:
    """Write ``files`` (repository path -> text, bytes or a file to copy) as ``repo_id``'s
    snapshot at ``commit``, with ``refs/<branch>`` naming it; the snapshot folder."""
    repo = cache / f"{kind}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for rel, content in files.items():
        target = snapshot / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            shutil.copyfile(content, target)
        elif isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / branch).write_text(commit)
    return snapshot


# The dataset card of a GSM8K-shaped Hub repository: two configs, each with train and test.
GSM8K_CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*
  - split: test
    path: socratic/test-*
---
"""
