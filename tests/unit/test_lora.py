"""``model.lora``: config validation, pre-flight (peft missing, targets the model lacks),
and the partial payload a LoRA sync sends (its rest fingerprint, checked by receivers)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from pipeline.cli import main
from pipeline.config import ConfigError, load_config
from pipeline.transport import read_rest_fingerprint
from pipeline.weights import (
    REST_FINGERPRINT_KEY,
    WeightSyncError,
    build_payload,
    compute_fingerprint,
    decode_rest_fingerprint,
    deserialize_weights,
    encode_rest_fingerprint,
    read_payload_metadata,
    serialize_weights,
)
from stages.rollout.hf_backend import check_payload_names

QUICKSTART = str(Path(__file__).parents[2] / "configs" / "quickstart.yaml")


def test_lora_is_off_by_default_and_on_with_a_rank() -> None:
    assert not load_config(None).model.lora.enabled
    lora = load_config(None, ["model.lora.rank=8", "model.lora.target_modules=[q_proj,v_proj]"]).model.lora
    assert lora.enabled and lora.rank == 8 and lora.target_modules == ["q_proj", "v_proj"]
    assert lora.alpha == 16.0 and lora.dropout == 0.0 and not lora.export_merged


@pytest.mark.parametrize(("override", "message"), [
    ("model.lora.rank=-1", "model.lora.rank: expected int >= 0, got -1"),
    ("model.lora.alpha=0", "model.lora.alpha: expected float > 0"),
    ("model.lora.dropout=1", "model.lora.dropout: expected float < 1"),
    ("model.lora.target_modules=[]", "model.lora.target_modules: expected 'all-linear', a regular expression or a "
                                     "non-empty list"),
    ("model.lora.target_modules=['q_proj', ' ']", "model.lora.target_modules: expected 'all-linear'"),
    ("model.lora.target_modules=.*(proj", "model.lora.target_modules: '.*(proj' is not a valid regular expression"),
    ("model.lora.ranks=8", "model.lora.ranks: unknown field"),
])
def test_bad_lora_fields_name_their_path(override, message) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert message in str(info.value)


def test_lora_without_peft_exits_2_naming_the_field_and_the_pip_command(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    monkeypatch.setattr("ray.init", lambda *a, **kw: pytest.fail("Ray started"))
    assert main(["launch", "--config", QUICKSTART, "model.lora.rank=4", f"run.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "conveyor: invalid config: model.lora: LoRA needs peft" in err
    assert "pip install 'conveyor[lora]'" in err


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.lora.target_modules=[no_such_proj]"], "model.lora.target_modules (['no_such_proj']): Target modules"),
    (["model.lora.target_modules=[embed_tokens]"], "Conveyor merges adapters into linear layers only"),
    (["model.tiny.architecture=qwen2", "model.lora.target_modules=[lm_head]"],
     "share their weight with another name (tied embeddings)"),
])
def test_targets_that_cannot_be_served_exit_2_before_ray_starts(monkeypatch, capsys, tmp_path, overrides, message):
    monkeypatch.setattr("ray.init", lambda *a, **kw: pytest.fail("Ray started"))
    args = ["--config", QUICKSTART, "model.lora.rank=4", f"run.dir={tmp_path}", f"model.cache_dir={tmp_path}"]
    assert main(["launch", *args, *overrides]) == 2
    assert message in capsys.readouterr().err


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(4, 3, generator=g), "b.weight": torch.randn(5, generator=g)}


def test_a_partial_payload_carries_its_rest_and_the_whole_fingerprint() -> None:
    state, rest = _state(), (2.5, 7.25)
    data, _, fingerprint = build_payload(state, rest)
    assert data == safetensors.torch.save(state, metadata=encode_rest_fingerprint(rest))
    assert read_rest_fingerprint(data) == rest
    own = compute_fingerprint(deserialize_weights(data).values())
    # The published fingerprint is the whole served model's: the payload's plus the rest.
    assert fingerprint == (own[0] + 2.5, own[1] + 7.25)
    # A whole payload names no rest, and its bytes are those it always had.
    whole, _, whole_fp = build_payload(state)
    assert read_rest_fingerprint(whole) is None and read_payload_metadata(whole) == {}
    assert whole == serialize_weights(state) and whole_fp == own


def test_a_damaged_rest_is_refused() -> None:
    with pytest.raises(WeightSyncError, match=REST_FINGERPRINT_KEY):
        decode_rest_fingerprint({REST_FINGERPRINT_KEY: "[1.0]"})


def test_the_hf_receiver_accepts_missing_parameters_only_from_a_partial_payload() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    some = {"0.weight": torch.zeros(4, 3)}
    check_payload_names(model, some, partial=True)
    with pytest.raises(WeightSyncError, match="missing parameters"):
        check_payload_names(model, some)
    with pytest.raises(WeightSyncError, match="unknown names"):
        check_payload_names(model, {"2.weight": torch.zeros(1)}, partial=True)


def test_a_colocated_lora_trainer_leaves_vllm_what_its_frozen_base_does_not_take() -> None:
    from pipeline.placement import estimate_colocated_fraction

    # 1e9 params in bf16 on 100 GB, 1e7 of them trainable: 1e7 x 20 B + 0.99e9 x 2 B =
    # 2.18e9 B resident, so vLLM gets 1 - 0.0218 - 0.1 (reserve) = 0.8782; trained whole,
    # 1e9 x 20 B = 20e9 B leave it 1 - 0.2 - 0.1 = 0.7.
    lora = estimate_colocated_fraction(10**9, "bfloat16", 100 * 10**9, with_reference=False, trainable_params=10**7)
    assert lora == pytest.approx(0.8782, abs=1e-12)
    assert estimate_colocated_fraction(10**9, "bfloat16", 100 * 10**9, with_reference=False) == pytest.approx(0.7)


def test_the_adapter_bound_is_what_peft_makes_of_all_linear_on_the_tiny_llama(tmp_path) -> None:
    from pipeline.config import LoraConfig, TinyModelConfig
    from pipeline.memory.admission import ModelShape
    from pipeline.placement import estimate_lora_params
    from stages.models.lora import apply_lora, count_parameters
    from stages.models.tiny import build_char_tokenizer, build_tiny_model

    tiny = TinyModelConfig()
    model = build_tiny_model(tiny, build_char_tokenizer())
    shape = ModelShape.from_hf_config(model.config)
    apply_lora(model, LoraConfig(rank=4))
    # Per layer 4 x (9 x 128 + 2 x 128 + 3 x 256) = 8704; two layers: 17408, all of them.
    assert estimate_lora_params(shape, 4) == 17408 == count_parameters(model)[0]


def test_a_cuda_ipc_descriptor_carries_the_rest_too() -> None:
    from pipeline.transport import IpcPayload, encode_ipc_payload

    fields = dict(key="k", pid=1, slot=0, version=3, fingerprint=(1.0, 2.0), buckets=[], tensors=[])
    assert read_rest_fingerprint(encode_ipc_payload(IpcPayload(**fields, rest=(4.0, 8.0)))) == (4.0, 8.0)
    assert read_rest_fingerprint(encode_ipc_payload(IpcPayload(**fields))) is None


COLOCATE = ["placement=colocate", "dataflow.async_execution=false", "dataflow.max_staleness=0"]


@pytest.mark.parametrize(("overrides", "whole", "slots"), [(COLOCATE, True, 1), (["rollout.sleep_mode=true"], True, 2),
                                                           ([], False, 2)])
def test_a_trainer_sends_whole_syncs_where_the_rollout_sleeps(monkeypatch, overrides, whole, slots) -> None:
    """Whole merged syncs where the rollout sleeps; one cuda_ipc copy of the weights where
    it is colocated, two elsewhere (``pipeline.placement.count_sync_slots``)."""
    import stages.trainer.engine as trainer_engine

    built: dict = {}
    monkeypatch.setattr(trainer_engine, "TrainerEngine", lambda *args, **kwargs: built.update(kwargs))
    monkeypatch.setattr(trainer_engine, "resolve_model_path", lambda model: model.path)
    trainer_engine.build_trainer_engine(load_config(QUICKSTART, ["model.lora.rank=8", *overrides]))
    assert built["whole_syncs"] is whole and built["sync_slots"] == slots
