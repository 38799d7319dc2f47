"""The transport's pure parts on CPU: bucket plans, descriptors, the transport rule.
(Mapping CUDA IPC handles needs a GPU: tests/gpu/test_transport_gpu.py.)"""

from __future__ import annotations

import pytest
import torch

from pipeline.transport import (
    IpcBucket,
    IpcHandle,
    IpcPayload,
    TensorSlot,
    decode_ipc_payload,
    encode_ipc_payload,
    is_ipc_payload,
    plan_buckets,
    read_ipc_shapes,
    select_transport,
)
from pipeline.weights import WeightSyncError, serialize_weights


def test_buckets_pack_in_order_per_dtype_and_respect_the_size():
    bf16, f32 = torch.bfloat16, torch.float32
    shapes = {"a": ((10, 10), bf16), "b": ((50,), f32), "c": ((200,), bf16), "d": ((300,), bf16)}
    # bucket_bytes 800: a (100 el = 200 B) + c (200 el = 400 B) fit; d (600 B) would make 1200 B.
    buckets, slots = plan_buckets(shapes, bucket_bytes=800)
    assert buckets == [(bf16, 300), (f32, 50), (bf16, 300)]
    assert [(s.name, s.bucket, s.offset) for s in slots] == [("a", 0, 0), ("b", 1, 0), ("c", 0, 100), ("d", 2, 0)]


def test_a_tensor_larger_than_a_bucket_gets_its_own():
    buckets, slots = plan_buckets({"big": ((1000,), torch.float32), "small": ((1,), torch.float32)}, bucket_bytes=16)
    assert buckets == [(torch.float32, 1000), (torch.float32, 1)]
    assert [s.bucket for s in slots] == [0, 1]


def _payload() -> IpcPayload:
    handle = IpcHandle(device_uuid="GPU-1", numel=6, storage_handle=b"\x01" * 64, storage_size_bytes=12,
                       storage_offset_bytes=0, ref_counter_handle=b"/torch_1", ref_counter_offset=0,
                       event_handle=None, event_sync_required=False)
    return IpcPayload(key="k", pid=1, slot=0, version=3, fingerprint=(1.5, 2.5),
                      buckets=[IpcBucket(dtype="bfloat16", handle=handle)],
                      tensors=[TensorSlot(name="w", bucket=0, offset=0, shape=[2, 3])])


def test_descriptor_round_trips_and_is_told_apart_from_safetensors():
    data = encode_ipc_payload(_payload())
    assert is_ipc_payload(data) and decode_ipc_payload(data) == _payload()
    assert read_ipc_shapes(data) == {"w": (2, 3)}
    safetensors = serialize_weights({"w": torch.ones(2, 3)})
    assert not is_ipc_payload(safetensors)
    with pytest.raises(WeightSyncError, match="not a cuda_ipc descriptor"):
        decode_ipc_payload(safetensors)
    with pytest.raises(WeightSyncError, match="damaged"):
        decode_ipc_payload(data[:-5])


def test_transport_rule():
    assert select_transport(True, 1.0) == "cuda_ipc"
    assert select_transport(True, 2.0) == "shm"  # disaggregated: the rollout may not see the trainer's GPU
    assert select_transport(False, 1.0) == "shm"
    assert select_transport(True, 2.0, "cuda_ipc") == "cuda_ipc"
    with pytest.raises(ValueError, match="cuda_ipc: the trainer's weights are not on a GPU"):
        select_transport(False, 0.0, "cuda_ipc")
    with pytest.raises(ValueError, match="expected one of"):
        select_transport(True, 1.0, "nccl")
