"""The soak's fault injectors (``bench/soak_faults.py``, ``bench/fault_disk.py``,
``bench/soak_flow.py``) on their own: each makes the fault it names, and only once or
only while triggered; the checkpoint code meets them as it meets the real thing."""

from __future__ import annotations

import asyncio
import builtins
import errno
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from bench.fault_disk import FaultInjectingDisk, install
from bench.soak_faults import (
    NaNFault,
    find_engine_core,
    list_complete_checkpoints,
    members,
    parse_faults,
    read_last_row,
    read_rows,
    stage_counter,
    truncate_largest_file,
)
from pipeline.checkpoint import ResumeState, find_latest_checkpoint, write_checkpoint
from pipeline.config import load_config
from tests.ray_local.fakes import make_fake_rollout_batch

ROOT = Path(__file__).resolve().parents[2]


def _save(marker: str):
    def save(path: Path) -> None:
        path.mkdir(parents=True)
        (path / "weights").write_text(marker)

    return save


def test_faults_parse_all_or_a_list_in_round_one_order():
    assert parse_faults("all") == ("stage", "driver", "nan", "disk_full", "ckpt_truncate", "engine")
    assert parse_faults("engine, nan,stage") == ("stage", "nan", "engine")
    with pytest.raises(ValueError, match=r"--faults: expected 'all' or a comma list of .*got 'nan,oom'"):
        parse_faults("nan,oom")
    with pytest.raises(ValueError, match=r"--faults"):
        parse_faults(" , ")


def test_the_nan_node_poisons_one_reward_once_per_trigger(tmp_path):
    node = NaNFault(str(tmp_path / "nan"))
    batch = make_fake_rollout_batch(0, num_groups=2, group_size=4)
    assert asyncio.run(node.process(batch)) is batch  # no trigger: passed on as it came
    (tmp_path / "nan").touch()
    poisoned = asyncio.run(node.process(make_fake_rollout_batch(7, num_groups=2, group_size=4)))
    assert np.isnan(poisoned.rewards[0]) and np.isfinite(poisoned.rewards[1:]).all()
    assert not (tmp_path / "nan").exists() and json.loads((tmp_path / "nan.done").read_text())["batch_id"] == 7
    after = make_fake_rollout_batch(8, num_groups=2, group_size=4)
    assert asyncio.run(node.process(after)) is after and node.status() == {"injected": 1}


def test_the_soak_graph_puts_the_nan_node_before_the_trainer(monkeypatch, tmp_path):
    from pipeline.launch import build_dataflow

    monkeypatch.setenv("CONVEYOR_SOAK_FAULT_DIR", str(tmp_path))
    cfg = load_config(ROOT / "configs" / "quickstart.yaml",
                      [f"run.script={ROOT / 'bench' / 'soak_flow.py'}", "run.max_restarts=7"])
    df = build_dataflow(cfg)
    assert [(n.name, n.input_from) for n in df.nodes.values()] == [
        ("source", None), ("rollout", "source"), ("reward", "rollout"), ("reference", "reward"),
        ("nan_fault", "reference"), ("trainer", "nan_fault")]
    node = df.nodes["nan_fault"]
    assert node.max_restarts == 7 and node.kwargs == {"trigger": str(tmp_path / "nan")}
    # The stages around it keep what the launch gives them (the rollout restarts too).
    assert df.nodes["rollout"].max_restarts == 7 and df.nodes["reference"].max_restarts == 7


def test_a_shimmed_full_disk_fails_a_checkpoint_cleanly_until_freed(tmp_path, monkeypatch):
    from stages.trainer.checkpoint import TrainerCheckpoints

    trigger = tmp_path / "disk_full"
    disk = FaultInjectingDisk(str(tmp_path / "run" / "checkpoints"), str(trigger), opener=io.open)
    monkeypatch.setattr(builtins, "open", disk.open)
    monkeypatch.setattr(io, "open", disk.open)
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", "train.on_checkpoint_error=continue"])

    class FakeEngine:
        version = 2

        @staticmethod
        def save_state(path: Path) -> None:
            _save("2")(path)

    checkpoints = TrainerCheckpoints(cfg, FakeEngine())
    good = checkpoints.write()
    trigger.touch()
    (tmp_path / "elsewhere.txt").write_text("a write outside the directory is untouched")
    with pytest.raises(OSError) as info:
        write_checkpoint(tmp_path / "run", ResumeState(version=4, trained_prompts=32), _save("4"), keep=2)
    assert info.value.errno == errno.ENOSPC
    FakeEngine.version = 4
    assert checkpoints.write() is None and checkpoints.failed_writes == 1  # on_checkpoint_error: continue
    # No partial checkpoint under a final name, nor a temporary one left.
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == [good.name]
    trigger.unlink()
    assert checkpoints.write().name == "step-00000004"
    assert [p.name for p in list_complete_checkpoints(tmp_path / "run")] == ["step-00000002", "step-00000004"]


def test_the_shim_is_installed_only_where_the_environment_names_it(tmp_path, monkeypatch):
    monkeypatch.setattr(builtins, "open", builtins.open)  # restored after the test
    monkeypatch.setattr(io, "open", io.open)
    assert install({}) is None and builtins.open is io.open
    disk = install({"CONVEYOR_FAULT_DISK_DIR": str(tmp_path), "CONVEYOR_FAULT_DISK_TRIGGER": str(tmp_path / "t")})
    assert builtins.open == disk.open and io.open == disk.open
    with open(tmp_path / "a", "w") as f:  # no trigger: an ordinary file
        f.write("x")
    (tmp_path / "t").touch()
    with open(tmp_path / "b", "wb") as f, pytest.raises(OSError, match="No space left"):
        f.write(b"x")
    assert (tmp_path / "a").read_text() == "x" and (tmp_path / "b").read_bytes() == b""


def test_a_truncated_newest_checkpoint_is_skipped_for_the_one_before(tmp_path):
    write_checkpoint(tmp_path, ResumeState(version=2, trained_prompts=16), _save("2" * 10), keep=2)
    newest = write_checkpoint(tmp_path, ResumeState(version=4, trained_prompts=32), _save("4" * 10), keep=2)
    cut = truncate_largest_file(newest)
    assert cut == {"file": "trainer/weights", "bytes_before": 10, "bytes_after": 5}
    _, state, skipped = find_latest_checkpoint(tmp_path)
    assert state.version == 2 and skipped[0].startswith(f"{newest}: skipped")
    assert [p.name for p in list_complete_checkpoints(tmp_path)] == ["step-00000002"]


def test_the_engine_core_is_found_under_its_actor():
    title = "import setproctitle, time; setproctitle.setproctitle('VLLM::EngineCore'); print(1, flush=True); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", title], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"1"
        assert find_engine_core(os.getpid()).pid == child.pid
    finally:
        child.kill()
        child.wait()
    time.sleep(0.1)
    assert find_engine_core(os.getpid()) is None


def test_metrics_rows_are_read_whole_from_an_offset(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "x": 1}\n{"step": 1, "x": 2}\n{"step": 2, "x"')  # the last one still being written
    rows, offset = read_rows(path, 0)
    assert [r["step"] for r in rows] == [0, 1] and offset == len('{"step": 0, "x": 1}\n{"step": 1, "x": 2}\n')
    assert read_rows(path, 5) == ([{"step": 1, "x": 2}], offset)  # the row cut by the offset is skipped
    assert read_last_row(path) == {"step": 1, "x": 2} and read_last_row(tmp_path / "none") == {}


def test_counters_add_up_over_replicas_and_prompt_sets_expand():
    status = {"stages": {"rollout": {"engine_restarts": 1}, "rollout:1": {"engine_restarts": 2},
                         "trainer": {"checkpoint_write_failures": 3}, "reward": {}}}
    assert stage_counter(status, "rollout", "engine_restarts") == 3
    assert stage_counter(status, "trainer", "checkpoint_write_failures") == 3
    assert stage_counter({}, "trainer", "checkpoint_write_failures") == 0
    assert members({"frontier": 3, "above": [5]}) == {0, 1, 2, 5}
