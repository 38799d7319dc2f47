"""Learning-rate schedules (stages/trainer/lr_schedule.py): factors derived by hand."""

import math

import pytest
import torch

from stages.trainer.lr_schedule import build_lr_scheduler, compute_lr_factor


def test_warmup_ramps_without_a_zero_step_then_holds():
    # warmup 4: steps 0..3 -> 1/4, 2/4, 3/4, 4/4; then constant 1
    assert [compute_lr_factor(k, "constant", 4) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_decay_after_warmup():
    # warmup 2, total 10, min 0.1: step 2 -> p 0 -> 1.0; step 6 -> p 4/8 = 0.5 ->
    #   0.1 + 0.9 * 0.5 = 0.55; step 10 -> p 1 -> 0.1; beyond: stays 0.1
    f = [compute_lr_factor(k, "linear", 2, 10, 0.1) for k in (0, 1, 2, 6, 10, 12)]
    assert f == pytest.approx([0.5, 1.0, 1.0, 0.55, 0.1, 0.1], abs=1e-12)


def test_cosine_decay_after_warmup():
    # no warmup, total 8, min 0: step 2 -> p 1/4 -> (1 + cos(pi/4))/2 = 0.8535534;
    #   step 4 -> p 1/2 -> 0.5; step 8 -> 0
    f = [compute_lr_factor(k, "cosine", 0, 8) for k in (0, 2, 4, 8)]
    assert f == pytest.approx([1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5, 0.0], abs=1e-12)
    assert f[1] == pytest.approx(0.8535534, abs=1e-7)


def test_bad_schedules_are_refused():
    with pytest.raises(ValueError, match="total_steps > warmup_steps"):
        compute_lr_factor(5, "linear", 5, 5)
    with pytest.raises(ValueError, match="lr_scheduler"):
        compute_lr_factor(0, "step")  # type: ignore[arg-type]


def test_scheduler_sets_the_lr_of_each_step():
    # lr 0.1, warmup 2 then cosine to 0 over 4 steps: steps 0..3 use 0.05, 0.1, 0.1, 0.05
    assert build_lr_scheduler("constant", 0, 10, 0.0) is None  # nothing to schedule
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = build_lr_scheduler("cosine", 2, 4, 0.0)(opt)
    used = []
    for _ in range(4):
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert used == pytest.approx([0.05, 0.1, 0.1, 0.05], abs=1e-12)
