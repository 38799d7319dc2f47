"""Weight transport: trainer state dict -> bytes -> rollout engine, and proof of arrival.

This module is plumbing: it knows tensors, not models. Details of each rule:
docs/architecture.md, "Weights".

Guarantees:
- ``serialize_weights`` produces safetensors bytes (no pickle), the very bytes
  ``safetensors.torch.save`` would; ``deserialize_weights`` is its exact inverse;
- tied parameters travel once; distinct views of one storage are copied apart;
- ``load_weights_file`` returns tensors that view a private mapping of the file (no copy);
- ``compute_fingerprint`` (sum, sum of squares in float64, on the tensor's device) is
  invariant to reshaping, fusing, splitting and zero padding: every parameter once, tied
  parameters once, buffers never;
- ``check_payload_fits`` refuses a misshaped payload from headers alone, before loading;
- ``fingerprints_match`` fails on any change larger than rounding (``WeightSyncError``);
- a partial payload (some of the served tensors: LoRA's merged modules) carries the
  fingerprint of every parameter it leaves as it is (``rest``, in its safetensors
  metadata), so a receiver checks the whole model after loading only part of it.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import safetensors.torch
import torch

Fingerprint = tuple[float, float]

# Elements per float64 chunk in ``compute_fingerprint``: 2 MiB stays in cache, so the
# float64 copy costs no memory traffic (a 128 MiB chunk was 1.7x slower).
_CHUNK = 1 << 18
# On a GPU each chunk costs kernel launches, not cache misses: 2^24 elements (128 MiB
# of float64 scratch) keeps a 268M-parameter model to a few dozen launches.
_DEVICE_CHUNK = 1 << 24

# safetensors dtype names, in the order safetensors lays tensors out (its dtype enum,
# descending; then by name).
_ST_DTYPES: dict[torch.dtype, str] = {
    torch.uint64: "U64", torch.int64: "I64", torch.float64: "F64", torch.float32: "F32",
    torch.uint32: "U32", torch.int32: "I32", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.uint16: "U16", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
_ST_RANK = {name: rank for rank, name in enumerate(_ST_DTYPES.values())}
_ST_TORCH = {name: dtype for dtype, name in _ST_DTYPES.items()}
# safetensors metadata key of a partial payload's ``rest`` fingerprint: [sum, sum of squares].
REST_FINGERPRINT_KEY = "conveyor.rest_fingerprint"


class WeightSyncError(RuntimeError):
    """Weights a rollout worker serves are not the weights the trainer published."""


def _view_key(t: torch.Tensor) -> tuple:
    """Identity of a view: two names with equal keys are the same tensor (tied)."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)


def drop_tied_duplicates(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep the first name of every distinct tensor view; see the module's tying rule."""
    seen: set[tuple] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        key = _view_key(tensor)
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor
    return out


def _unique_cpu_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tied names dropped; distinct views of one storage kept as distinct tensors."""
    tensors: dict[str, torch.Tensor] = {}
    storages: set[tuple] = set()
    for name, tensor in drop_tied_duplicates(state_dict).items():
        t = tensor.detach().to("cpu").contiguous()
        storage = (t.untyped_storage().data_ptr(), t.device)
        # safetensors refuses tensors that share memory; views of one flat buffer are
        # distinct parameters, so they are copied apart rather than dropped.
        if storage in storages or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        storages.add((t.untyped_storage().data_ptr(), t.device))
        tensors[name] = t
    return tensors


def serialize_weights(state_dict: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """State dict -> safetensors bytes of contiguous CPU tensors, tied names dropped;
    ``metadata``: the header's ``__metadata__`` (strings)."""
    tensors = _unique_cpu_tensors(state_dict)
    if any(t.dtype not in _ST_DTYPES for t in tensors.values()):
        return safetensors.torch.save(tensors, metadata=dict(metadata) if metadata else None)
    order = sorted(tensors, key=lambda n: (_ST_RANK[_ST_DTYPES[tensors[n].dtype]], n.encode()))
    header: dict[str, dict] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    head += b" " * (-len(head) % 8)
    start = 8 + len(head)
    # Allocated uninitialised by torch, filled once, then handed to bytes (one more copy:
    # Python cannot give a bytes object a buffer it did not allocate).
    buf = torch.empty(start + offset, dtype=torch.uint8)
    buf[:start] = torch.frombuffer(bytearray(struct.pack("<Q", len(head)) + head), dtype=torch.uint8)
    for name in order:
        t = tensors[name]
        lo, hi = header[name]["data_offsets"]
        if hi > lo:
            buf[start + lo : start + hi].copy_(t.reshape(-1).view(torch.uint8))
    return buf.numpy().tobytes()


def deserialize_weights(data: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """Safetensors bytes -> name -> CPU tensor (inverse of ``serialize_weights``)."""
    return safetensors.torch.load(bytes(data))


def write_weights_file(data: bytes | bytearray | memoryview, path: Path) -> None:
    """Write a payload to ``path`` (on /dev/shm: one copy into page cache, no disk)."""
    with open(path, "wb") as f:
        f.write(data)


def load_weights_file(path: Path | str) -> dict[str, torch.Tensor]:
    """Name -> CPU tensor viewing a private map of the payload file (see module doc)."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    shapes = read_payload_shapes(mapped)
    (size,) = struct.unpack("<Q", mapped[:8])
    header = json.loads(mapped[8 : 8 + size])
    start = 8 + size
    out: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_TORCH.get(entry["dtype"])
        if dtype is None:  # a dtype this reader does not know: let safetensors read it all
            return safetensors.torch.load(bytes(mapped))
        lo, hi = entry["data_offsets"]
        if hi == lo:
            out[name] = torch.empty(shapes[name], dtype=dtype)
            continue
        flat = torch.frombuffer(mapped, dtype=torch.uint8, count=hi - lo, offset=start + lo)
        out[name] = flat.view(dtype).reshape(shapes[name])
    return out


def read_payload_shapes(data: bytes | bytearray | memoryview) -> dict[str, tuple[int, ...]]:
    """Name -> shape from a safetensors header (8-byte little-endian length, JSON)."""
    view = memoryview(data)
    if len(view) < 8:
        raise WeightSyncError(f"weight payload of {len(view)} bytes is too short to be safetensors")
    (size,) = struct.unpack("<Q", view[:8])
    if size > len(view) - 8:
        raise WeightSyncError(f"weight payload header claims {size} bytes, only {len(view) - 8} follow")
    try:
        header = json.loads(bytes(view[8 : 8 + size]))
    except ValueError as exc:
        raise WeightSyncError(f"weight payload header is not valid JSON ({exc})") from None
    return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}


def read_payload_metadata(data: bytes | bytearray | memoryview) -> dict[str, str]:
    """A safetensors payload's ``__metadata__`` (empty when it has none)."""
    view = memoryview(data)
    read_payload_shapes(view)  # the header's length and JSON checked, with their errors
    (size,) = struct.unpack("<Q", view[:8])
    return dict(json.loads(bytes(view[8 : 8 + size])).get("__metadata__") or {})


def encode_rest_fingerprint(rest: Fingerprint) -> dict[str, str]:
    """The metadata of a partial payload whose untouched parameters fingerprint ``rest``."""
    return {REST_FINGERPRINT_KEY: json.dumps([float(rest[0]), float(rest[1])])}


def decode_rest_fingerprint(metadata: Mapping[str, str]) -> Fingerprint | None:
    """``rest`` of a partial payload's metadata; None for a whole payload."""
    text = metadata.get(REST_FINGERPRINT_KEY)
    if text is None:
        return None
    try:
        total, total_sq = (float(x) for x in json.loads(text))
    except (ValueError, TypeError) as exc:
        raise WeightSyncError(f"weight payload metadata {REST_FINGERPRINT_KEY}: expected [sum, sumsq], "
                              f"got {text!r} ({exc})") from None
    return (total, total_sq)


def add_fingerprints(a: Fingerprint, b: Fingerprint | None) -> Fingerprint:
    """The fingerprint of two disjoint sets of tensors (``b`` None: ``a``)."""
    return a if b is None else (a[0] + b[0], a[1] + b[1])


def read_checkpoint_shapes(checkpoint_dir: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a checkpoint directory's ``*.safetensors`` files."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(checkpoint_dir).glob("*.safetensors")):
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            shapes.update(read_payload_shapes(struct.pack("<Q", size) + f.read(size)))
    return shapes


def check_payload_fits(payload: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]) -> None:
    """Raise ``WeightSyncError`` if the payload names a tensor ``expected`` lacks or gives
    one another shape. Names ``expected`` has and the payload lacks are allowed here (a
    tied alias, a buffer); the fingerprint check after loading catches a real omission."""
    unknown = sorted(set(payload) - set(expected))
    misshaped = sorted(f"{n} {payload[n]} != {expected[n]}" for n in payload if n in expected and payload[n] != expected[n])
    if unknown or misshaped:
        raise WeightSyncError(
            f"weight payload does not fit the served model: unknown names {unknown[:5]}"
            f"{' ...' if len(unknown) > 5 else ''}, wrong shapes {misshaped[:5]}"
            f"{' ...' if len(misshaped) > 5 else ''}; nothing was loaded"
        )


def compute_sha256(data: bytes | bytearray | memoryview) -> str:
    """Hex sha256 of the payload; guards the transport, not the engine's copy."""
    return hashlib.sha256(data).hexdigest()


def build_payload(state_dict: Mapping[str, torch.Tensor], rest: Fingerprint | None = None) -> tuple[bytes, str, Fingerprint]:
    """(safetensors bytes, their sha256, fingerprint of the tensors they hold, plus
    ``rest``: a partial payload's untouched parameters, written into its metadata, so
    the fingerprint is the whole served model's).

    The sha256 runs in a thread while the fingerprint is computed here: hashlib and
    torch both release the GIL, so the two overlap on two cores.
    """
    from concurrent.futures import ThreadPoolExecutor

    tensors = _unique_cpu_tensors(state_dict)
    data = serialize_weights(tensors, encode_rest_fingerprint(rest) if rest is not None else None)
    with ThreadPoolExecutor(max_workers=1) as pool:
        sha = pool.submit(compute_sha256, data)
        fingerprint = compute_fingerprint(tensors.values())
        return data, sha.result(), add_fingerprints(fingerprint, rest)


def accumulate_fingerprint(tensors: Iterable[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """[2] float64 (sum, sum of squares) on the tensors' device, without a host sync.

    Accumulates where the data lives: a CUDA tensor is summed on its GPU in float64 and
    nothing is read back here (the caller reads once, for all tensors). Tensors on
    several devices are each summed on their own device and added on the CPU at the end.
    ``dtype``: as in ``compute_fingerprint``.
    """
    totals: dict[torch.device, list[torch.Tensor]] = {}
    with torch.no_grad():
        for tensor in tensors:
            flat = tensor.detach().reshape(-1)
            device = flat.device
            if device not in totals:
                totals[device] = [torch.zeros((), dtype=torch.float64, device=device) for _ in range(2)]
            total, total_sq = totals[device]
            chunk_len = _CHUNK if device.type == "cpu" else _DEVICE_CHUNK
            for start in range(0, flat.numel(), chunk_len):
                chunk = flat[start : start + chunk_len]
                if dtype is not None:
                    chunk = chunk.to(dtype)
                chunk = chunk.to(torch.float64)
                total += chunk.sum()
                total_sq += torch.dot(chunk, chunk)
    if not totals:
        return torch.zeros(2, dtype=torch.float64)
    if len(totals) == 1:
        ((total, total_sq),) = totals.values()
        return torch.stack([total, total_sq])
    return torch.stack([torch.stack(pair).to("cpu") for pair in totals.values()]).sum(dim=0)


def compute_fingerprint(tensors: Iterable[torch.Tensor], dtype: torch.dtype | None = None) -> Fingerprint:
    """(sum, sum of squares) over all elements of all tensors, accumulated in float64
    on the tensors' own device, read back once.

    ``dtype``: round every tensor to this dtype first. A worker whose engine serves
    bfloat16 weights from a float32 payload passes ``torch.bfloat16`` to predict the
    fingerprint of what its engine should now hold.
    """
    total, total_sq = accumulate_fingerprint(tensors, dtype).tolist()
    return (float(total), float(total_sq))


def fingerprints_match(a: Fingerprint, b: Fingerprint, rtol: float = 1e-6) -> bool:
    """True when both sums agree to ``rtol``.

    The sum of zero-mean weights can be near 0 while each term is not, so its tolerance
    is scaled by the root of the sum of squares (an upper bound on the size of the
    rounding errors of a sum of that many terms, up to the element count's root).
    """
    (s_a, q_a), (s_b, q_b) = a, b
    if not all(math.isfinite(x) for x in (s_a, q_a, s_b, q_b)):
        return False
    scale = math.sqrt(max(q_a, q_b))
    return math.isclose(q_a, q_b, rel_tol=rtol, abs_tol=0.0) and math.isclose(
        s_a, s_b, rel_tol=rtol, abs_tol=rtol * scale
    )


def verify_fingerprint(expected: Fingerprint, live: Fingerprint, *, version: int, rtol: float = 1e-6) -> None:
    """Raise ``WeightSyncError`` unless the live weights are the expected ones."""
    if not fingerprints_match(expected, live, rtol):
        raise WeightSyncError(
            f"weights of version {version} did not arrive intact: the engine's live "
            f"parameters have fingerprint (sum={live[0]:.9g}, sumsq={live[1]:.9g}) but the "
            f"payload has (sum={expected[0]:.9g}, sumsq={expected[1]:.9g}) "
            f"(relative tolerance {rtol:g}); a parameter was not loaded, was loaded into "
            f"the wrong place, or the engine serves another dtype than the fingerprint assumes"
        )
