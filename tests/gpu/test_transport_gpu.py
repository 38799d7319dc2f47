"""Fingerprints, payloads and the cuda_ipc transport on a real GPU (no vLLM, no Ray)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pipeline.transport import CudaIpcExporter, decode_ipc_payload, is_ipc_payload, open_ipc_payload, verify_opened
from pipeline.weights import WeightSyncError, build_payload, compute_fingerprint, fingerprints_match


def make_state(device, dtype=torch.float32, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"embed.weight": (300, 64), "layers.0.q.weight": (64, 64), "layers.0.norm.weight": (64,),
              "lm_head.weight": (300, 64)}
    return {n: torch.randn(s, generator=g).to(device, dtype) for n, s in shapes.items()}


def test_fingerprint_on_gpu_equals_cpu(cuda):
    for dtype in (torch.float32, torch.bfloat16):
        state = make_state(cuda, dtype)
        on_gpu = compute_fingerprint(state.values())
        on_cpu = compute_fingerprint(t.cpu() for t in state.values())
        # Same elements summed in float64 in another order: rounding at ~1e-16 relative.
        assert fingerprints_match(on_gpu, on_cpu, rtol=1e-12), (on_gpu, on_cpu)
        assert compute_fingerprint(state.values(), dtype=torch.bfloat16) == pytest.approx(
            compute_fingerprint((t.cpu() for t in state.values()), dtype=torch.bfloat16), rel=1e-12)


def test_fingerprint_of_tensors_on_two_devices(cuda):
    state = make_state(cuda)
    mixed = [state["embed.weight"], state["lm_head.weight"].cpu()]
    assert fingerprints_match(compute_fingerprint(mixed), compute_fingerprint(t.cpu() for t in mixed), rtol=1e-12)


def test_payload_from_gpu_tensors_is_the_cpu_payload(cuda):
    state = make_state(cuda, torch.bfloat16)
    data_gpu, sha_gpu, fp_gpu = build_payload(state)
    data_cpu, sha_cpu, fp_cpu = build_payload({n: t.cpu() for n, t in state.items()})
    assert data_gpu == data_cpu and sha_gpu == sha_cpu and fp_gpu == fp_cpu


def test_ipc_in_this_process_resolves_to_the_exporters_buckets(cuda):
    exporter = CudaIpcExporter(torch.bfloat16, slots=2)
    state = make_state(cuda)
    data, _ = exporter.export(state, version=1)
    assert is_ipc_payload(data)
    payload, views = open_ipc_payload(data)
    assert payload.version == 1 and list(views) == list(state)
    for name, t in state.items():
        assert torch.equal(views[name], t.to(torch.bfloat16))
    verify_opened(payload, compute_fingerprint(views.values()))
    # The next export goes to the other slot; the first slot keeps version 1.
    data2, _ = exporter.export({n: t * 2 for n, t in state.items()}, version=2)
    assert decode_ipc_payload(data2).slot != payload.slot
    assert torch.equal(views["embed.weight"], state["embed.weight"].to(torch.bfloat16))
    with pytest.raises(ValueError, match="names changed"):
        exporter.export({"other": state["embed.weight"]}, version=3)


_CONSUMER = textwrap.dedent("""
    import json, sys
    from pipeline.transport import open_ipc_payload, verify_opened
    from pipeline.weights import compute_fingerprint
    data = open(sys.argv[1], "rb").read()
    payload, views = open_ipc_payload(data)
    fp = compute_fingerprint(views.values())
    verify_opened(payload, fp)
    print(json.dumps({"fp": fp, "first": float(views["embed.weight"][0, 0]), "device": views["embed.weight"].device.type}))
""")


def _consume(tmp_path, data: bytes, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    (tmp_path / "payload.bin").write_bytes(data)
    (tmp_path / "consumer.py").write_text(_CONSUMER)
    root = str(Path(__file__).parents[2])
    path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, str(tmp_path / "consumer.py"), str(tmp_path / "payload.bin")],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path, **(env or {})},
                          cwd=root, timeout=300)


def test_ipc_across_processes_maps_the_trainers_buckets(cuda, tmp_path):
    exporter = CudaIpcExporter(torch.bfloat16, slots=2)
    state = make_state(cuda)
    data, fp = exporter.export(state, version=7)
    done = _consume(tmp_path, data)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["device"] == "cuda"
    assert fingerprints_match(tuple(seen["fp"]), fp), (seen, fp)
    assert seen["first"] == float(state["embed.weight"][0, 0].to(torch.bfloat16))


def test_ipc_slot_rewritten_under_the_reader_is_refused(cuda, tmp_path):
    exporter = CudaIpcExporter(torch.bfloat16, slots=1)
    state = make_state(cuda)
    data, _ = exporter.export(state, version=1)
    exporter.export({n: t + 1 for n, t in state.items()}, version=2)  # one slot: version 1 is overwritten
    done = _consume(tmp_path, data)
    assert done.returncode != 0 and "was rewritten or mapped wrongly" in done.stderr, done.stderr[-2000:]
    payload, views = open_ipc_payload(data)
    with pytest.raises(WeightSyncError, match="nothing was loaded"):
        verify_opened(payload, compute_fingerprint(views.values()))


def test_ipc_consumer_without_the_gpu_is_told_to_use_shm(cuda, tmp_path):
    exporter = CudaIpcExporter(torch.bfloat16)
    data, _ = exporter.export(make_state(cuda), version=1)
    done = _consume(tmp_path, data, env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode != 0 and "CONVEYOR_WEIGHT_TRANSPORT=shm" in done.stderr, done.stderr[-2000:]
