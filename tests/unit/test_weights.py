"""Weight transport: safetensors round trip, checksums, fusion-invariant fingerprints."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import safetensors.torch
import torch

from pipeline.weights import (
    WeightSyncError,
    build_payload,
    compute_fingerprint,
    compute_sha256,
    deserialize_weights,
    drop_tied_duplicates,
    fingerprints_match,
    load_weights_file,
    serialize_weights,
    verify_fingerprint,
    write_weights_file,
)


def _state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(4, 3, generator=g),
        "b.weight": torch.randn(5, generator=g).to(torch.bfloat16),
        "c.bias": torch.arange(6, dtype=torch.int64),
    }


def test_round_trip_is_bit_exact() -> None:
    sd = _state_dict()
    back = deserialize_weights(serialize_weights(sd))
    assert sorted(back) == sorted(sd)  # safetensors orders by dtype, then name
    for name, tensor in sd.items():
        assert back[name].dtype == tensor.dtype
        assert back[name].shape == tensor.shape
        assert torch.equal(back[name], tensor)


def test_non_contiguous_and_views_of_one_buffer_travel_as_values() -> None:
    flat = torch.arange(12, dtype=torch.float32)
    sd = {
        "t": torch.arange(6, dtype=torch.float32).reshape(2, 3).t(),  # non-contiguous
        "x": flat[:4],  # two distinct views of one storage, as in ZeRO flat buffers
        "y": flat[4:],
    }
    back = deserialize_weights(serialize_weights(sd))
    assert torch.equal(back["t"], sd["t"])
    assert torch.equal(back["x"], flat[:4])
    assert torch.equal(back["y"], flat[4:])


def test_tied_parameters_travel_once_under_the_first_name() -> None:
    emb = torch.randn(7, 2)
    sd = {"model.embed_tokens.weight": emb, "lm_head.weight": emb, "norm.weight": torch.ones(2)}
    assert list(drop_tied_duplicates(sd)) == ["model.embed_tokens.weight", "norm.weight"]
    back = deserialize_weights(serialize_weights(sd))
    assert sorted(back) == ["model.embed_tokens.weight", "norm.weight"]
    # Counted once: the fingerprint of the payload equals that of the untied set.
    assert compute_fingerprint(back.values()) == compute_fingerprint([emb, torch.ones(2)])


def test_sha_changes_when_one_byte_flips() -> None:
    data = serialize_weights(_state_dict())
    flipped = bytearray(data)
    flipped[-1] ^= 0x01  # last byte lies in the tensor data, not the header
    assert compute_sha256(data) == compute_sha256(bytes(data))
    assert compute_sha256(bytes(flipped)) != compute_sha256(data)


def test_fingerprint_of_a_tiny_tensor_by_hand() -> None:
    t = torch.tensor([[1.0, -2.0], [3.0, 0.5]])
    # sum = 1 - 2 + 3 + 0.5 = 2.5; sumsq = 1 + 4 + 9 + 0.25 = 14.25
    assert compute_fingerprint([t]) == (2.5, 14.25)


def test_fingerprint_rounds_to_the_requested_dtype() -> None:
    t = torch.tensor([1.0 + 2.0**-10])
    # bfloat16 keeps 8 significant bits: 1 + 2^-10 rounds to 1.0, so (1.0, 1.0).
    assert compute_fingerprint([t], dtype=torch.bfloat16) == (1.0, 1.0)
    assert compute_fingerprint([t]) == (1.0 + 2.0**-10, (1.0 + 2.0**-10) ** 2)


def test_fingerprint_is_invariant_to_fusion_and_zero_padding() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(8, 4, generator=g) for _ in range(3))
    emb = torch.randn(5, 4, generator=g)
    trainer = compute_fingerprint([q, k, v, emb])
    # vLLM: one fused qkv_proj, and the embedding padded with zero rows to 8.
    fused = torch.cat([q, k, v], dim=0)
    padded = torch.cat([emb, torch.zeros(3, 4)], dim=0)
    engine = compute_fingerprint([padded, fused.t()])
    assert fingerprints_match(trainer, engine)
    assert math.isclose(trainer[1], engine[1], rel_tol=1e-12)


def test_fingerprint_detects_a_small_change_and_a_missing_tensor() -> None:
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(64, 64, generator=g), torch.randn(64, generator=g)
    ref = compute_fingerprint([a, b])
    nudged = a.clone()
    nudged[3, 5] += 1e-2
    assert not fingerprints_match(ref, compute_fingerprint([nudged, b]))
    assert not fingerprints_match(ref, compute_fingerprint([a]))
    assert fingerprints_match(ref, compute_fingerprint([b, a]))


def test_fingerprints_match_tolerates_a_near_zero_sum() -> None:
    # sum is 0 up to rounding, sumsq is 2: the sum is compared on the scale sqrt(2).
    assert fingerprints_match((0.0, 2.0), (1e-12, 2.0))
    assert not fingerprints_match((0.0, 2.0), (1e-3, 2.0))
    assert not fingerprints_match((float("nan"), 2.0), (float("nan"), 2.0))


def test_verify_fingerprint_names_the_version() -> None:
    verify_fingerprint((1.0, 2.0), (1.0, 2.0), version=3)
    with pytest.raises(WeightSyncError, match="version 7"):
        verify_fingerprint((1.0, 2.0), (1.0, 2.5), version=7)


def test_serialize_writes_the_bytes_safetensors_writes() -> None:
    # Same bytes, so a sha256 recorded before this serializer existed stays valid. Every
    # dtype of the layout order, non-ASCII names and an empty tensor.
    state = {f"t.{dtype}": torch.ones(2, 3).to(dtype) for dtype in
             (torch.int64, torch.float64, torch.float32, torch.int32, torch.bfloat16, torch.float16,
              torch.int16, torch.int8, torch.uint8, torch.bool)}
    state.update({"Z": torch.randn(3), "\u00e9": torch.randn(2), "\uff5e": torch.randn(1), "empty": torch.ones(0)})
    assert serialize_weights(state) == safetensors.torch.save(state)


def test_payload_file_round_trips(tmp_path: Path) -> None:
    state = _state_dict()
    write_weights_file(serialize_weights(state), tmp_path / "v1.safetensors")
    back = load_weights_file(tmp_path / "v1.safetensors")
    assert sorted(back) == sorted(state)
    for name, t in state.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t)


def test_build_payload_is_serialize_sha_and_fingerprint() -> None:
    state = _state_dict()
    data, sha, fingerprint = build_payload(state)
    assert data == serialize_weights(state)
    assert sha == compute_sha256(data)
    assert fingerprint == compute_fingerprint(deserialize_weights(data).values())
