"""What both vLLM engine cores share: the subprocess ``AsyncLLM`` of ``vllm_backend`` and
the in-process core of ``vllm_inproc`` (which ``vllm_backend`` builds, so neither may
import the other for these).

Guarantees: vLLM is imported only when called, so importing this module costs nothing.
"""

from __future__ import annotations

import math
from typing import Any


def batch_usage() -> Any:
    """The ``UsageContext`` the engine is configured under: vLLM's offline ``LLM``'s,
    whose defaults (running sequences, tokens a step) are sized for batch throughput."""
    from vllm.usage.usage_lib import UsageContext

    return UsageContext.LLM_CLASS



def read_sampled_logprobs(logprobs: Any, token_ids: list[int], requested: bool = True) -> list[float]:
    """The sampled token's log-prob at each of ``token_ids`` from a completion's
    ``logprobs`` (requested with ``logprobs=0``: one entry per position, the sampled
    token). vLLM's flat form (lists over all positions) is read as is; the classic
    form (a dict per position) by token id. Strict: a position without its token's
    log-prob fails the request loudly. Not ``requested`` (``rollout.logprobs: false``):
    NaN at every position."""
    if not requested:
        return [math.nan] * len(token_ids)
    flat = getattr(logprobs, "logprobs", None)
    if isinstance(flat, list):
        if logprobs.token_ids != token_ids or len(flat) != len(token_ids):
            raise ValueError(
                f"vLLM returned log-probs for {len(flat)} positions / tokens {logprobs.token_ids[:8]}..., "
                f"expected one per sampled token ({len(token_ids)}: {token_ids[:8]}...)"
            )
        return flat
    return [float(lp[tok].logprob) for tok, lp in zip(token_ids, logprobs or (), strict=True)]
