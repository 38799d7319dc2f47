"""``train.compile``'s blocks really compiled, on CPU (torch's CPU inductor needs a C++
compiler): one graph shared by every decoder layer, no recompile when the batch or the
length changes, and the eager model's numbers."""

from __future__ import annotations

import shutil

import pytest
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


# Without checkpointing is slow (about 20 s): the checkpointed variant builds the same graphs and runs in every run.
@pytest.mark.parametrize("checkpointed", [pytest.param(False, marks=pytest.mark.slow), True])
def test_the_trainers_warm_up_builds_every_graph_its_passes_use(tmp_path, checkpointed):
    """``TrainerEngine.warm_up_compile`` at set-up leaves the first step nothing to
    compile: passes of padded rows, of rows of one length and of one row alone run on
    the graphs it built, with the blocks recomputed in backward too
    (``train.gradient_checkpointing``); it leaves no gradient and the random state as it
    was."""
    import msgspec
    import numpy as np

    from pipeline.config import TinyModelConfig, TrainConfig
    from pipeline.memory.splitting import split_rollout_batch_at
    from stages.algorithms import assign_advantages
    from stages.algorithms.grpo import GrpoConfig
    from stages.models.tiny import ensure_tiny_checkpoint
    from stages.trainer.engine import TrainerEngine
    from tests.e2e.test_trainer_engine import GROUP, MAX_COMPLETION, make_batch

    checkpoint = ensure_tiny_checkpoint(TinyModelConfig(), tmp_path)
    torch._dynamo.reset()
    counters.clear()
    train = TrainConfig(compile="on", threads=1, pass_tokens=0, gradient_checkpointing=checkpointed)
    engine = TrainerEngine(checkpoint, train, GrpoConfig(),
                           temperature=1.0, dtype="float32", seed=0, chunk_size=GROUP)
    assert engine.compiled_blocks == TinyModelConfig().num_layers
    rng = engine.get_rng_state()
    assert engine.warm_up_compile() > 0
    assert engine.get_rng_state() == rng
    assert all(p.grad is None or not p.grad.any() for p in engine.module.parameters())
    built = counters["stats"]["unique_graphs"]
    assert built >= 3, dict(counters["stats"])  # padded, unpadded, one row: each its own graph
    batch = assign_advantages(make_batch(), engine.algo)
    engine.train_micro_batch(batch, 1.0)  # passes of one group each: rows of different lengths
    # Every completion as long as the longest: a group's rows are of one length, unpadded.
    even = msgspec.structs.replace(batch, completion_lens=np.full(batch.num_samples, MAX_COMPLETION, np.int32))
    engine.train_micro_batch(even, 1.0)
    engine.chunk_size = 1  # one row a pass, over one group (8 passes, not 64)
    first_group = split_rollout_batch_at(batch, [1, len(batch.prompts) - 1])[0]
    engine.train_micro_batch(first_group, 1.0)
    assert counters["stats"]["unique_graphs"] == built, dict(counters["stats"])
    assert any(p.grad is not None and p.grad.any() for p in engine.module.parameters())
