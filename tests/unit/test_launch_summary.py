"""Where a launch's start-up went: ``describe_startup`` and ``slowest_setup`` (pipeline/launch.py)."""

from __future__ import annotations

import pytest

from pipeline.launch import describe_startup, slowest_setup

RUNNER = {"ray_s": 4.0, "actors_s": 3.5, "setup_s": 61.0,
          "stages": {"source:0": {"setup_s": 0.2, "process_age_s": 9.0, "constructed_s": 1.1},
                     "rollout:0": {"setup_s": 60.9, "process_age_s": 70.0, "constructed_s": 2.0,
                                   "model_files_s": 0.4, "engine_s": 48.0, "warm_up_s": 9.1},
                     "trainer:0": {"setup_s": 21.0, "process_age_s": 30.0, "constructed_s": 3.0,
                                   "engine_s": 20.5}}}


def test_the_parts_add_up_to_the_first_step_and_the_rest_is_the_step_itself():
    startup = describe_startup(RUNNER, preflight_s=2.5, first_step_s=83.1)
    assert startup["first_step_s"] == 83.1
    assert (startup["preflight_s"], startup["ray_s"], startup["actors_s"], startup["setup_s"]) == (2.5, 4.0, 3.5, 61.0)
    # 83.1 - (2.5 + 4 + 3.5 + 61) = 12.1 s: generating, scoring and training step 1.
    assert startup["first_step_after_setup_s"] == pytest.approx(12.1)
    assert startup["stages"] is RUNNER["stages"]


def test_the_slowest_set_up_is_named_with_its_own_phases():
    assert slowest_setup(describe_startup(RUNNER, 2.5, 83.1)) == \
        "rollout:0 60.9 s (model_files 0.4, engine 48, warm_up 9.1)"
    only = {"stages": {"source:0": {"setup_s": 0.2, "process_age_s": 9.0, "constructed_s": 1.1}}}
    assert slowest_setup(only) == "source:0 0.2 s"


def test_a_runner_that_reported_nothing_gives_zeros_not_an_error():
    startup = describe_startup({}, preflight_s=1.0, first_step_s=5.0)
    assert startup["ray_s"] == startup["actors_s"] == startup["setup_s"] == 0.0
    assert startup["first_step_after_setup_s"] == 4.0 and startup["stages"] == {}
    assert slowest_setup(startup) is None
