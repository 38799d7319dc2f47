"""A user's own data and reward end to end: chat-format JSONL rendered with the
checkpoint's chat template, a reward ``.py`` file returning a dict with extras, and
reward failures that are counted per step and in ``summary.json`` — and that stop the
run when every sample of a step fails (``slow``). Real Ray and DeepSpeed on CPU, the HF
rollout backend, few steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.launch import launch_run
from pipeline.metrics import read_metrics
from pipeline.recorder import RecordingReader
from pipeline.stage import StageError

TEMPLATE = Path(__file__).parents[2] / "configs" / "jsonl_custom_reward.yaml"
STEPS = 3

REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str[:1].isupper():
        raise ValueError(f"cannot grade {solution_str!r}")
    return {"score": float(solution_str[:1] == ground_truth), "digit": float(solution_str[:1].isdigit())}


def always_fails(data_source, solution_str, ground_truth, extra_info=None):
    raise KeyError("answer")
'''


def write_inputs(root: Path) -> tuple[Path, Path]:
    """20 chat rows (``<digits>=`` -> first digit), then a line that is not JSON and a
    row with no messages: rows 21 and 22 are skipped before the run starts."""
    lines = [json.dumps({"messages": [{"role": "user", "content": f"{4000 + 37 * i}="}],
                         "ground_truth": str(4000 + 37 * i)[0]}) for i in range(20)]
    lines += ["{not json", json.dumps({"messages": []})]
    data = root / "chat.jsonl"
    data.write_text("\n".join(lines) + "\n")
    reward = root / "my_reward.py"
    reward.write_text(REWARD_FILE)
    return data, reward


def _config(root: Path, data: Path, reward: str, *extra: str):
    return load_config(TEMPLATE, [
        f"run.dir={root / 'run'}", "run.progress=false", "run.tensorboard=false", f"run.steps={STEPS}",
        "model.tiny.architecture=qwen2",  # a checkpoint with a chat template (ChatML)
        f"data.path={data}", f"reward.function={reward}",
        "rollout.n=4", "rollout.max_tokens=4", "train.prompts_per_step=4", "dataflow.prompts_per_micro_batch=2",
        "rollout.backend=hf", *extra,
    ])


@pytest.fixture(scope="module")
def chat_run(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("byo")
    data, reward = write_inputs(root)
    summary = launch_run(_config(root, data, f"{reward}:compute_score"))
    return root / "run", summary


def test_chat_jsonl_and_reward_file_run_with_validated_data(chat_run):
    _, summary = chat_run
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["samples"]["reconciles"]
    assert summary["data/rows_total"] == 22 and summary["data/rows_usable"] == 20
    assert summary["data/rows_skipped/malformed"] == 1 and summary["data/rows_skipped_first/malformed"] == [21]
    assert summary["data/rows_skipped/empty"] == 1 and summary["data/rows_skipped_first/empty"] == [22]


def test_the_rollout_generated_from_the_chat_template(chat_run):
    run_dir, _ = chat_run
    items = list(RecordingReader(run_dir / "recording" / "trainer").items("reference->trainer"))
    assert items
    for item in items:
        batch = item.value
        for i, prompt in enumerate(batch.prompts):
            assert prompt.text.startswith("<|im_start|>user\n") and prompt.text.endswith("<|im_start|>assistant\n")
            row = i * batch.group_size  # every sample of a group starts from its prompt's ids
            assert batch.prompt_ids[row, : batch.prompt_lens[row]].tolist() == prompt.token_ids


def test_reward_failures_and_extras_are_reported(chat_run):
    run_dir, summary = chat_run
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert len(rows) == STEPS
    per_step = [r["reward/errors"] for r in rows]
    # a random-init model starts ~26 of its 89 characters upper case: some samples fail
    assert sum(per_step) > 0
    assert summary["reward/errors"] >= sum(per_step)  # the summary also counts samples not trained
    assert "ValueError: cannot grade" in summary["reward/first_error"]
    assert all(0.0 <= r["reward/digit"] <= 1.0 for r in rows)  # the dict's extra key, per step


# A second launch; in every run: the reward stage's rule (tests/unit/test_reward_forms.py),
# a stage's error ending a run (tests/ray_local/test_dataflow_run.py) and a launch's failed
# summary (test_faults.py).
@pytest.mark.slow
def test_a_reward_that_always_fails_stops_the_run(ray_cluster, tmp_path):
    data, reward = write_inputs(tmp_path)
    cfg = _config(tmp_path, data, f"{reward}:always_fails", "record.edges=[]")
    with pytest.raises(StageError) as info:
        launch_run(cfg)
    message = str(info.value)
    assert f"reward function {reward}:always_fails failed on every sample of step 0" in message
    assert "KeyError: 'answer'" in message
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["stage"] == "reward"
    assert summary["data/rows_total"] == 22
