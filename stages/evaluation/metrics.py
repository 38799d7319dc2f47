"""Evaluation metrics: pure functions of the rewards of a held-out set's completions.

Guarantees:
- ``estimate_pass_at_k`` is the unbiased estimator of Chen et al. 2021 ("Evaluating Large
  Language Models Trained on Code", eq. 1): the probability that at least one of k
  samples drawn without replacement from the n generated passes, given c of them did,
  ``1 - C(n - c, k) / C(n, k)``, computed as a product (no large binomials);
- ``summarise_eval`` names every value ``eval/<name>`` and returns the same keys for any
  input of a given ``n`` (``eval_metric_names``), so rows and charts line up across
  evaluations;
- a sample passes when its reward is at least the threshold (``eval.pass_threshold``).
"""

from __future__ import annotations

import numpy as np


def estimate_pass_at_k(n: int, c: int, k: int) -> float:
    """pass@k of one prompt with ``c`` passing samples out of ``n`` (1 <= k <= n)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass@k: expected 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k: expected 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:  # every draw of k holds a passing sample
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_ks(n: int) -> list[int]:
    """The k reported for ``n`` samples per prompt: 1, the powers of two below n, and n."""
    ks = [1]
    while ks[-1] * 2 < n:
        ks.append(ks[-1] * 2)
    return ks + ([n] if n > 1 else [])


def eval_metric_names(n: int) -> list[str]:
    """Every key ``summarise_eval`` returns for ``n`` samples per prompt."""
    return ["eval/reward_mean", "eval/reward_std", *(f"eval/pass@{k}" for k in pass_ks(n)), "eval/greedy_reward",
            "eval/greedy_pass", "eval/response_length", "eval/prompts", "eval/reward_errors", "eval/wall_s"]


def summarise_eval(rewards: np.ndarray, greedy: np.ndarray, lengths: np.ndarray, threshold: float,
                   reward_errors: int, wall_s: float) -> dict[str, float]:
    """The ``eval/*`` values of one evaluation.

    ``rewards`` [P, n]: the sampled completions' rewards, prompt by prompt (with
    temperature 0, the greedy ones: n = 1); ``greedy`` [P]: the greedy completion's;
    ``lengths`` [P, n]: the sampled completions' token counts."""
    rewards = np.asarray(rewards, dtype=np.float64)
    greedy = np.asarray(greedy, dtype=np.float64)
    if rewards.ndim != 2 or greedy.shape != (rewards.shape[0],) or np.shape(lengths) != rewards.shape:
        raise ValueError(f"summarise_eval: expected rewards [P, n], greedy [P], lengths [P, n], got "
                         f"{rewards.shape}, {greedy.shape}, {np.shape(lengths)}")
    prompts, n = rewards.shape
    passed = (rewards >= threshold).sum(axis=1)
    out = {"eval/reward_mean": float(rewards.mean()), "eval/reward_std": float(rewards.std())}
    for k in pass_ks(n):
        out[f"eval/pass@{k}"] = float(np.mean([estimate_pass_at_k(n, int(c), k) for c in passed]))
    out.update({"eval/greedy_reward": float(greedy.mean()), "eval/greedy_pass": float((greedy >= threshold).mean()),
                "eval/response_length": float(np.mean(lengths)), "eval/prompts": float(prompts),
                "eval/reward_errors": float(reward_errors), "eval/wall_s": float(wall_s)})
    return out
