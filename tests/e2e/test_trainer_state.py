"""Trainer state files are read with a weights-only unpickler: a real state loads (ZeRO-1,
whose optimizer file holds DeepSpeed records), a tampered one is refused unexecuted."""

from __future__ import annotations

import pickle

import pytest
import torch

from pipeline.config import TinyModelConfig, TrainConfig
from stages.algorithms.grpo import GrpoConfig
from stages.models.tiny import ensure_tiny_checkpoint
from stages.trainer.engine import TrainerEngine


class _Exploit:
    """Unpickling this would run a shell command that leaves a marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    ckpt = ensure_tiny_checkpoint(TinyModelConfig(), tmp_path_factory.mktemp("models"))
    return TrainerEngine(ckpt, TrainConfig(zero_stage=1), GrpoConfig(), temperature=1.0, dtype="float32", seed=0)


def test_state_round_trips_through_the_safe_loader(engine, tmp_path):
    engine.save_state(tmp_path / "state")
    name, param = next(iter(engine.module.named_parameters()))
    saved = param.detach().clone()
    with torch.no_grad():
        param.add_(1.0)
    engine.load_state(tmp_path / "state")
    assert torch.equal(dict(engine.module.named_parameters())[name].detach(), saved)
    assert any(p.name.endswith("optim_states.pt") for p in (tmp_path / "state").rglob("*.pt"))


def test_a_tampered_state_file_is_refused_not_executed(engine, tmp_path):
    engine.save_state(tmp_path / "state")
    marker = tmp_path / "pwned"
    (target,) = [p for p in (tmp_path / "state").rglob("mp_rank_00_model_states.pt")]
    target.write_bytes(pickle.dumps({"module": _Exploit(str(marker))}))
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        engine.load_state(tmp_path / "state")
    assert not marker.exists()
