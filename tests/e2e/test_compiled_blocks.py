"""``train.compile``'s blocks really compiled, on CPU (torch's CPU inductor needs a C++
compiler): one graph shared by every decoder layer, no recompile when the batch or the
length changes, and the eager model's numbers."""

from __future__ import annotations

import shutil

import torch
from torch._dynamo.utils import counters

from stages.trainer.engine import compile_blocks


def test_every_block_shares_one_graph_through_new_shapes_and_matches_eager():
    from transformers import LlamaConfig, LlamaForCausalLM

    assert shutil.which("g++") or shutil.which("c++"), "torch.compile on CPU needs a C++ compiler on PATH (g++ or c++)"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=10,
                         num_attention_heads=2, num_key_value_heads=2)
    eager = LlamaForCausalLM(config)
    compiled = LlamaForCausalLM(config)
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    counters.clear()
    # More layers than dynamo's recompile limit: a graph per layer would leave some eager.
    assert config.num_hidden_layers > torch._dynamo.config.recompile_limit
    assert compile_blocks(compiled, "on", on_gpu=False, zero_stage=0) == (10, "")
    for shape in [(2, 9), (3, 13)]:  # the trainer's calls: no KV cache, any batch and length
        ids = torch.randint(0, 32, shape)
        outs = [m(input_ids=ids, use_cache=False).logits for m in (eager, compiled)]
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
        for m, out in zip((eager, compiled), outs, strict=True):
            m.zero_grad()
            out.float().pow(2).mean().backward()
        grads = [torch.cat([p.grad.flatten() for p in m.parameters()]) for m in (eager, compiled)]
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-3, atol=1e-5)
    assert counters["frames"]["ok"] == 1 and counters["stats"]["unique_graphs"] == 1, dict(counters["frames"])
