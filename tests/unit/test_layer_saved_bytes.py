"""``layer_saved_bytes`` (what admission and the one-GPU plan count per token per layer)
against what autograd really keeps for a transformers decoder layer of each family, in
bfloat16 on the CPU: the bytes of every tensor saved for backward, counted once per
storage, parameters and the [L, L] attention scores of the CPU's attention kernel left
out (a fused GPU kernel never builds them), per token, as the difference between a
model of three layers and one of one."""

from __future__ import annotations

import pytest
import torch

from pipeline.memory.admission import ModelShape, layer_saved_bytes
from stages.models.shapes import SCALED_DOWN, build_shape_config, init_model

TOKENS = 64


def saved_bytes_per_token(name: str, layers: int) -> float:
    config = build_shape_config(name, overrides={**SCALED_DOWN, "num_hidden_layers": layers,
                                                 "hidden_size": 256, "intermediate_size": 768})
    config._attn_implementation = "sdpa"
    model = init_model(config, torch.bfloat16, seed=0).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        square = t.dim() >= 2 and t.shape[-1] == t.shape[-2] == TOKENS
        if storage.data_ptr() not in params and not square:
            saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    ids = torch.randint(3, 500, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=ids)
    return sum(saved.values()) / TOKENS


@pytest.mark.parametrize("name", ["qwen3_0.6b", "llama3.2_1b", "gemma3_1b"])
def test_the_estimate_per_layer_is_what_autograd_keeps(name):
    measured = (saved_bytes_per_token(name, 3) - saved_bytes_per_token(name, 1)) / 2
    config = build_shape_config(name, overrides={**SCALED_DOWN, "hidden_size": 256, "intermediate_size": 768})
    estimate = layer_saved_bytes(ModelShape.from_hf_config(config, dtype_bytes=2))
    # Within 5% (at these shapes it is within 1%; the count it replaced was 14-78% under).
    assert 0.95 <= measured / estimate <= 1.05, (name, measured, estimate)
