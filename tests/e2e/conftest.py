"""Fixtures of the e2e tier: one vLLM engine (CPU, its engine core in a process of its
own) for the tests that drive a rollout backend themselves (``test_lora.py``,
``test_rollout_backends.py``), which takes about 20 s to start on 2 cores. It serves the
tiny checkpoint and is driven from one event loop, as the rollout actor drives its engine.
A test that depends on the weights pushes its own first, at the engine's next version, so
none depends on what another test (or module) served before it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def rollout_loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from pipeline.config import TinyModelConfig
    from stages.models.tiny import ensure_tiny_checkpoint

    return ensure_tiny_checkpoint(TinyModelConfig(), tmp_path_factory.mktemp("rollout-models"))


class SharedVllm:
    """The vLLM backend on ``checkpoint``, started on first use; ``close`` shuts it down
    (the last module to use it does, so that no idle engine outlives it; a later ``get``
    starts a new one)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, checkpoint: Path) -> None:
        self.loop, self.checkpoint, self.backend = loop, checkpoint, None

    def get(self) -> Any:
        if self.backend is None:
            from pipeline.config import RolloutConfig
            from stages.rollout import build_backend

            cfg = RolloutConfig(backend="vllm", kv_cache_gib=0.25, seed=0, engine_core="subprocess")
            backend = build_backend("vllm", self.checkpoint, cfg, "float32")
            self.loop.run_until_complete(backend.start())
            self.backend = backend
        return self.backend

    def close(self) -> None:
        backend, self.backend = self.backend, None
        if backend is not None:
            self.loop.run_until_complete(backend.shutdown())


@pytest.fixture(scope="session")
def shared_vllm(rollout_loop, tiny_checkpoint):
    shared = SharedVllm(rollout_loop, tiny_checkpoint)
    yield shared
    shared.close()
