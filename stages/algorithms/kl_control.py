"""The coefficient of a KL penalty in the reward: fixed, or adaptive (Ziegler et al. 2019).

Guarantees:
- A small state machine with no device and no I/O: ``update`` is called once per
  optimizer step with the KL measured on that step's samples and their count, and the
  coefficient it returns is the one the next step's advantages use.
- Adaptive: ``coef *= 1 + clip(kl / target_kl - 1, -0.2, 0.2) * samples / horizon``, so
  one step moves the coefficient by at most ``0.2 * samples / horizon`` (relative), up
  when the KL is above target and down when below; it never turns negative (the factor
  stays positive while ``samples < 5 * horizon``, which ``update`` checks).
- ``state`` / ``load_state`` round-trip the coefficient exactly (the trainer saves it in
  its checkpoints, so a resumed run continues with the coefficient it had).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_PROPORTIONAL_ERROR = 0.2


@dataclass
class KLController:
    coef: float
    adaptive: bool = False
    target_kl: float = 0.1
    horizon: int = 10000

    def update(self, kl: float, samples: int) -> float:
        """The coefficient after a step whose samples measured ``kl`` (mean per-sample KL)."""
        if not self.adaptive:
            return self.coef
        if samples >= self.horizon / MAX_PROPORTIONAL_ERROR:
            raise ValueError(f"kl_ctrl.horizon: {self.horizon} is too short for {samples} samples per step "
                             f"(the factor could reach 0); use a horizon > {samples * MAX_PROPORTIONAL_ERROR:g}")
        error = min(max(kl / self.target_kl - 1.0, -MAX_PROPORTIONAL_ERROR), MAX_PROPORTIONAL_ERROR)
        self.coef *= 1.0 + error * samples / self.horizon
        return self.coef

    def state(self) -> dict[str, float]:
        return {"kl_ctrl_coef": self.coef}

    def load_state(self, state: dict[str, Any]) -> None:
        if "kl_ctrl_coef" in state:
            self.coef = float(state["kl_ctrl_coef"])


def build_kl_controller(kl_ctrl: Any) -> KLController:
    """From ``algorithm.kl_ctrl`` (``KLControlConfig``)."""
    return KLController(coef=float(kl_ctrl.kl_coef), adaptive=kl_ctrl.type == "adaptive",
                        target_kl=float(kl_ctrl.target_kl), horizon=int(kl_ctrl.horizon))
