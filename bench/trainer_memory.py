"""The trainer's pass at real shapes: memory and time of the dense head, the chunked head
and the chunked head with gradient checkpointing, side by side, against the plan's estimate.

For each shape (default qwen3_0.6b, gemma3_1b and qwen3_4b; ``--model`` one of
``stages/models/shapes.py``), random weights in bfloat16 on the GPU (nothing downloaded),
one trainer pass: ``forward_completion_logprobs`` over ``ROWS`` rows of ``PROMPT`` +
``COMPLETION`` tokens, then backward of their summed log-probs into bf16 gradients. Rows:

- ``dense``: ``train.logit_chunk_tokens 0``, the pass's completion logits at once;
- ``chunked``: ``train.logit_chunk_tokens 1024`` (``stages.models.logprobs.chunked_head``);
- ``chunked_checkpointed``: and ``train.gradient_checkpointing`` (blocks recomputed in backward).

Each row reports its peak memory above the weights and gradients
(``torch.cuda.max_memory_allocated``), the plan's estimate of the same pass
(``pipeline.memory.admission.estimate_forward_bytes``, what admission and the one-GPU plan
reserve) and their ratio, the pass's time (best of ``REPEATS`` after a warm-up), and its
agreement with the dense row (largest log-prob difference, gradient-norm ratio). A row
that runs out of memory says so. The blocks run eager (the trainer compiles them on a GPU).
``--quick`` runs qwen3_0.6b scaled down on whatever device there is, memory unmeasured on a CPU.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.common import new_figure, publish_result, publish_skipped_without_gpu

SHAPES = ("qwen3_0.6b", "gemma3_1b", "qwen3_4b")
ROWS, PROMPT, COMPLETION = 2, 512, 3584  # 8,192 tokens: half of train.pass_tokens' default
REPEATS = 2
VARIANTS = {"dense": (0, False), "chunked": (1024, False), "chunked_checkpointed": (1024, True)}
MIB = 1 << 20


def build_pass(vocab: int, rows: int, prompt: int, completion: int, device: Any, seed: int = 0) -> tuple:
    """(input_ids, attention_mask, completion_mask, positions) of ``rows`` full rows."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, prompt + completion), generator=gen)
    mask = torch.ones_like(ids)
    completion_mask = torch.ones(rows, completion)
    positions = torch.arange(prompt, prompt + completion).expand(rows, -1).contiguous()
    return tuple(t.to(device) for t in (ids, mask, completion_mask, positions))


def run_variant(model: Any, inputs: tuple, chunk_tokens: int, checkpointed: bool, repeats: int) -> dict[str, Any]:
    """One pass (forward and backward) ``repeats`` + 1 times; the last one's log-probs kept."""
    import torch

    from stages.models.logprobs import forward_completion_logprobs
    from stages.trainer.engine import enable_gradient_checkpointing

    if checkpointed:
        enable_gradient_checkpointing(model)  # as the trainer does
    else:
        model.gradient_checkpointing_disable()
    cuda = inputs[0].is_cuda
    laps, peak = [], None
    try:
        for _ in range(repeats + 1):
            model.zero_grad(set_to_none=False)
            if cuda:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            logprobs = forward_completion_logprobs(model, *inputs, chunk_tokens=chunk_tokens)
            logprobs.sum().backward()
            if cuda:
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
            laps.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError as exc:
        return {"status": "oom", "error": str(exc).splitlines()[0]}
    grad_norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return {"status": "ok", "pass_s": min(laps[1:]), "pass_s_rounds": laps[1:],
            "peak_mib": None if peak is None else peak / MIB, "grad_norm": float(grad_norm),
            "logprobs": logprobs.detach().float().cpu()}


def measure_shape(name: str, quick: bool) -> dict[str, Any]:
    """Every variant of ``VARIANTS`` at shape ``name`` (scaled down with ``quick``)."""
    import torch

    from pipeline.memory.admission import ModelShape, estimate_forward_bytes
    from stages.models.shapes import SCALED_DOWN, build_shape_config, init_model

    config = build_shape_config(name, overrides=dict(SCALED_DOWN) if quick else None)
    rows, prompt, completion = (2, 16, 48) if quick else (ROWS, PROMPT, COMPLETION)
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    model = init_model(config, dtype, seed=0).train()
    for p in model.parameters():  # gradients allocated once, outside every pass's peak
        p.grad = torch.zeros_like(p)
    shape = ModelShape.from_hf_config(config, dtype_bytes=2 if cuda else 4)
    inputs = build_pass(shape.vocab_size, rows, prompt, completion, next(model.parameters()).device)
    out: dict[str, Any] = {"shape": name, "vocab_size": shape.vocab_size, "layers": shape.num_layers,
                           "hidden_size": shape.hidden_size, "params": sum(p.numel() for p in model.parameters()),
                           "tied": bool(getattr(config, "tie_word_embeddings", False)), "rows": rows,
                           "prompt_tokens": prompt, "completion_tokens": completion, "dtype": str(dtype), "rows_by": {}}
    dense = None
    for variant, (chunk_tokens, checkpointed) in VARIANTS.items():
        got = run_variant(model, inputs, chunk_tokens, checkpointed, 1 if quick else REPEATS)
        estimate = estimate_forward_bytes(shape, rows, prompt + completion, with_grad=True,
                                          logit_tokens=chunk_tokens or None, checkpointed=checkpointed)
        got["estimate_mib"] = estimate / MIB
        if got.get("peak_mib"):
            got["measured_over_estimate"] = got["peak_mib"] * MIB / estimate
        logprobs = got.pop("logprobs", None)
        if variant == "dense" and got["status"] == "ok":
            dense = (logprobs, got["grad_norm"])
        elif dense is not None and logprobs is not None:
            got["max_abs_logprob_diff_vs_dense"] = float((logprobs - dense[0]).abs().max())
            got["grad_norm_over_dense"] = got["grad_norm"] / dense[1]
        out["rows_by"][variant] = got
        print(f"trainer_memory {name} {variant}: {_brief(got)}", flush=True)
        if cuda:
            torch.cuda.empty_cache()
    del model
    if cuda:
        torch.cuda.empty_cache()
    return out


def _brief(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"{row['status']} (estimate {row['estimate_mib']:,.0f} MiB)"
    peak = "unmeasured" if row["peak_mib"] is None else f"{row['peak_mib']:,.0f} MiB"
    return f"peak {peak}, estimate {row['estimate_mib']:,.0f} MiB, pass {row['pass_s']:.3f} s"


def _ratio(shape: dict[str, Any], top: str, bottom: str, key: str) -> float | None:
    a, b = shape["rows_by"].get(top, {}), shape["rows_by"].get(bottom, {})
    if a.get("status") != "ok" or b.get("status") != "ok" or not a.get(key) or not b.get(key):
        return None
    return a[key] / b[key]


def compute_ratios(shapes: list[dict[str, Any]]) -> dict[str, Any]:
    """Per shape: dense over chunked peak, chunked over checkpointed peak, and the time
    checkpointing costs (checkpointed over chunked pass time)."""
    ratios: dict[str, Any] = {}
    for s in shapes:
        n = s["shape"]
        ratios[f"{n}/dense_over_chunked_peak"] = _ratio(s, "dense", "chunked", "peak_mib")
        ratios[f"{n}/chunked_over_checkpointed_peak"] = _ratio(s, "chunked", "chunked_checkpointed", "peak_mib")
        ratios[f"{n}/checkpointed_over_chunked_time"] = _ratio(s, "chunked_checkpointed", "chunked", "pass_s")
    return ratios


def plot(payload: dict[str, Any]) -> Any:
    shapes = payload["shapes"]
    fig, grid = new_figure(1, 2)
    axes = grid[0]
    width = 0.8 / len(VARIANTS)
    for i, variant in enumerate(VARIANTS):
        xs = [j + i * width for j in range(len(shapes))]
        peaks = [s["rows_by"][variant].get("peak_mib") or 0 for s in shapes]
        times = [s["rows_by"][variant].get("pass_s") or 0 for s in shapes]
        axes[0].bar(xs, [p / 1024 for p in peaks], width, label=variant)
        axes[1].bar(xs, times, width, label=variant)
    for ax, title in zip(axes, ("peak memory of a pass above weights and gradients (GiB; 0: out of memory)",
                                "forward + backward of the pass (s)"), strict=True):
        ax.set_xticks([j + width for j in range(len(shapes))], [s["shape"] for s in shapes])
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    return fig


def run(quick: bool, out_dir: Path, model: str | None = None) -> dict[str, Any]:
    import torch

    if not quick and not torch.cuda.is_available():
        return publish_skipped_without_gpu(out_dir, "trainer_memory", quick)
    names = [model] if model else (["qwen3_0.6b"] if quick else list(SHAPES))
    shapes = [measure_shape(name, quick) for name in names]
    payload = {"status": "ok", "quick": quick, "shapes": shapes, "variants": {
        k: {"logit_chunk_tokens": c, "gradient_checkpointing": g} for k, (c, g) in VARIANTS.items()}}
    payload["ratios"] = compute_ratios(shapes)
    return publish_result(out_dir, "trainer_memory", payload, plot, label=model or "default")
