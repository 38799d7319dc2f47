"""Completion-token log-probabilities of a ``RolloutBatch`` under a causal LM.

Guarantees:
- ``compute_completion_logprobs`` returns ``[S, C]`` float32 aligned with
  ``batch.completion_ids``: entry ``[i, j]`` is ``log p(completion_ids[i, j] | prompt_i,
  completion_ids[i, :j])`` at the given temperature, and exactly 0 where ``j >=
  completion_lens[i]``. Padding never influences a real token: sequences are
  right-padded, so under the causal mask a real token attends only to real tokens.
- Memory is bounded by one pass (``chunk_size`` samples, or the rows of a token-budget
  plan, ``pipeline.memory.packing``, each pass trimmed to its own longest row), and
  never grows with the vocabulary beyond one chunk of tokens: the output head is applied to the completion
  positions only, ``chunk_tokens`` rows at a time, each chunk's ``[tokens, vocab]``
  logits recomputed in backward rather than kept (``chunked_head``). Families whose
  head does more than ``lm_head`` plus soft-capping, and ZeRO-3's partitioned head,
  take the dense path, which holds the logits of the completion span of one pass.
- Autograd is untouched: under ``torch.no_grad()`` it scores (reference stage), with
  grad enabled it is the trainer's differentiable forward pass.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pipeline.memory.packing import plan_passes
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


def select_pass_inputs(
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], rows: np.ndarray,
    completion_lens: np.ndarray,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows ``rows`` of ``build_model_inputs``' four tensors, trimmed to those rows:
    input columns to their longest prompt + completion, completion columns to their
    longest completion (``completion_lens``, [S]; a mask is never set beyond it). Prompt
    and completion sit from column 0 with padding on the right only, so dropping the
    columns past a pass's longest row drops padding only, and every kept token keeps its
    position."""
    input_ids, attention_mask, completion_mask, positions = inputs
    rows = np.asarray(rows, dtype=np.int64)
    index = torch.from_numpy(rows)
    mask = attention_mask.index_select(0, index)
    length = int(mask.sum(dim=1).max()) if rows.size else 0
    width = min(int(np.asarray(completion_lens)[rows].max()), completion_mask.shape[1]) if rows.size else 0
    return (input_ids.index_select(0, index)[:, :length], mask[:, :length],
            completion_mask.index_select(0, index)[:, :width], positions.index_select(0, index)[:, :width])


def accepts_logits_to_keep(model: Any) -> bool:
    """Whether ``model`` (or the module a DeepSpeed engine wraps) takes ``logits_to_keep``."""
    module = getattr(model, "module", model)
    try:
        return "logits_to_keep" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


# Model types whose causal-LM head is ``lm_head(hidden)``, then soft-capping where the
# config sets ``final_logit_softcapping``: the chunked head reproduces them exactly.
# Others (a logit scale, a multiplier) take the dense path.
CHUNKED_HEAD_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
    "gemma3_text", "phi3", "olmo2", "smollm3",
})
LOGIT_CHUNK_TOKENS = 1024  # rows of [tokens, vocab] logits alive at once on the chunked path


def find_chunkable_head(model: Any) -> torch.nn.Module | None:
    """The output head the chunked path may take over, or None for the dense path: an
    unlisted family, a head that is not a plain linear layer, or weights partitioned
    across ranks (ZeRO 3: the head's weight exists whole only inside its own call)."""
    module = getattr(model, "module", model)
    config = getattr(module, "config", None)
    if getattr(config, "model_type", None) not in CHUNKED_HEAD_TYPES:
        return None
    get_head = getattr(module, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, torch.nn.Linear) or hasattr(head.weight, "ds_id"):
        return None
    return head


def _head_chunk(hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                temperature: float, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) of ``n`` rows: hidden [n, H], targets [n] -> [n], [n] float32."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    if softcap:  # as the model's own forward does it, in the head's dtype
        logits = torch.tanh(logits / softcap) * softcap
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
    return logp, entropy


class chunked_head:
    """Within the block, ``head`` (the model's output layer) returns, instead of
    ``[s, k, vocab]`` logits, the ``[s, C]`` float32 log-probs of ``targets``: the one
    predicted at input row ``(rows[n], cols[n])`` lands at ``(rows[n], slots[n])`` (zeros
    elsewhere). The head runs on those rows only, ``chunk_tokens`` at a time
    under activation checkpointing: a chunk's logits are freed after its forward and
    recomputed in its backward. The model's own forward still runs the head (so a
    DeepSpeed engine's hooks see a normal forward and backward); its soft-capping is
    applied here and switched off in the config for the call. ``entropy`` receives the
    rows' entropies ([s, C], detached)."""

    def __init__(self, module: Any, head: torch.nn.Module, rows: torch.Tensor, cols: torch.Tensor,
                 slots: torch.Tensor, targets: torch.Tensor, shape: tuple[int, int], temperature: float,
                 chunk_tokens: int) -> None:
        self.module, self.head, self.rows, self.cols, self.slots = module, head, rows, cols, slots
        self.targets = targets
        self.shape, self.temperature, self.chunk_tokens = shape, temperature, chunk_tokens
        self.entropy: torch.Tensor | None = None
        self._softcap: float | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        picked = hidden[self.rows, self.cols]  # [n, H]: completion positions only
        logp, ent = [], []
        for a in range(0, picked.shape[0], self.chunk_tokens):
            args = (picked[a : a + self.chunk_tokens], self.targets[a : a + self.chunk_tokens], self.head.weight,
                    self.head.bias, self.temperature, self._softcap)
            if torch.is_grad_enabled():
                lp, en = torch.utils.checkpoint.checkpoint(_head_chunk, *args, use_reentrant=False)
            else:
                lp, en = _head_chunk(*args)
            logp.append(lp)
            ent.append(en.detach())
        out = torch.zeros(self.shape, dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros(self.shape, dtype=torch.float32, device=hidden.device)
        if logp:
            out = out.index_put((self.rows, self.slots), torch.cat(logp))
            entropy[self.rows, self.slots] = torch.cat(ent)
        self.entropy = entropy
        return out

    def __enter__(self) -> chunked_head:
        config = self.module.config
        self._softcap = getattr(config, "final_logit_softcapping", None)
        if self._softcap is not None:
            config.final_logit_softcapping = None
        self.head.forward = self.forward  # an instance attribute: nn.Module.__call__ finds it first
        return self

    def __exit__(self, *exc: object) -> None:
        del self.head.forward
        if self._softcap is not None:
            self.module.config.final_logit_softcapping = self._softcap


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
    chunk_tokens: int = LOGIT_CHUNK_TOKENS,
) -> torch.Tensor:
    """One forward pass over rows already cut from ``build_model_inputs``.

    Shapes: input_ids/attention_mask [s, L], completion_mask/positions [s, C];
    returns [s, C] float32 on the model's device (zeros where the mask is 0).
    ``entropy_out``: a list that receives the entropy of each completion position's
    next-token distribution at ``temperature``, [s, C] float32 detached (zeros where
    the mask is 0). ``router_loss_out``: a list that receives a mixture of experts'
    load-balancing loss over this pass's real tokens (a scalar with its graph; the
    model's own ``aux_loss``, asked for with ``output_router_logits``).
    ``chunk_tokens``: rows of logits alive at once (``chunked_head``); 0 takes the
    dense path, as does a model ``find_chunkable_head`` refuses.
    """
    if temperature <= 0:
        raise ValueError(f"temperature: expected > 0, got {temperature}")
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
        extra["logits_to_keep"] = length - first
    head = find_chunkable_head(model) if chunk_tokens > 0 else None
    if head is not None:
        # Row (sample, position in the head's input) of every real completion token.
        offset = first if use_logits_to_keep else 0
        rows, slots = torch.nonzero(valid > 0, as_tuple=True)
        at = pos[rows, slots]  # the token's index in ids; its logits sit one position before
        with chunked_head(getattr(model, "module", model), head, rows, at - 1 - offset, slots, ids[rows, at],
                          tuple(completion_mask.shape), temperature, chunk_tokens) as chunked:
            out = model(input_ids=ids, attention_mask=mask, use_cache=False, **extra)
        gathered, entropy = out.logits, chunked.entropy
    else:
        out = model(input_ids=ids, attention_mask=mask, use_cache=False, **extra)
        logits = out.logits if use_logits_to_keep else out.logits[:, first:]
        # token_lp[:, t] = log p(ids[:, first + t + 1] | logits at position first + t)
        token_lp = compute_token_logprobs(logits.float(), ids[:, first:], temperature=temperature)
        index = (pos - 1 - first).clamp(min=0, max=token_lp.shape[1] - 1)
        gathered = torch.gather(token_lp, 1, index)
        entropy = None
        if entropy_out is not None:
            with torch.no_grad():  # only the completion positions' logits: [s, C, V], not [s, L, V]
                rows_ = logits[:, :-1].detach()
                picked = torch.gather(rows_, 1, index.unsqueeze(-1).expand(-1, -1, rows_.shape[-1]))
                entropy = compute_token_entropy(picked, temperature)
    if router_loss_out is not None:
        aux = getattr(out, "aux_loss", None)
        if not isinstance(aux, torch.Tensor):
            raise ValueError(f"{type(getattr(model, 'module', model)).__name__} returned no router load-balancing loss "
                             f"(aux_loss) with output_router_logits: it is not a mixture of experts")
        router_loss_out.append(aux)
    if entropy_out is not None:
        assert entropy is not None
        entropy_out.append(torch.where(valid > 0, entropy, torch.zeros_like(entropy)))
    return torch.where(valid > 0, gathered, torch.zeros_like(gathered))


def compute_completion_logprobs(
    model: Any,
    batch: RolloutBatch,
    temperature: float = 1.0,
    chunk_size: int = 16,
    chunk_tokens: int = LOGIT_CHUNK_TOKENS,
    pass_tokens: int = 0,
    passes: Sequence[np.ndarray] | None = None,
) -> torch.Tensor:
    """Log-prob of each completion token: [S, C] float32, aligned with
    ``batch.completion_ids``, zeros where padded (see the module guarantees);
    ``chunk_tokens`` as in ``forward_completion_logprobs``. The forward passes are
    ``passes`` (row indices), else ``plan_passes`` of ``pass_tokens`` (0: chunks of
    ``chunk_size`` samples); each pass is trimmed to its own rows (``select_pass_inputs``)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected >= 1, got {chunk_size}")
    inputs = build_model_inputs(batch)
    if passes is None:
        passes = plan_passes(np.asarray(batch.prompt_lens) + np.asarray(batch.completion_lens), pass_tokens,
                             chunk_size)
    keep = accepts_logits_to_keep(model)
    out = torch.zeros(inputs[2].shape, dtype=torch.float32)
    for rows in passes:
        piece = forward_completion_logprobs(model, *select_pass_inputs(inputs, rows, batch.completion_lens),
                                            temperature=temperature,
                                            use_logits_to_keep=keep, chunk_tokens=chunk_tokens)
        out = out.to(piece.device)
        out[torch.as_tensor(rows, device=piece.device), : piece.shape[1]] = piece
    return out
