"""``algorithm``: the fields every algorithm shares and the registry that maps
``algorithm.name`` to its config struct.

Each algorithm (``stages/algorithms/<name>.py``) declares its struct, a tagged subclass of
``AlgorithmFields``, with ``@register_algorithm_config``; the config decodes
``algorithm`` against the struct registered for its name, so a field is declared once."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from pipeline.config.base import NonNegFloat, NonNegInt, PosInt, _section
from pipeline.config.train import KLControlConfig


class AlgorithmFields(msgspec.Struct, **_section(tag_field="name")):
    """The loss every algorithm shares (``stages/algorithms/losses.py``); each algorithm
    subclasses it in its own file under ``stages/algorithms/`` with its estimator's fields
    (``register_algorithm_config``) and is told apart by ``algorithm.name``.

    - ``clip_ratio_c``: dual-clip bound for tokens with a negative advantage (> 1;
      null: off). ``kl_estimator`` k3 is clamped to +-10 per token.
    - ``loss_agg``: every mode is exact over a streaming step (sums rescaled before
      clipping by the step's count): ``token-mean`` divides by the step's loss tokens,
      ``seq-mean-token-mean`` / ``seq-mean-token-sum`` by its rows with at least one loss
      token, ``seq-mean-token-sum-norm`` by the constant ``samples * loss_norm_tokens``
      (default ``rollout.max_tokens``).
    - ``off_policy``: ``off`` (PPO ratio against the sampler), ``truncate`` or ``reject``
      (decoupled objective: the ratio is anchored on the weights that first trained the
      sample in its step, held across ``train.ppo_epochs``; the importance weight that
      anchor / behaviour is truncated at or rejected above ``behav_imp_weight_cap``).
    - ``ratio_level``: ``token`` (PPO/GRPO) or ``sequence`` (GSPO: the geometric mean of
      a sample's token ratios, clipped per sequence).
    - ``kl_estimator`` ``k3+`` / ``k1+``: k3's (k1's) value with k2's gradient.
    - ``use_kl_in_reward``: ``kl_ctrl.kl_coef * kl_penalty`` (behaviour vs reference,
      per token) is subtracted from the reward before advantages; ``kl_ctrl.type:
      adaptive`` steers the coefficient towards ``kl_ctrl.target_kl``.
    - ``drop_zero_variance_groups``: the stage that sets the final reward (the reward
      model's when ``reward.sources`` wires one, else the reward stage) drops groups whose
      samples all got the same reward (no learning signal; DAPO's dynamic sampling); the
      source replaces them and summary.json counts them (``zero_variance``).
    - ``overlong_mask``: completions cut by ``rollout.max_tokens`` (finish reason
      ``length``) leave the loss; ``overlong_buffer_len`` > 0: DAPO's soft overlong
      penalty, ``-factor * (length - (max_tokens - buffer)) / buffer`` when positive,
      added to the final reward (after a reward model's combination).
    """

    kl_coef: NonNegFloat = 0.04
    kl_estimator: Literal["k1", "k2", "k3", "k1+", "k3+"] = "k3"
    clip_eps_low: NonNegFloat = 0.2
    clip_eps_high: NonNegFloat = 0.2
    clip_ratio_c: Annotated[float, Meta(gt=1)] | None = 3.0
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = "token-mean"
    loss_norm_tokens: PosInt | None = None
    off_policy: Literal["off", "truncate", "reject"] = "off"
    behav_imp_weight_cap: Annotated[float, Meta(ge=1)] = 2.0
    ratio_level: Literal["token", "sequence"] = "token"
    use_kl_in_reward: bool = False
    kl_penalty: Literal["k1", "k2", "k3"] = "k1"
    kl_ctrl: KLControlConfig = KLControlConfig()
    drop_zero_variance_groups: bool = False
    overlong_mask: bool = False
    overlong_buffer_len: NonNegInt = 0
    overlong_penalty_factor: NonNegFloat = 1.0

    # Advantages compare the samples of one prompt: needs rollout.n >= 2.
    group_baseline: ClassVar[bool] = True
    # Advantages read a critic's per-token values: the graph gets a critic stage.
    needs_critic: ClassVar[bool] = False
    # Trains on data rows with their responses (no rollout, no reward): the graph is
    # source -> reference -> trainer, and the reference always runs.
    offline: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return str(self.__struct_config__.tag)

    def check(self, cfg: Any) -> None:
        """The algorithm's own cross-section rules over the whole config (a ``ConveyorConfig``,
        which holds this section: not imported here), ``ConfigError`` naming the field; none here."""


# algorithm.name -> its config struct. Filled by ``register_algorithm_config`` when the
# algorithm modules are imported; ``algorithm_configs`` imports them (through
# ``pipeline.plugins``' ``get_algorithm``, so importing this module loads none of them).
_ALGORITHM_CONFIGS: dict[str, type[AlgorithmFields]] = {}
DEFAULT_ALGORITHM = "grpo"


def register_algorithm_config(cls: type[AlgorithmFields]) -> type[AlgorithmFields]:
    """Make ``cls`` (a tagged ``AlgorithmFields`` subclass) decodable as ``algorithm.name: <tag>``."""
    tag = cls.__struct_config__.tag
    if not isinstance(tag, str) or not issubclass(cls, AlgorithmFields):
        raise TypeError(f"{cls.__name__}: expected an AlgorithmFields subclass with tag='<algorithm.name>'")
    known = _ALGORITHM_CONFIGS.get(tag)
    if known is not None and known.__qualname__ != cls.__qualname__:
        raise ValueError(f"algorithm.name {tag!r}: registered twice ({known.__module__} and {cls.__module__})")
    _ALGORITHM_CONFIGS[tag] = cls
    return cls


def algorithm_configs() -> dict[str, type[AlgorithmFields]]:
    """Every registered algorithm config by name, the built-in algorithm modules imported first."""
    from pipeline.plugins import load_builtin

    load_builtin("get_algorithm")  # imports every algorithm module
    return dict(_ALGORITHM_CONFIGS)


def default_algorithm() -> AlgorithmFields:
    return algorithm_configs()[DEFAULT_ALGORITHM]()
