"""Pure helpers of stages/trainer/engine.py (no DeepSpeed engine is built here)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from pipeline.config import TrainConfig
from pipeline.types import Prompt, RolloutBatch
from stages.trainer.engine import (
    build_deepspeed_config,
    compile_blocks,
    compute_chunk_weights,
    copy_model_files,
    decode_rng_state,
    encode_rng_state,
    find_blocks,
    plan_compile,
)


def piece(completion_lens: list[int]) -> RolloutBatch:
    num = len(completion_lens)
    width = max(completion_lens)
    return RolloutBatch(
        batch_id=0, step=0, prompts=[Prompt(prompt_id="p", text="")], group_size=num,
        sample_ids=[str(i) for i in range(num)], prompt_ids=np.ones((num, 1), np.int32),
        prompt_lens=np.ones(num, np.int32), completion_ids=np.ones((num, width), np.int32),
        completion_lens=np.array(completion_lens, np.int32), completions=[""] * num,
        behaviour_logprobs=np.zeros((num, width), np.float32),
        token_versions=np.zeros((num, width), np.int32), policy_version=0,
    )


def test_chunk_weights_reproduce_the_loss_aggregation():
    # Rows hold 3, 1, 0 and 2 valid tokens; chunks are rows [0, 2) and [2, 4).
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]], dtype=torch.float32)
    bounds = [[0, 1], [2, 3]]
    # token-mean: 4 of 6 tokens, then 2 of 6.
    assert compute_chunk_weights(mask, bounds, "token-mean") == pytest.approx([4 / 6, 2 / 6])
    # seq-mean: sequences with a token are 2 in the first chunk, 1 in the second (the
    # empty row is not averaged over by aggregate_loss).
    assert compute_chunk_weights(mask, bounds, "seq-mean-token-mean") == pytest.approx([2 / 3, 1 / 3])
    assert compute_chunk_weights(mask, bounds, "seq-mean-token-sum") == pytest.approx([2 / 3, 1 / 3])
    assert compute_chunk_weights(torch.zeros(2, 3), [[0], [1]], "token-mean") == [0.0, 0.0]


def test_chunk_weights_of_scattered_row_groups():
    # The same rows grouped out of order, as token-budget passes group them: rows {3, 0}
    # hold 2 + 3 = 5 tokens of 6 and 2 of the 3 non-empty sequences; rows {2, 1} 1 token
    # and 1 sequence; seq-mean-token-sum-norm counts rows: 2 of 4 each.
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]], dtype=torch.float32)
    groups = [np.array([3, 0]), np.array([2, 1])]
    assert compute_chunk_weights(mask, groups, "token-mean") == pytest.approx([5 / 6, 1 / 6])
    assert compute_chunk_weights(mask, groups, "seq-mean-token-mean") == pytest.approx([2 / 3, 1 / 3])
    assert compute_chunk_weights(mask, groups, "seq-mean-token-sum-norm") == pytest.approx([1 / 2, 1 / 2])


@pytest.mark.parametrize("groups", [[[0], [1, 2, 3]], [[3, 1], [0, 2]], [[2], [0, 3], [1]]])
def test_chunk_weights_make_grouped_aggregation_equal_the_whole(groups):
    from stages.algorithms import aggregate_loss

    values = torch.tensor([[0.5, -1.0, 2.0], [3.0, 0.0, 0.0], [1.0, 1.0, 0.0], [-2.0, 4.0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.float32)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        weights = compute_chunk_weights(mask, groups, agg)
        grouped = sum(w * aggregate_loss(values[rows], mask[rows], agg, 3) for rows, w in zip(groups, weights, strict=True))
        assert float(grouped) == pytest.approx(float(aggregate_loss(values, mask, agg, 3)), abs=1e-6)


def test_rng_state_round_trips_every_generator():
    state = encode_rng_state()
    assert isinstance(state, bytes)
    first = (torch.rand(4).tolist(), np.random.rand(3).tolist(), random.random(), np.random.randn())
    decode_rng_state(state)
    assert (torch.rand(4).tolist(), np.random.rand(3).tolist(), random.random(), np.random.randn()) == first


def test_deepspeed_config_leaves_the_step_boundary_to_the_caller():
    cfg = build_deepspeed_config(TrainConfig(lr=2e-5, weight_decay=0.1, grad_clip=0.5, zero_stage=2), "bfloat16", has_gpu=False)
    assert cfg["managed_gradient_accumulation"] is False
    assert cfg["gradient_accumulation_steps"] == 1
    assert cfg["gradient_clipping"] == 0.5 and cfg["zero_optimization"] == {"stage": 2}
    assert cfg["optimizer"]["params"] == {"lr": 2e-5, "weight_decay": 0.1, "torch_adam": True}
    assert not cfg["bf16"]["enabled"] and not cfg["fp16"]["enabled"]  # no GPU: float32 math
    assert build_deepspeed_config(TrainConfig(), "bfloat16", has_gpu=True)["bf16"]["enabled"]
    assert build_deepspeed_config(TrainConfig(zero_stage=3), "float32", False)["zero_optimization"] == {"stage": 3}
    # Several ranks: ZeRO 0 becomes 1, whose optimizer reports the averaged gradients' norm.
    assert build_deepspeed_config(TrainConfig(num_ranks=2), "float32", False)["zero_optimization"] == {"stage": 1}


def test_bf16_runs_accumulate_gradients_in_fp32_by_default():
    # A GPU bf16 run: fp32 accumulation, which DeepSpeed implements through ZeRO >= 1.
    cfg = build_deepspeed_config(TrainConfig(zero_stage=0), "bfloat16", has_gpu=True)
    assert cfg["data_types"] == {"grad_accum_dtype": "fp32"} and cfg["zero_optimization"] == {"stage": 1}
    assert build_deepspeed_config(TrainConfig(zero_stage=2), "bfloat16", True)["zero_optimization"] == {"stage": 2}
    # Opted out, on CPU (float32 math) or in float32: DeepSpeed's defaults, stage as asked.
    for train, dtype, gpu in ((TrainConfig(grad_accum_dtype="bf16"), "bfloat16", True),
                              (TrainConfig(), "bfloat16", False), (TrainConfig(), "float32", True)):
        cfg = build_deepspeed_config(train, dtype, gpu)
        assert "data_types" not in cfg and cfg["zero_optimization"] == {"stage": 0}


def test_a_taken_port_this_process_chose_is_replaced_and_a_users_port_is_not(monkeypatch):
    from stages.trainer import engine as trainer_engine

    ports = iter([41001, 41002, 41003])
    monkeypatch.setattr(trainer_engine, "find_free_port", lambda: next(ports))
    monkeypatch.setenv("MASTER_PORT", "41000")
    tried = []

    def init():
        tried.append(os.environ["MASTER_PORT"])
        if len(tried) < 3:
            raise RuntimeError(f"The server socket has failed to listen (port {tried[-1]}, EADDRINUSE)")
        return "engine"

    assert trainer_engine.init_on_a_free_port(init, chose_port=True) == "engine"
    assert tried == ["41000", "41001", "41002"]
    tried.clear()
    with pytest.raises(RuntimeError, match="EADDRINUSE"):  # the user's port: no second try
        trainer_engine.init_on_a_free_port(init, chose_port=False)
    assert tried == [os.environ["MASTER_PORT"]]
    tried.clear()
    monkeypatch.setattr(trainer_engine, "PORT_ATTEMPTS", 2)
    with pytest.raises(RuntimeError, match="EADDRINUSE"):  # attempts are bounded
        trainer_engine.init_on_a_free_port(init, chose_port=True)
    assert len(tried) == 2

    def broken():
        raise ValueError("bad config")

    with pytest.raises(ValueError, match="bad config"):  # other errors are not retried
        trainer_engine.init_on_a_free_port(broken, chose_port=True)


def tiny_llama(layers: int = 3):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                                        num_attention_heads=2, num_key_value_heads=2))


def test_compile_plan_follows_the_mode_the_device_zero_and_the_compiler():
    assert plan_compile("auto", on_gpu=True, zero_stage=1, compiler="/usr/bin/gcc") == ""
    assert plan_compile("on", on_gpu=False, zero_stage=3, compiler="/usr/bin/g++") == ""
    assert "off" in plan_compile("off", on_gpu=True, zero_stage=0, compiler=None)
    assert "GPU" in plan_compile("auto", on_gpu=False, zero_stage=0, compiler="/usr/bin/g++")
    assert "ZeRO 3" in plan_compile("auto", on_gpu=True, zero_stage=3, compiler="/usr/bin/gcc")
    # No compiler: auto stays eager and says why; on refuses.
    assert "C compiler for Triton" in plan_compile("auto", on_gpu=True, zero_stage=0, compiler=None)
    with pytest.raises(ValueError, match=r"train.compile: on needs a C\+\+ compiler for inductor"):
        plan_compile("on", on_gpu=False, zero_stage=0, compiler=None)
    assert TrainConfig().compile == "auto"
    # Mixture-of-experts blocks: auto leaves them eager, on compiles them anyway.
    assert "mixture-of-experts" in plan_compile("auto", on_gpu=True, zero_stage=1, compiler="/usr/bin/gcc", experts=True)
    assert plan_compile("on", on_gpu=True, zero_stage=1, compiler="/usr/bin/gcc", experts=True) == ""


def test_auto_leaves_a_mixture_of_experts_eager_on_a_gpu(tmp_path, monkeypatch):
    from pipeline.config import TinyModelConfig
    from stages.models.tiny import build_char_tokenizer, build_tiny_model

    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))  # a compiler is found: only the experts keep it eager
    moe = build_tiny_model(TinyModelConfig(architecture="qwen3_moe"), build_char_tokenizer("qwen3_moe"))
    count, why = compile_blocks(moe, "auto", on_gpu=True, zero_stage=0)
    assert count == 0 and "mixture-of-experts" in why
    assert compile_blocks(tiny_llama(2), "auto", on_gpu=True, zero_stage=0) == (2, "")  # the same plan, dense


def test_the_compiler_is_found_where_triton_and_inductor_look(tmp_path, monkeypatch):
    from pipeline.preflight import find_compiler

    def tool(name: str) -> str:
        path = tmp_path / name
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
        return str(path)

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    assert find_compiler(on_gpu=True) is None and find_compiler(on_gpu=False) is None
    clang = tool("clang")
    assert find_compiler(on_gpu=True) == clang and find_compiler(on_gpu=False) is None
    gcc = tool("gcc")
    assert find_compiler(on_gpu=True) == gcc  # gcc before clang, as Triton picks
    monkeypatch.setenv("CC", "no-such-cc")  # $CC is the only one Triton tries when set
    assert find_compiler(on_gpu=True) is None
    gxx = tool("g++")
    assert find_compiler(on_gpu=False) == gxx
    monkeypatch.setenv("CXX", "clang")
    assert find_compiler(on_gpu=False) == clang


def test_blocks_are_the_models_decoder_layers_in_order():
    model = tiny_llama(3)
    assert find_blocks(model) == list(model.model.layers)
    assert find_blocks(torch.nn.Linear(2, 2)) == []


def test_compiling_blocks_keeps_the_module_tree_and_its_names():
    model = tiny_llama(2)
    names = list(model.state_dict())
    assert compile_blocks(model, "on", on_gpu=False, zero_stage=0) == (2, "")
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    assert model.lm_head._compiled_call_impl is None  # only the blocks
    assert list(model.state_dict()) == names
    eager = tiny_llama(2)
    assert compile_blocks(eager, "auto", on_gpu=False, zero_stage=0) == (0, plan_compile("auto", False, 0, None))
    assert all(layer._compiled_call_impl is None for layer in eager.model.layers)
    count, why = compile_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)), "on", on_gpu=False, zero_stage=0)
    assert count == 0 and "_no_split_modules" in why


def test_offloaded_optimizer_steps_in_host_memory_with_torch_fused_adamw():
    """train.offload_optimizer: ZeRO-Offload (stage 0 raised to 1, a stage asked for kept),
    pinned host buffers on a GPU, torch's fused AdamW allowed to step them."""
    gpu = build_deepspeed_config(TrainConfig(offload_optimizer=True), "bfloat16", has_gpu=True)
    assert gpu["zero_optimization"] == {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    assert gpu["optimizer"]["params"]["fused"] is True and gpu["zero_force_ds_cpu_optimizer"] is False
    cpu = build_deepspeed_config(TrainConfig(offload_optimizer=True, zero_stage=2), "float32", has_gpu=False)
    assert cpu["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}}
    plain = build_deepspeed_config(TrainConfig(), "float32", has_gpu=False)
    assert "fused" not in plain["optimizer"]["params"] and "zero_force_ds_cpu_optimizer" not in plain


def test_an_export_copies_the_models_files_but_not_a_sharded_sources_index(tmp_path):
    """A source saved in shards has ``model.safetensors.index.json``; an export saved
    whole must not inherit it (vLLM then looks for shards that are not there), nor a
    source adapter's config (transformers would look for the adapter's weights)."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir(), out.mkdir()
    names = ["config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja",
             "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
             "model.safetensors.index.json", "pytorch_model.bin.index.json", "adapter_config.json"]
    for name in names:
        (src / name).write_text(name)
    (out / "config.json").write_text("the export's own")
    copy_model_files(src, out)
    assert sorted(p.name for p in out.iterdir()) == ["chat_template.jinja", "config.json",
                                                    "generation_config.json", "tokenizer.json"]
    assert (out / "config.json").read_text() == "the export's own"
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    copy_model_files(src, adapter, config=False)  # LoRA: peft writes its own config
    assert sorted(p.name for p in adapter.iterdir()) == ["chat_template.jinja", "tokenizer.json"]
