"""Weights leave the trainer under checkpoint names and come back into a module whole."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from pipeline.config import TinyModelConfig
from pipeline.weights import compute_fingerprint, fingerprints_match
from stages.models.checkpoint_names import CheckpointLayout, checkpoint_state_dict
from stages.models.tiny import MOE_EXPERTS, build_char_tokenizer, build_tiny_model, write_tiny_checkpoint

# Checkpoint names of layer 0's expert 1, by family: what vLLM's loaders and the Hub use.
EXPERT_1 = {
    "qwen3_moe": [f"model.layers.0.mlp.experts.1.{p}_proj.weight" for p in ("gate", "up", "down")],
    "mixtral": [f"model.layers.0.block_sparse_moe.experts.1.{w}.weight" for w in ("w1", "w3", "w2")],
}


def _model(arch: str, seed: int = 0) -> torch.nn.Module:
    cfg = TinyModelConfig(architecture=arch, seed=seed)
    return build_tiny_model(cfg, build_char_tokenizer(arch))


@pytest.mark.parametrize("arch", sorted(EXPERT_1))
def test_experts_leave_one_per_expert_as_the_saved_checkpoint_names_them(arch, tmp_path):
    model = _model(arch)
    state = model.state_dict()
    assert any(t.dim() == 3 for t in state.values())  # the module holds its experts stacked
    out = checkpoint_state_dict(model, state)
    assert set(EXPERT_1[arch]) <= set(out)
    assert all(t.dim() <= 2 for t in out.values())
    assert sum("experts." in n for n in out) == 3 * MOE_EXPERTS * model.config.num_hidden_layers
    assert fingerprints_match(compute_fingerprint(out.values()), compute_fingerprint(state.values()))
    # The names and values save_pretrained writes, which vLLM loads from disk.
    write_tiny_checkpoint(TinyModelConfig(architecture=arch), tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert sorted(saved) == sorted(out)
    assert all(torch.equal(saved[n], t) for n, t in out.items())


def test_a_dense_model_leaves_under_its_own_names_in_order():
    model = _model("llama")
    state = model.state_dict()
    out = checkpoint_state_dict(model, state)
    assert list(out) == list(state) and all(out[n] is state[n] for n in state)
    assert CheckpointLayout(model).identity


@pytest.mark.parametrize("arch", sorted(EXPERT_1))
def test_a_layout_puts_checkpoint_names_back_into_the_module(arch):
    source, target = _model(arch, seed=0), _model(arch, seed=1)
    layout = CheckpointLayout(target)
    assert not layout.identity
    payload = checkpoint_state_dict(source, source.state_dict())
    target.load_state_dict(layout.assemble(payload), strict=True)
    assert all(torch.equal(t, target.state_dict()[n]) for n, t in source.state_dict().items())


@pytest.mark.parametrize("arch", sorted(EXPERT_1))
def test_a_layout_refuses_what_does_not_fit_and_names_it(arch):
    model = _model(arch)
    layout = CheckpointLayout(model)
    payload = checkpoint_state_dict(model, model.state_dict())
    gate, _, down = EXPERT_1[arch]
    missing = {n: t for n, t in payload.items() if n != down}
    with pytest.raises(ValueError, match=r"partly covered \['model\.layers\.0\.mlp\.experts\.down_proj'\]"):
        layout.assemble(missing)
    with pytest.raises(ValueError, match=r"unknown names \['model\.layers\.0\.mlp\.experts\.9"):
        layout.assemble({**payload, "model.layers.0.mlp.experts.9.gate_proj.weight": payload[gate]})
    with pytest.raises(ValueError, match=rf"wrong shapes \['{gate.replace('.', '[.]')} \(3, 3\)"):
        layout.assemble({**payload, gate: torch.zeros(3, 3)})
