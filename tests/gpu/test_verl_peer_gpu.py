"""verl's own config accepts the overrides ``bench/peers/verl_grpo.py`` writes. Needs verl
installed (``bash bench/peers/prepare_verl_wheels.sh`` on the CPU side, its wheels installed on
the device): run it with ``bash tests/gpu/run.sh tests/gpu/test_verl_peer_gpu.py``; without
verl it fails at import, as it should."""

from __future__ import annotations

from pathlib import Path

from bench.peers.verl_grpo import PLAIN_CHAT_TEMPLATE, build_verl_overrides, write_verl_files
from tests.unit.test_verl_peer import JOB, _rows


def test_the_overrides_compose_with_verls_own_config(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_module
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    files = write_verl_files(JOB, _rows(12), tmp_path)
    overrides = [o for o in build_verl_overrides(JOB, files, tmp_path) if not o.startswith("hydra.")]
    with initialize_config_module("verl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=overrides)
    assert not need_reference_policy(cfg) and not need_critic(cfg)
    validate_config(config=cfg, use_reference_policy=False, use_critic=False)
    assert cfg.actor_rollout_ref.model.custom_chat_template == PLAIN_CHAT_TEMPLATE
