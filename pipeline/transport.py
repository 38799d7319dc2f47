"""Weight transport: named tensors in buckets, moved without serialisation where it can.

Two transports carry a trainer's weights to rollout engines: ``shm`` (safetensors bytes
through the object store and /dev/shm, works everywhere) and ``cuda_ipc`` (flat per-dtype
buckets on the trainer's GPU, published as a small descriptor of CUDA IPC handles that the
engine maps without a copy). ``select_transport`` picks one. This module is plumbing: it
knows tensors, not models.

Guarantees:
- one ``bytes`` channel carries either: ``is_ipc_payload`` tells a descriptor from
  safetensors bytes;
- ``CudaIpcExporter``'s ring of bucket slots is allocated once and never freed while it
  lives; a slot rewritten under a reader is refused by the fingerprint check;
- the consumer verifies the buckets' fingerprint before loading (``verify_opened``);
- the exporter synchronises its stream before the descriptor leaves;
- GPUs are named by UUID; a consumer that cannot see the trainer's GPU gets
  ``WeightSyncError`` naming the fix. Details: docs/architecture.md, "Weight transport".
"""

from __future__ import annotations

import os
import uuid
import weakref
from collections.abc import Mapping

import msgspec
import torch

from pipeline.dtypes import format_dtype, resolve_dtype
from pipeline.weights import (
    Fingerprint,
    WeightSyncError,
    add_fingerprints,
    compute_fingerprint,
    decode_rest_fingerprint,
    drop_tied_duplicates,
    fingerprints_match,
    read_payload_metadata,
)

IPC_MAGIC = b"CONVEYOR-CUDA-IPC\x00"
TRANSPORTS = ("shm", "cuda_ipc")
TRANSPORT_ENV = "CONVEYOR_WEIGHT_TRANSPORT"
DEFAULT_BUCKET_BYTES = 1 << 30

# Exporters alive in this process, by key: a descriptor made here resolves to them.
_LOCAL: weakref.WeakValueDictionary[str, CudaIpcExporter] = weakref.WeakValueDictionary()


class TensorSlot(msgspec.Struct, frozen=True, kw_only=True):
    """Where one named tensor sits: ``numel`` elements from ``offset`` of bucket ``bucket``."""

    name: str
    bucket: int
    offset: int
    shape: list[int]


class IpcHandle(msgspec.Struct, frozen=True, kw_only=True):
    """What ``torch.multiprocessing.reductions.reduce_tensor`` says of a CUDA tensor, in
    plain fields (no pickled classes), with the GPU named by UUID."""

    device_uuid: str
    numel: int
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


class IpcBucket(msgspec.Struct, frozen=True, kw_only=True):
    dtype: str
    handle: IpcHandle


class IpcPayload(msgspec.Struct, frozen=True, kw_only=True):
    """The descriptor of one published version (see the module guarantees)."""

    key: str  # the exporter's key
    pid: int  # the exporting process
    slot: int
    version: int
    fingerprint: tuple[float, float]
    buckets: list[IpcBucket]
    tensors: list[TensorSlot]
    # A partial payload: the fingerprint of the served parameters it leaves as they are
    # (``pipeline.weights``' rest); None: the buckets hold the whole model.
    rest: tuple[float, float] | None = None


def is_ipc_payload(data: bytes | bytearray | memoryview) -> bool:
    """True for a ``cuda_ipc`` descriptor, False for safetensors bytes."""
    return bytes(memoryview(data)[: len(IPC_MAGIC)]) == IPC_MAGIC


def encode_ipc_payload(payload: IpcPayload) -> bytes:
    return IPC_MAGIC + msgspec.msgpack.encode(payload)


def decode_ipc_payload(data: bytes | bytearray | memoryview) -> IpcPayload:
    if not is_ipc_payload(data):
        raise WeightSyncError("weight payload is not a cuda_ipc descriptor (no magic prefix)")
    try:
        return msgspec.msgpack.decode(bytes(memoryview(data)[len(IPC_MAGIC):]), type=IpcPayload)
    except msgspec.DecodeError as exc:
        raise WeightSyncError(f"cuda_ipc descriptor is damaged ({exc})") from None


def read_rest_fingerprint(data: bytes | bytearray | memoryview) -> Fingerprint | None:
    """A partial payload's ``rest`` fingerprint (either transport); None for a whole one."""
    if is_ipc_payload(data):
        rest = decode_ipc_payload(data).rest
        return None if rest is None else (float(rest[0]), float(rest[1]))
    return decode_rest_fingerprint(read_payload_metadata(data))


def read_ipc_shapes(data: bytes | bytearray | memoryview) -> dict[str, tuple[int, ...]]:
    """Name -> shape from a descriptor (nothing is mapped)."""
    return {t.name: tuple(t.shape) for t in decode_ipc_payload(data).tensors}


def select_transport(weights_on_gpu: bool, cluster_gpus: float, override: str | None = None) -> str:
    """The trainer's transport (see the module doc); ``override`` is the env's value."""
    if override:
        if override not in TRANSPORTS:
            raise ValueError(f"{TRANSPORT_ENV}: expected one of {TRANSPORTS}, got {override!r}")
        if override == "cuda_ipc" and not weights_on_gpu:
            raise ValueError(f"{TRANSPORT_ENV}=cuda_ipc: the trainer's weights are not on a GPU")
        return override
    return "cuda_ipc" if weights_on_gpu and cluster_gpus == 1 else "shm"


def plan_buckets(shapes: Mapping[str, tuple[torch.Size | tuple[int, ...], torch.dtype]],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> tuple[list[tuple[torch.dtype, int]], list[TensorSlot]]:
    """Pack named tensors, in the given order, into flat buckets of one dtype each, at
    most ``bucket_bytes`` (a larger tensor gets a bucket of its own).

    Returns ([(dtype, numel)] per bucket, slots). Pure: sizes only.
    """
    buckets: list[tuple[torch.dtype, int]] = []
    slots: list[TensorSlot] = []
    open_bucket: dict[torch.dtype, int] = {}  # dtype -> index of the bucket being filled
    for name, (shape, dtype) in shapes.items():
        numel = 1
        for d in shape:
            numel *= int(d)
        elem = torch.empty((), dtype=dtype).element_size()
        index = open_bucket.get(dtype)
        if index is not None and buckets[index][1] and (buckets[index][1] + numel) * elem > bucket_bytes:
            index = None
        if index is None:
            index = len(buckets)
            buckets.append((dtype, 0))
            open_bucket[dtype] = index
        bucket_dtype, used = buckets[index]
        slots.append(TensorSlot(name=name, bucket=index, offset=used, shape=[int(d) for d in shape]))
        buckets[index] = (bucket_dtype, used + numel)
    return buckets, slots


def _device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _find_local_device(device_uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if _device_uuid(torch.device("cuda", index)) == device_uuid:
            return index
    raise WeightSyncError(
        f"cuda_ipc: the trainer's GPU {device_uuid} is not visible to this process "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); nothing was loaded. "
        f"Set {TRANSPORT_ENV}=shm to send the weights through shared memory"
    )


def _export_handle(bucket: torch.Tensor) -> IpcHandle:
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(bucket)
    (_cls, _size, _stride, offset, _storage_cls, _dtype, device, handle, size_bytes, offset_bytes, _grad,
     ref_handle, ref_offset, event_handle, event_sync) = args
    if offset != 0:
        raise ValueError("cuda_ipc: a bucket must start its storage (offset 0)")
    return IpcHandle(device_uuid=_device_uuid(torch.device("cuda", device)), numel=bucket.numel(),
                     storage_handle=handle, storage_size_bytes=size_bytes, storage_offset_bytes=offset_bytes,
                     ref_counter_handle=ref_handle, ref_counter_offset=ref_offset, event_handle=event_handle,
                     event_sync_required=bool(event_sync))


def _open_handle(handle: IpcHandle, dtype: torch.dtype) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device = _find_local_device(handle.device_uuid)
    return rebuild_cuda_tensor(torch.Tensor, (handle.numel,), (1,), 0, torch.UntypedStorage, dtype, device,
                               handle.storage_handle, handle.storage_size_bytes, handle.storage_offset_bytes, False,
                               handle.ref_counter_handle, handle.ref_counter_offset, handle.event_handle,
                               handle.event_sync_required)


def _slice_named(buckets: list[torch.Tensor], tensors: list[TensorSlot]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for t in tensors:
        numel = 1
        for d in t.shape:
            numel *= d
        out[t.name] = buckets[t.bucket][t.offset : t.offset + numel].view(t.shape)
    return out


class CudaIpcExporter:
    """The trainer's side of ``cuda_ipc``: a ring of bucket sets on one GPU.

    ``export(state_dict, version)`` packs the tensors (tied names once, cast to
    ``dtype``) into the next slot and returns (descriptor bytes, fingerprint). The first
    call fixes the layout; a later state dict must have the same names and shapes.
    """

    def __init__(self, dtype: torch.dtype, *, slots: int = 2, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if slots < 1:
            raise ValueError(f"slots: expected >= 1, got {slots}")
        self.dtype = dtype
        self.slots = slots
        self.bucket_bytes = bucket_bytes
        self.key = uuid.uuid4().hex
        self._layout: tuple[list[tuple[torch.dtype, int]], list[TensorSlot]] | None = None
        self._rings: list[list[torch.Tensor]] = []
        self._handles: list[list[IpcBucket]] = []
        self._published = 0
        _LOCAL[self.key] = self

    def _allocate(self, state: Mapping[str, torch.Tensor]) -> None:
        device = next(iter(state.values())).device
        if device.type != "cuda":
            raise ValueError(f"cuda_ipc: weights must be on a CUDA device, got {device}")
        sizes = {name: (t.shape, self.dtype if t.is_floating_point() else t.dtype) for name, t in state.items()}
        self._layout = plan_buckets(sizes, self.bucket_bytes)
        buckets, _ = self._layout
        for _ in range(self.slots):
            ring = [torch.empty(numel, dtype=dtype, device=device) for dtype, numel in buckets]
            self._rings.append(ring)
            self._handles.append([IpcBucket(dtype=format_dtype(b.dtype), handle=_export_handle(b)) for b in ring])

    def export(self, state_dict: Mapping[str, torch.Tensor], version: int,
               rest: Fingerprint | None = None) -> tuple[bytes, Fingerprint]:
        """``rest``: the fingerprint of what a partial ``state_dict`` leaves out (the
        descriptor carries it; the fingerprint returned is the whole model's)."""
        state = drop_tied_duplicates(state_dict)
        if self._layout is None:
            self._allocate(state)
        assert self._layout is not None
        slot = self._published % self.slots
        views = _slice_named(self._rings[slot], self._layout[1])
        if list(views) != list(state):
            raise ValueError(f"cuda_ipc: the state dict's names changed since the first export "
                             f"({sorted(set(views) ^ set(state))[:5]})")
        with torch.no_grad():
            for name, tensor in state.items():
                views[name].copy_(tensor.detach())
        fingerprint = compute_fingerprint(self._rings[slot])  # reads back: the copies are done
        self._published += 1
        payload = IpcPayload(key=self.key, pid=os.getpid(), slot=slot, version=version, fingerprint=fingerprint,
                             buckets=self._handles[slot], tensors=self._layout[1], rest=rest)
        return encode_ipc_payload(payload), add_fingerprints(fingerprint, rest)

    def local_views(self, slot: int) -> dict[str, torch.Tensor]:
        assert self._layout is not None
        return _slice_named(self._rings[slot], self._layout[1])

    def close(self) -> None:
        self._rings, self._handles, self._layout = [], [], None
        _LOCAL.pop(self.key, None)


def open_ipc_payload(data: bytes | bytearray | memoryview) -> tuple[IpcPayload, dict[str, torch.Tensor]]:
    """(descriptor, name -> CUDA tensor viewing the trainer's bucket); see the module doc.
    The views must be dropped once loaded: they keep the mapping open."""
    payload = decode_ipc_payload(data)
    if payload.pid == os.getpid():
        exporter = _LOCAL.get(payload.key)
        if exporter is None:
            raise WeightSyncError("cuda_ipc: the descriptor names an exporter of this process that is gone")
        return payload, exporter.local_views(payload.slot)
    buckets = [_open_handle(b.handle, resolve_dtype(b.dtype)) for b in payload.buckets]
    return payload, _slice_named(buckets, payload.tensors)


def verify_opened(payload: IpcPayload, fingerprint: Fingerprint) -> None:
    """Raise ``WeightSyncError`` unless the mapped buckets hold what was published."""
    if not fingerprints_match(tuple(payload.fingerprint), fingerprint):
        raise WeightSyncError(
            f"cuda_ipc: buckets of version {payload.version} read (sum={fingerprint[0]:.9g}, "
            f"sumsq={fingerprint[1]:.9g}) but were published as (sum={payload.fingerprint[0]:.9g}, "
            f"sumsq={payload.fingerprint[1]:.9g}): the slot was rewritten or mapped wrongly; nothing was loaded"
        )
