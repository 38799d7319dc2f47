"""The sampled tokens' log-probs taken from vLLM's sampler on the GPU, in the rollout's
own process, instead of from vLLM's outputs.

With the in-process engine on vLLM's V2 GPU model runner, ``install_sampler_tap`` wraps
the runner's sampling: after each step it computes each row's sampled-token log-prob
from the processed logits and copies it to pinned host memory without waiting; the
stepper attaches the values to each finished request (``SampledLogprobLedger.take``).
Why and how: docs/architecture.md, "Sampler tap".

Guarantees:
- a value is filed under its request and output position, never by counting rows;
- records are applied in GPU order, each read only once its copy has finished;
- ``take`` returns a value for every token asked for, or raises naming the request and
  position: a missing log-prob fails the request, never shifts it; a failure inside the
  wrappers leaves vLLM's sampling as it was;
- installed only where it is exact; elsewhere ``install_sampler_tap`` says why and the
  backend asks vLLM for the log-probs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


class _Ready(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass
class SampledLogprobs:
    """A completion's sampled-token log-probs in vLLM's flat form (``read_sampled_logprobs``
    reads ``token_ids`` and ``logprobs``), one per token."""

    token_ids: list[int]
    logprobs: list[float]


@dataclass
class _Request:
    prompt_len: int
    values: np.ndarray  # [max_tokens] float32
    filled: np.ndarray  # [max_tokens] bool: a sampled row gave that position its value
    taken: int = 0  # values handed out so far (outputs that carry only new tokens)


@dataclass
class SampledLogprobLedger:
    """Per-step records of (request id per row, [2, rows] value and absolute position of
    the sampled token) -> per-request values by output position. Used by one thread."""

    _requests: dict[str, _Request] = field(default_factory=dict)
    _pending: deque[tuple[list[str], Any, _Ready]] = field(default_factory=deque)
    records: int = 0  # applied so far (read by stats)
    broken: BaseException | None = None  # the wrappers failed: nothing more is filed

    def track(self, request_id: str, prompt_len: int, max_tokens: int) -> None:
        self._requests[request_id] = _Request(prompt_len, np.zeros(max_tokens, dtype=np.float32),
                                              np.zeros(max_tokens, dtype=bool))

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def push(self, request_ids: list[str], rows: Any, ready: _Ready) -> None:
        """One step's record: ``rows`` [2, len(request_ids)] (host tensor or array; row 0
        the log-prob; row 1 the sampled token's position in its sequence, -1 where the
        row sampled no token), readable once ``ready`` has completed."""
        self._pending.append((request_ids, rows, ready))

    def settle(self, wait: bool = False) -> None:
        """Apply the records whose copies have finished, oldest first (``wait``: all)."""
        while self._pending and (wait or self._pending[0][2].query()):
            request_ids, rows, ready = self._pending.popleft()
            if wait:
                ready.synchronize()
            self._apply(request_ids, np.asarray(rows))

    def _apply(self, request_ids: list[str], rows: np.ndarray) -> None:
        requests = self._requests
        for request_id, value, position in zip(request_ids, rows[0].tolist(), rows[1].tolist(), strict=True):
            request = requests.get(request_id)
            if request is None or position < 0:
                continue
            index = int(position) - request.prompt_len
            if 0 <= index < request.values.shape[0]:
                request.values[index] = value
                request.filled[index] = True
        self.records += 1

    def take(self, request_id: str, count: int) -> list[float]:
        """The next ``count`` values of ``request_id`` (the tokens of its next output).
        Raises ``LookupError`` when a position has none after every record is applied."""
        if self.broken is not None:
            raise LookupError(f"the sampler tap failed: {self.broken!r}") from self.broken
        request = self._requests.get(request_id)
        if request is None:
            raise LookupError(f"the sampler tap does not track request {request_id!r}")
        lo, hi = request.taken, request.taken + count
        if hi > request.values.shape[0]:
            raise LookupError(f"request {request_id!r}: {hi} tokens, more than its max_tokens "
                              f"{request.values.shape[0]}")
        self.settle()
        if not request.filled[lo:hi].all():
            self.settle(wait=True)
            missing = np.flatnonzero(~request.filled[lo:hi])
            if missing.size:
                raise LookupError(f"the sampler tap has no log-prob for token {lo + int(missing[0])} of "
                                  f"request {request_id!r} ({missing.size} of {count} missing)")
        request.taken = hi
        return request.values[lo:hi].tolist()


# The tap reads the same logits with the same kernel as vLLM: any difference is a bug.
VERIFY_TOLERANCE = 1e-5


def check_against_vllm(request_id: str, tapped: list[float], reported: list[float]) -> float:
    """The largest |tap - vLLM| over one output's tokens; raises ``LookupError`` naming
    the first token where it exceeds ``VERIFY_TOLERANCE`` (``rollout.sampler_tap: verify``)."""
    diffs = np.abs(np.asarray(tapped, dtype=np.float64) - np.asarray(reported, dtype=np.float64))
    bad = np.flatnonzero(~(diffs <= VERIFY_TOLERANCE))
    if bad.size:
        k = int(bad[0])
        raise LookupError(f"request {request_id!r}, token {k}: the sampler tap's log-prob {tapped[k]:.6f} differs "
                          f"from vLLM's {reported[k]:.6f} ({bad.size} of {len(tapped)} tokens differ)")
    return float(diffs.max()) if diffs.size else 0.0


def install_sampler_tap(llm_engine: Any) -> tuple[SampledLogprobLedger | None, str]:
    """Wrap the sampling of ``llm_engine``'s in-process GPU model runner so that every
    step's sampled-token log-probs go to a new ledger. Returns (ledger, "") or (None,
    why not). Call on the thread that steps the engine, before any request."""
    runner, why = _v2_model_runner(llm_engine)
    if runner is None:
        return None, why
    import torch
    from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

    ledger = SampledLogprobLedger()
    sampler = runner.sampler
    sampler_sample, runner_sample = sampler.sample, runner.sample
    # vLLM samples with FlashInfer only when no request asks for processed log-probs:
    # its path keeps top-k / top-p out of the logits the tap reads.
    sampler.use_flashinfer = False
    last: list[torch.Tensor | None] = [None]

    def sample(logits: Any, *args: Any, **kwargs: Any) -> Any:
        sampled, processed = sampler_sample(logits, *args, **kwargs)
        if ledger.broken is None:
            try:
                last[0] = compute_token_logprobs(processed, sampled.view(-1, 1)).view(-1)
            except Exception as err:  # vLLM's sampling stands; the requests needing the tap fail
                ledger.broken = err
        return sampled, processed

    def runner_sample_tapped(hidden_states: Any, input_batch: Any, grammar_output: Any) -> Any:
        last[0] = None
        out = runner_sample(hidden_states, input_batch, grammar_output)
        logprobs, last[0] = last[0], None
        if logprobs is None or ledger.broken is not None:
            return out
        try:
            _, num_sampled, _ = out
            if input_batch.num_draft_tokens or logprobs.shape[0] != num_sampled.shape[0]:
                raise RuntimeError(f"a step sampled {logprobs.shape[0]} rows for {num_sampled.shape[0]} requests "
                                   f"({input_batch.num_draft_tokens} draft tokens)")
            position = input_batch.positions[input_batch.logits_indices] + 1  # the sampled token's
            position = torch.where(num_sampled > 0, position, -1)  # -1: vLLM keeps no token from the row
            rows = torch.stack([logprobs, position.to(torch.float32)])
            host = torch.empty(rows.shape, dtype=torch.float32, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            ledger.push(list(input_batch.req_ids), host, ready)
        except Exception as err:
            ledger.broken = err
        return out

    sampler.sample = sample
    runner.sample = runner_sample_tapped
    return ledger, ""


def _v2_model_runner(llm_engine: Any) -> tuple[Any, str]:
    """The in-process engine's model runner when the tap is exact there, else (None, why)."""
    try:
        runner = llm_engine.model_executor.driver_worker.worker.model_runner
    except AttributeError:
        return None, "the model does not run in this process (vLLM's uni executor)"
    if type(runner).__module__ != "vllm.v1.worker.gpu.model_runner":  # imported by vLLM only where used
        return None, f"the model runner is {type(runner).__name__}, not vLLM's V2 GPU model runner"
    from vllm.v1.worker.gpu.sample.sampler import Sampler as SamplerV2

    if type(runner.sampler) is not SamplerV2:
        return None, f"the sampler is {type(runner.sampler).__name__}"
    if (runner.speculative_config is not None or runner.num_speculative_steps
            or runner.rejection_sampler is not None
            or runner.model_state.num_new_sampled_tokens_per_step != 1):
        return None, "the model samples several tokens a step (speculative decoding or its own sampler)"
    if getattr(runner, "pcp_manager", None) is not None:
        return None, "prefill context parallelism"
    if not runner.is_last_pp_rank or runner.vllm_config.parallel_config.pipeline_parallel_size > 1:
        return None, "pipeline parallelism"
    if getattr(runner.vllm_config.model_config, "uses_mrope", False):
        return None, "multimodal positions"
    return runner, ""
