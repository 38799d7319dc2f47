"""The curriculum's rules: promotion, demotion, window, bounds; rewards selected by level."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.config import ConfigError, CurriculumConfig, DataConfig, check_curriculum
from pipeline.types import Prompt, RolloutBatch
from stages.data.curriculum import advance_curriculum, select_level_rewards, start_curriculum, summarise_curriculum


def _cfg(**kw):
    return CurriculumConfig(**{"levels": [1, 2, 3], "promote_at": 0.75, "window": 4, **kw})


def test_no_decision_until_the_window_is_full():
    cfg = _cfg()
    s = advance_curriculum(start_curriculum(cfg), cfg, [1.0, 1.0, 1.0])
    assert (s.level, s.recent) == (1, [1.0, 1.0, 1.0])


def test_promotes_at_the_threshold_and_starts_a_fresh_window():
    cfg = _cfg()
    # window [1, 1, 1, 0]: mean 0.75 >= promote_at 0.75 -> level 2, window emptied
    s = advance_curriculum(start_curriculum(cfg), cfg, [1.0, 1.0, 1.0, 0.0])
    assert (s.level, s.recent, s.promotions) == (2, [], 1)


def test_stays_below_the_threshold_and_keeps_only_the_newest_window():
    cfg = _cfg()
    # [1, 0, 1, 0, 1]: newest four [0, 1, 0, 1], mean 0.5 < 0.75: stay at level 1
    s = advance_curriculum(start_curriculum(cfg), cfg, [1.0, 0.0, 1.0, 0.0, 1.0])
    assert (s.level, s.recent) == (1, [0.0, 1.0, 0.0, 1.0])
    # one more 1: [1, 0, 1, 1], mean 0.75 -> promoted
    assert advance_curriculum(s, cfg, [1.0]).level == 2


def test_no_promotion_past_the_last_level_and_demotion_below_the_other_threshold():
    cfg = _cfg(start=3, demote_below=0.25)
    top = advance_curriculum(start_curriculum(cfg), cfg, [1.0] * 4)
    assert (top.level, top.promotions, len(top.recent)) == (3, 0, 4)
    # [0, 0, 0, 1]: mean 0.25 is not below 0.25: stays; [0, 0, 0, 0]: 0 < 0.25 -> level 2
    assert advance_curriculum(start_curriculum(cfg), cfg, [0.0, 0.0, 0.0, 1.0]).level == 3
    down = advance_curriculum(start_curriculum(cfg), cfg, [0.0] * 4)
    assert (down.level, down.demotions, down.recent) == (2, 1, [])


def test_no_demotion_before_the_first_level_or_without_a_threshold():
    assert advance_curriculum(start_curriculum(_cfg()), _cfg(), [0.0] * 4).level == 1
    cfg = _cfg(demote_below=0.5)
    s = advance_curriculum(start_curriculum(cfg), cfg, [0.0] * 4)
    assert (s.level, s.demotions) == (1, 0)


def test_rewards_are_selected_by_the_prompts_level():
    prompts = [Prompt(prompt_id=f"p{i}", index=i, text="", token_ids=[], extra_info={"difficulty": lvl})
               for i, lvl in enumerate([1, 2])]
    z = np.zeros((4, 1), np.int32)
    batch = RolloutBatch(batch_id=0, step=0, prompts=prompts, group_size=2, sample_ids=["a", "b", "c", "d"],
                         prompt_ids=z, prompt_lens=z[:, 0], completion_ids=z, completion_lens=z[:, 0],
                         completions=[""] * 4, behaviour_logprobs=z.astype(np.float32), token_versions=z,
                         policy_version=0, rewards=np.array([0.1, 0.2, 0.3, 0.4], np.float32))
    # prompt 0 (level 1) owns samples 0-1, prompt 1 (level 2) samples 2-3
    assert select_level_rewards([batch], "difficulty", 2) == pytest.approx([0.3, 0.4])
    assert select_level_rewards([batch], "difficulty", 3) == []
    assert summarise_curriculum(start_curriculum(_cfg()))["curriculum/level"] == 1


@pytest.mark.parametrize(("kw", "path"), [
    ({"levels": [1, 1]}, "data.curriculum.levels"),
    ({"levels": [1, 2], "start": 5}, "data.curriculum.start"),
    ({"levels": [1, 2], "promote_at": 0.5, "demote_below": 0.5}, "data.curriculum.demote_below"),
])
def test_bad_curriculum_configs_name_the_field(kw, path):
    with pytest.raises(ConfigError, match=path):
        check_curriculum(DataConfig(path="x.jsonl", curriculum=CurriculumConfig(**kw)))
    with pytest.raises(ConfigError, match="expected data.path"):
        check_curriculum(DataConfig(curriculum=CurriculumConfig(levels=[1])))
