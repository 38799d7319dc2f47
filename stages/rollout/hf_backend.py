"""transformers ``generate`` backend, for machines without vLLM (and as a reference).

Guarantees (beyond ``stages.rollout.base``):
- The event loop stays responsive: loading, generating and weight updates run in a
  worker thread (``asyncio.to_thread``).
- Generation and weight updates are serialised by one lock, so an update lands between
  ``generate`` batches, never inside one: every token of one call carries the version
  served when that call started, which is exact (no token is ever tagged with weights
  that did not produce it). Calls do not interleave; concurrent calls queue.
- Prompts of equal length are generated as one batch, so no padding enters a prompt
  and every sample equals an unbatched run up to floating-point rounding.
- ``sampling.min_tokens`` holds the end-of-sequence ids back until a completion has that
  many tokens (transformers' ``min_new_tokens``).
- Behaviour log-probs are ``log_softmax`` of ``generate``'s processed scores (logits
  after temperature, top-k, top-p; greedy: the raw logits) at the sampled token. The
  checkpoint's own generation defaults (sampling flags, penalties) are ignored: only
  ``SamplingSettings`` and the end-of-sequence / padding ids apply.
- ``update_weights`` takes safetensors bytes or a ``cuda_ipc`` descriptor
  (``pipeline.transport``: the buckets are mapped from the trainer's GPU and their
  fingerprint checked before anything is copied), and copies it into the live
  parameters (on the model's device: CUDA when there is one) with
  ``load_state_dict``. Payloads carry checkpoint names; a mixture of experts' experts,
  one tensor per expert there, are put back into the module's 3D tensors first
  (``stages.models.checkpoint_names``). A name it does not know, a wrong shape, or a parameter the
  payload lacks (other than the alias of a tied one) raises ``WeightSyncError`` before
  anything is copied, and the old weights keep serving. If the copied weights then fail
  the fingerprint check, ``generate`` raises until a later update succeeds. A partial
  payload (LoRA's merged modules, ``pipeline.weights``' rest) may leave parameters out;
  the whole model's fingerprint is checked against its own plus its rest.
"""

from __future__ import annotations

import asyncio
import math
import threading
from pathlib import Path
from typing import Any

import structlog
import torch

from pipeline.config import RolloutConfig
from pipeline.dtypes import DTYPE_BYTES, resolve_dtype
from pipeline.transport import is_ipc_payload, open_ipc_payload, read_rest_fingerprint, verify_opened
from pipeline.weights import (
    Fingerprint,
    WeightSyncError,
    add_fingerprints,
    compute_fingerprint,
    deserialize_weights,
    verify_fingerprint,
)
from stages.models.checkpoint_names import CheckpointLayout
from stages.rollout.base import Completion, GenerationResult, SamplingSettings, check_version_order

log = structlog.get_logger(__name__).bind(stage="rollout", backend="hf")


def group_prompts_by_length(prompts: list[list[int]]) -> dict[int, list[int]]:
    """Prompt length -> indices of the prompts of that length, in input order."""
    groups: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(len(prompt), []).append(i)
    return groups


def cut_at_stop(tokens: list[int], stop_ids: set[int]) -> tuple[list[int], str]:
    """Keep tokens up to and including the first stop token; the finish reason."""
    for t, tok in enumerate(tokens):
        if tok in stop_ids:
            return tokens[: t + 1], "stop"
    return tokens, "length"


class HFBackend:
    """``RolloutBackend`` over ``transformers`` ``AutoModelForCausalLM.generate``."""

    def __init__(self, model_path: Path, rollout_cfg: RolloutConfig, dtype: str = "auto") -> None:
        self.model_path = Path(model_path)
        self.cfg = rollout_cfg
        self.dtype = dtype
        self._model: Any = None
        self._layout: CheckpointLayout | None = None  # None: payload names are the module's
        self._tokenizer: Any = None
        self._stop_ids: set[int] = set()
        self._pad_id = 0
        self._version = 0
        self._lock = threading.Lock()  # one generate or update at a time
        self.tokens_generated = 0  # completion tokens returned so far (monotonic)
        self._broken: WeightSyncError | None = None

    @property
    def version(self) -> int:
        return self._version

    async def start(self) -> None:
        if self._model is None:
            await asyncio.to_thread(self._load)

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        device = "cuda" if torch.cuda.is_available() else "cpu"
        torch_dtype = resolve_dtype(self.dtype, "rollout.dtype") if self.dtype in DTYPE_BYTES else "auto"
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch_dtype).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        eos = model.generation_config.eos_token_id
        if eos is None:
            eos = tokenizer.eos_token_id
        self._stop_ids = {eos} if isinstance(eos, int) else set(eos or ())
        pad = model.generation_config.pad_token_id
        if pad is None:
            pad = tokenizer.pad_token_id
        self._pad_id = pad if pad is not None else min(self._stop_ids, default=0)
        # generate() fills every field our GenerationConfig leaves unset from the model's
        # own: a checkpoint's repetition_penalty, min_p, no_repeat_ngram_size... would
        # reshape the sampling distribution and its behaviour log-probs. Neutral defaults.
        model.generation_config = GenerationConfig()
        layout = CheckpointLayout(model)
        self._layout = None if layout.identity else layout
        self._model, self._tokenizer = model, tokenizer
        log.info("model loaded", model=str(self.model_path), device=device, dtype=str(model.dtype))

    def _require_model(self) -> Any:
        if self._model is None:
            raise RuntimeError("HFBackend: call start() first (or it was shut down)")
        return self._model

    async def generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingSettings
    ) -> list[GenerationResult]:
        self._require_model()
        prompts = [list(p) for p in prompt_token_ids]
        return await asyncio.to_thread(self._generate_sync, prompts, sampling)

    def _generate_sync(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[GenerationResult]:
        with self._lock:
            if self._broken is not None:
                raise self._broken
            version = self._version
            completions: list[list[Completion]] = [[] for _ in prompts]
            for offset, (_, indices) in enumerate(sorted(group_prompts_by_length(prompts).items())):
                if sampling.seed is not None:
                    torch.manual_seed(sampling.seed + offset)
                rows = self._generate_group([prompts[i] for i in indices], sampling, version)
                for k, i in enumerate(indices):
                    completions[i] = rows[k * sampling.n : (k + 1) * sampling.n]
        self.tokens_generated += sum(len(c.token_ids) for row in completions for c in row)
        return [GenerationResult(prompt_token_ids=p, completions=c) for p, c in zip(prompts, completions, strict=True)]

    def _generate_group(self, prompts: list[list[int]], sampling: SamplingSettings, version: int) -> list[Completion]:
        """Equal-length prompts -> len(prompts) * n completions, prompt-major."""
        from transformers import GenerationConfig

        model = self._model
        ids = torch.tensor(prompts, dtype=torch.long, device=model.device).repeat_interleave(sampling.n, dim=0)
        flags: dict[str, Any] = {"do_sample": False}
        if not sampling.greedy:
            flags = dict(
                do_sample=True,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=0 if sampling.top_k == -1 else sampling.top_k,  # 0 disables top-k in HF
            )
        config = GenerationConfig(
            **flags,
            max_new_tokens=sampling.max_tokens,
            min_new_tokens=sampling.min_tokens or None,
            eos_token_id=sorted(self._stop_ids) or None,
            pad_token_id=self._pad_id,
            return_dict_in_generate=True,
            output_scores=sampling.logprobs,
        )
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        new_tokens = out.sequences[:, ids.shape[1] :]
        if not sampling.logprobs:  # rollout.logprobs: false
            picked = torch.full(new_tokens.shape, math.nan)
        elif new_tokens.shape[1]:
            # scores[t]: [rows, vocab] processed logits of step t -> log-prob of the sampled token.
            scores = torch.stack(out.scores, dim=1).float()
            picked = torch.log_softmax(scores, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        else:
            picked = torch.zeros_like(new_tokens, dtype=torch.float32)
        result = []
        for row in range(new_tokens.shape[0]):
            tokens, reason = cut_at_stop(new_tokens[row].tolist(), self._stop_ids)
            result.append(
                Completion(
                    token_ids=tokens,
                    logprobs=picked[row, : len(tokens)].tolist(),
                    token_versions=[version] * len(tokens),
                    finish_reason=reason,
                    text=self._tokenizer.decode(tokens, skip_special_tokens=True),
                )
            )
        return result

    async def update_weights(self, data: bytes, version: int, verify: bool = True) -> Fingerprint:
        self._require_model()
        check_version_order(self._version, version)
        return await asyncio.to_thread(self._update_sync, bytes(data), version, verify)

    def _update_sync(self, data: bytes, version: int, verify: bool) -> Fingerprint:
        rest = read_rest_fingerprint(data)  # None: the payload holds every parameter
        if is_ipc_payload(data):
            descriptor, weights = open_ipc_payload(data)
            verify_opened(descriptor, compute_fingerprint(weights.values()))  # before any copy
        else:
            weights = deserialize_weights(data)
        with self._lock:
            model = self._model
            payload = add_fingerprints(compute_fingerprint(weights.values(), dtype=model.dtype), rest)
            if self._layout is not None:  # checkpoint names (a mixture of experts' one per expert)
                try:
                    weights = self._layout.assemble(weights)
                except ValueError as err:
                    raise WeightSyncError(str(err)) from None
            check_payload_names(model, weights, partial=rest is not None)
            model.load_state_dict(weights, strict=False)
            live = compute_fingerprint(model.parameters()) if verify else payload
            try:
                verify_fingerprint(payload, live, version=version)
            except WeightSyncError as err:
                self._broken = err  # copied but unverified: serve nothing until a good update
                raise
            self._version, self._broken = version, None
        log.info("weights applied", policy_version=version, fingerprint=live)
        return live

    async def live_fingerprint(self) -> Fingerprint:
        model = self._require_model()
        return await asyncio.to_thread(lambda: compute_fingerprint(model.parameters()))

    async def shutdown(self) -> None:
        self._model = None
        self._tokenizer = None


def check_payload_names(model: torch.nn.Module, weights: dict[str, torch.Tensor], partial: bool = False) -> None:
    """Every payload name is a parameter of the same shape; every parameter is covered
    (a tied one by any of its names) unless the payload is ``partial``; raise
    ``WeightSyncError`` otherwise, before any copy, so a rejected payload leaves the
    model untouched."""
    names_of: dict[int, list[str]] = {}
    shape_of: dict[str, tuple[int, ...]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
        shape_of[name] = tuple(param.shape)
    unknown = sorted(set(weights) - set(shape_of))
    missing = [] if partial else sorted(names[0] for names in names_of.values() if not any(n in weights for n in names))
    misshaped = sorted(
        f"{n} {tuple(t.shape)} != {shape_of[n]}"
        for n, t in weights.items()
        if n in shape_of and tuple(t.shape) != shape_of[n]
    )
    if unknown or missing or misshaped:
        raise WeightSyncError(
            f"payload does not fit the model: unknown names {unknown[:5]}, "
            f"missing parameters {missing[:5]}, wrong shapes {misshaped[:5]}"
        )
