"""Loss aggregation (``algorithm.loss_agg``): one class per mode, the only place a mode's rule is written.

Guarantees:
- A mode divides a sum of per-token values by a count of *units*: ``token-mean`` its
  loss tokens, ``seq-mean-token-mean`` / ``seq-mean-token-sum`` its rows with at least
  one loss token, ``seq-mean-token-sum-norm`` every row (times the constant
  ``norm_tokens``). ``reduce`` aggregates one tensor; ``row_units`` (chunks of a pass),
  ``count`` (a micro-batch: ``RolloutBatch.loss_tokens`` / ``loss_rows`` /
  ``num_samples``) and ``share`` (a piece of one) count the same units, so a streaming
  step that weighs its parts by them equals the step trained as one batch.
- No torch import: ``reduce`` and ``row_units`` use only the methods of the tensors
  they are given, and ``count``/``share`` only ``RolloutBatch``'s counts.
"""

from __future__ import annotations

from typing import Any, ClassVar

LOSS_AGGREGATIONS: dict[str, LossAggregation] = {}


def register_loss_aggregation(cls: type[LossAggregation]) -> type[LossAggregation]:
    LOSS_AGGREGATIONS[cls.name] = cls()
    return cls


def get_loss_aggregation(mode: str) -> LossAggregation:
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss_agg: expected 'token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum' or "
                         f"'seq-mean-token-sum-norm', got {mode!r}")
    return LOSS_AGGREGATIONS[mode]


class LossAggregation:
    """A mode: ``name`` (its ``loss_agg`` value) and ``unit`` (the ``RolloutBatch``
    property that counts its units)."""

    name: ClassVar[str]
    unit: ClassVar[str]

    def reduce(self, values: Any, m: Any, norm_tokens: int | None) -> Any:
        """``values`` [S, C] (0 outside the float mask ``m`` [S, C]) -> a scalar tensor."""
        raise NotImplementedError

    def row_units(self, mask: Any) -> Any:
        """[S] float: each row's units under the mask [S, C]."""
        raise NotImplementedError

    def count(self, batch: Any) -> int:
        return int(getattr(batch, self.unit))

    def share(self, piece: Any, batch: Any) -> float:
        """The piece's share of the batch's units; sample shares when the batch has none
        (its loss is 0 anyway)."""
        part, whole = self.count(piece), self.count(batch)
        if whole == 0:
            part, whole = piece.num_samples, batch.num_samples
        return part / whole


@register_loss_aggregation
class TokenMean(LossAggregation):
    """Every token weighs the same (long answers weigh more)."""

    name = "token-mean"
    unit = "loss_tokens"

    def reduce(self, values: Any, m: Any, norm_tokens: int | None) -> Any:
        return (values * m).sum() / m.sum().clamp(min=1.0)

    def row_units(self, mask: Any) -> Any:
        return mask.float().sum(dim=1)


class _SeqMean(LossAggregation):
    """Every sequence with a loss token weighs the same; ``per_sequence`` reduces its tokens."""

    unit = "loss_rows"

    def per_sequence(self, seq_sum: Any, seq_tokens: Any) -> Any:
        raise NotImplementedError

    def reduce(self, values: Any, m: Any, norm_tokens: int | None) -> Any:
        seq_tokens = m.sum(dim=1)
        per_seq = self.per_sequence((values * m).sum(dim=1), seq_tokens)
        has_tokens = (seq_tokens > 0).float()
        return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)

    def row_units(self, mask: Any) -> Any:
        return (mask.float().sum(dim=1) > 0).float()


@register_loss_aggregation
class SeqMeanTokenMean(_SeqMean):
    """The mean over tokens inside each sequence, then over sequences."""

    name = "seq-mean-token-mean"

    def per_sequence(self, seq_sum: Any, seq_tokens: Any) -> Any:
        return seq_sum / seq_tokens.clamp(min=1.0)


@register_loss_aggregation
class SeqMeanTokenSum(_SeqMean):
    """The sum over tokens inside each sequence, then the mean over sequences."""

    name = "seq-mean-token-sum"

    def per_sequence(self, seq_sum: Any, seq_tokens: Any) -> Any:
        return seq_sum


@register_loss_aggregation
class SeqMeanTokenSumNorm(LossAggregation):
    """The sum over all valid tokens / (S * ``norm_tokens``), a constant normaliser (Dr.
    GRPO; ``norm_tokens`` is usually the longest completion the rollout may produce).
    Every row counts in S, empty or not."""

    name = "seq-mean-token-sum-norm"
    unit = "num_samples"

    def reduce(self, values: Any, m: Any, norm_tokens: int | None) -> Any:
        if norm_tokens is None or norm_tokens < 1:
            raise ValueError(f"loss_agg seq-mean-token-sum-norm: norm_tokens must be >= 1, got {norm_tokens}")
        return (values * m).sum() / float(max(values.shape[0], 1) * norm_tokens)

    def row_units(self, mask: Any) -> Any:
        return mask.new_ones(mask.shape[0], dtype=mask.float().dtype)
