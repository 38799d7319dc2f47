"""OPO (stages/algorithms/opo.py): the length-weighted group baseline, by hand, and the
algorithm reachable from a config like a built-in."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from pipeline.config import ALGORITHM_NAMES, ConfigError, load_config
from stages.algorithms import ALGORITHMS, assign_advantages
from stages.algorithms.opo import OpoConfig
from tests.unit.test_admission import make_batch


def test_opo_scores_each_sample_against_the_length_weighted_group_mean():
    batch = make_batch(num_groups=2, group_size=2)  # rewards 0 1 | 2 3, lens 1 2 | 3 4
    out = assign_advantages(batch, OpoConfig())
    # group 0: b = (1*0 + 2*1) / 3 = 2/3    -> A = [-2/3, 1/3]
    # group 1: b = (3*2 + 4*3) / 7 = 18/7   -> A = [2 - 18/7, 3 - 18/7] = [-4/7, 3/7]
    # (the plain group mean would give -0.5 / +0.5 in both groups)
    want = np.array([[-2 / 3, 0, 0, 0], [1 / 3, 1 / 3, 0, 0],
                     [-4 / 7, -4 / 7, -4 / 7, 0], [3 / 7, 3 / 7, 3 / 7, 3 / 7]], dtype=np.float32)
    np.testing.assert_allclose(out.advantages, want, atol=1e-6, rtol=0)


def test_a_constant_group_gets_exactly_zero():
    # 0.3 * (1 + 2) / 3 may round off 0.3; the estimator returns exactly 0 anyway.
    batch = msgspec.structs.replace(make_batch(num_groups=1, group_size=2), rewards=[0.3, 0.3])  # lens 1 2
    assert not assign_advantages(batch, OpoConfig()).advantages.any()


def test_opo_is_registered_and_decoded_from_a_config():
    assert "opo" in ALGORITHM_NAMES and ALGORITHMS["opo"].needs_group and not ALGORITHMS["opo"].needs_values
    cfg = load_config(None, ["algorithm.name=opo", "algorithm.clip_eps_high=0.28"])
    assert isinstance(cfg.algorithm, OpoConfig) and cfg.algorithm.clip_eps_high == 0.28
    with pytest.raises(ConfigError, match=r"^algorithm\.gamma: unknown field"):
        load_config(None, ["algorithm.name=opo", "algorithm.gamma=0.9"])
    with pytest.raises(ConfigError, match=r"^rollout\.n: expected >= 2 for opo"):
        load_config(None, ["algorithm.name=opo", "rollout.n=1"])
