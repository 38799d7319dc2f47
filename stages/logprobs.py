"""Completion-token log-probabilities of a ``RolloutBatch`` under a causal LM.

Guarantees:
- ``compute_completion_logprobs`` returns ``[S, C]`` float32 aligned with
  ``batch.completion_ids``: entry ``[i, j]`` is ``log p(completion_ids[i, j] | prompt_i,
  completion_ids[i, :j])`` at the given temperature, and exactly 0 where ``j >=
  completion_lens[i]``. Padding never influences a real token: sequences are
  right-padded, so under the causal mask a real token attends only to real tokens.
- Memory is bounded by ``chunk_size`` samples per forward pass, and only the logits of
  completion positions are materialised when the model accepts ``logits_to_keep``.
- Autograd is untouched: under ``torch.no_grad()`` it scores (reference stage), with
  grad enabled it is the trainer's differentiable forward pass.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch

from pipeline.types import RolloutBatch
from stages.algorithms import compute_token_entropy, compute_token_logprobs


def build_model_inputs(
    batch: RolloutBatch,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Concatenate each sample's prompt and completion tokens, right-padded with 0.

    Every prompt needs at least one token (``prompt_lens >= 1``, the BOS at least): the
    first completion token is predicted from the last prompt position.

    Returns, with S samples, C = ``completion_ids.shape[1]`` and L the longest
    prompt + completion:
      input_ids [S, L] int64, attention_mask [S, L] int64 (1 on real tokens),
      completion_mask [S, C] float32 (1 on real completion tokens),
      positions [S, C] int64: index in ``input_ids`` of completion token ``[i, j]``
      (``prompt_lens[i] + j``, clamped to ``L - 1`` on padding so it is always a valid
      index; the mask, not the position, marks padding).
    """
    prompt_lens = np.asarray(batch.prompt_lens, dtype=np.int64)
    comp_lens = np.asarray(batch.completion_lens, dtype=np.int64)
    num_samples, width = batch.completion_ids.shape
    total = prompt_lens + comp_lens
    length = int(total.max()) if num_samples else 0
    cols = np.arange(length)
    # ids[i, t] = prompt token t for t < p_i, completion token t - p_i for t < p_i + c_i.
    in_prompt = cols[None, :] < prompt_lens[:, None]
    in_comp = ~in_prompt & (cols[None, :] < total[:, None])
    ids = np.zeros((num_samples, length), dtype=np.int64)
    p_width = min(batch.prompt_ids.shape[1], length)
    ids[:, :p_width] = np.where(in_prompt[:, :p_width], batch.prompt_ids[:, :p_width], 0)
    comp_col = np.clip(cols[None, :] - prompt_lens[:, None], 0, max(width - 1, 0))
    if width:
        comp_tok = np.take_along_axis(batch.completion_ids.astype(np.int64), comp_col, axis=1)
        ids = np.where(in_comp, comp_tok, ids)
    comp_mask = np.arange(width)[None, :] < comp_lens[:, None]
    positions = np.minimum(prompt_lens[:, None] + np.arange(width)[None, :], max(length - 1, 0))
    return (
        torch.from_numpy(ids),
        torch.from_numpy((in_prompt | in_comp).astype(np.int64)),
        torch.from_numpy(comp_mask.astype(np.float32)),
        torch.from_numpy(positions.astype(np.int64)),
    )


def accepts_logits_to_keep(model: Any) -> bool:
    """Whether ``model`` (or the module a DeepSpeed engine wraps) takes ``logits_to_keep``."""
    module = getattr(model, "module", model)
    try:
        return "logits_to_keep" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def forward_completion_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    positions: torch.Tensor,
    temperature: float = 1.0,
    use_logits_to_keep: bool | None = None,
    entropy_out: list[torch.Tensor] | None = None,
    router_loss_out: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """One forward pass over rows already cut from ``build_model_inputs``.

    Shapes: input_ids/attention_mask [s, L], completion_mask/positions [s, C];
    returns [s, C] float32 on the model's device (zeros where the mask is 0).
    ``entropy_out``: a list that receives the entropy of each completion position's
    next-token distribution at ``temperature``, [s, C] float32 detached (zeros where
    the mask is 0), computed from the logits this pass already holds.
    ``router_loss_out``: a list that receives a mixture of experts' load-balancing loss
    over this pass's real tokens (a scalar with its graph; the model's own
    ``aux_loss``, asked for with ``output_router_logits``).
    """
    device = next(iter(getattr(model, "module", model).parameters())).device
    valid = completion_mask.to(device)
    if valid.numel() == 0 or input_ids.shape[1] < 2:
        if entropy_out is not None:
            entropy_out.append(torch.zeros(completion_mask.shape, dtype=torch.float32, device=device))
        return torch.zeros(completion_mask.shape, dtype=torch.float32, device=device)
    # Trim the chunk to its own longest sample: a short chunk should not pay for the
    # longest sequence of the whole batch.
    length = int(attention_mask.sum(dim=1).max())
    ids = input_ids[:, :length].to(device)
    mask = attention_mask[:, :length].to(device)
    pos = positions.clamp(max=length - 1).to(device)
    # The first completion token is predicted by the logits at position prompt_len - 1,
    # so only positions >= min(prompt_len) - 1 are ever needed.
    first = max(int(pos[:, 0].min()) - 1, 0)
    if use_logits_to_keep is None:
        use_logits_to_keep = accepts_logits_to_keep(model)
    extra: dict[str, Any] = {"output_router_logits": True} if router_loss_out is not None else {}
    if use_logits_to_keep:
        out = model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=length - first, **extra)
        logits = out.logits
    else:
        out = model(input_ids=ids, attention_mask=mask, use_cache=False, **extra)
        logits = out.logits[:, first:]
    if router_loss_out is not None:
        aux = getattr(out, "aux_loss", None)
        if not isinstance(aux, torch.Tensor):
            raise ValueError(f"{type(getattr(model, 'module', model)).__name__} returned no router load-balancing loss "
                             f"(aux_loss) with output_router_logits: it is not a mixture of experts")
        router_loss_out.append(aux)
    # token_lp[:, t] = log p(ids[:, first + t + 1] | logits at position first + t)
    token_lp = compute_token_logprobs(logits.float(), ids[:, first:], temperature=temperature)
    index = (pos - 1 - first).clamp(min=0, max=token_lp.shape[1] - 1)
    gathered = torch.gather(token_lp, 1, index)
    if entropy_out is not None:
        with torch.no_grad():  # only the completion positions' logits: [s, C, V], not [s, L, V]
            rows = logits[:, :-1].detach()
            picked = torch.gather(rows, 1, index.unsqueeze(-1).expand(-1, -1, rows.shape[-1]))
            ent = compute_token_entropy(picked, temperature)
        entropy_out.append(torch.where(valid > 0, ent, torch.zeros_like(ent)))
    return torch.where(valid > 0, gathered, torch.zeros_like(gathered))


def compute_completion_logprobs(
    model: Any,
    batch: RolloutBatch,
    temperature: float = 1.0,
    chunk_size: int = 16,
) -> torch.Tensor:
    """Log-prob of each completion token: [S, C] float32, aligned with
    ``batch.completion_ids``, zeros where padded (see the module guarantees)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected >= 1, got {chunk_size}")
    input_ids, attention_mask, completion_mask, positions = build_model_inputs(batch)
    keep = accepts_logits_to_keep(model)
    pieces = [
        forward_completion_logprobs(
            model,
            input_ids[start : start + chunk_size],
            attention_mask[start : start + chunk_size],
            completion_mask[start : start + chunk_size],
            positions[start : start + chunk_size],
            temperature=temperature,
            use_logits_to_keep=keep,
        )
        for start in range(0, batch.num_samples, chunk_size)
    ]
    if not pieces:
        return torch.zeros(completion_mask.shape, dtype=torch.float32)
    return torch.cat(pieces, dim=0)
