"""Resumable checkpoints: atomic writes, skipping damaged ones, exactly-once prompt sets."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import msgspec
import pytest

from pipeline.checkpoint import (
    ConsumedPrompts,
    ResumeState,
    check_resume_config,
    diff_configs,
    find_latest_checkpoint,
    truncate_metrics,
    write_checkpoint,
)
from pipeline.config import ConfigError


def _save(marker: str):
    def save(path):
        path.mkdir(parents=True)
        (path / "weights").write_text(marker)
    return save


def test_consumed_prompts_keep_a_frontier_and_the_few_above_it():
    done = ConsumedPrompts()
    done.add([0, 1, 2, 5, 7])
    assert (done.frontier, done.above) == (3, [5, 7])
    done.add([3, 4])  # 0..5 now contiguous: the frontier moves past 5
    assert (done.frontier, done.above) == (6, [7])
    check = done.as_set_checker()
    assert [i for i in range(10) if check(i)] == [0, 1, 2, 3, 4, 5, 7] == [i for i in range(10) if i in done]
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(done), type=ConsumedPrompts)
    assert again == done


def test_checkpoints_are_written_whole_and_pruned(tmp_path):
    for version in (2, 4, 6):
        path = write_checkpoint(tmp_path, ResumeState(version=version, trained_prompts=8 * version), _save(str(version)),
                                keep=2)
    assert path.name == "step-00000006"
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-00000004", "step-00000006"]  # no temporary directory left behind
    found, state, skipped = find_latest_checkpoint(tmp_path)
    assert found == path and state.version == 6 and state.trained_prompts == 48 and skipped == []
    assert (found / "trainer" / "weights").read_text() == "6"


def test_a_damaged_checkpoint_is_skipped_for_the_previous_one(tmp_path):
    write_checkpoint(tmp_path, ResumeState(version=3, trained_prompts=24), _save("3"), keep=5)
    newest = write_checkpoint(tmp_path, ResumeState(version=5, trained_prompts=40), _save("5"), keep=5)
    (newest / "state.msgpack").write_bytes(b"\x93garbage")
    found, state, skipped = find_latest_checkpoint(tmp_path)
    assert state.version == 3 and found.name == "step-00000003"
    assert len(skipped) == 1 and "step-00000005" in skipped[0] and "damaged" in skipped[0]
    assert find_latest_checkpoint(tmp_path / "nothing-here") is None


def test_resume_refuses_a_changed_config_naming_the_keys():
    old = {"train": {"lr": 1e-3, "checkpoint_every": 10}, "run": {"steps": 10}, "model": {"path": "a"}}
    assert diff_configs(old, old) == []
    new = {"train": {"lr": 1e-3, "checkpoint_every": 5}, "run": {"steps": 50}, "model": {"path": "a"}}
    assert check_resume_config(old, new) == ["run.steps", "train.checkpoint_every"]
    decaying = {**new, "train": {"lr": 1e-3, "checkpoint_every": 5, "lr_scheduler": "cosine"}}
    with pytest.raises(ConfigError, match=r"run.steps \(the learning rate decays over run.steps\)"):
        check_resume_config({**old, "train": {**old["train"], "lr_scheduler": "cosine"}}, decaying)
    # Where vLLM's memory goes may change (a run saved before the planned KV cache holds
    # kv_cache_gib: 1.0); how it samples may not.
    memory = {**old, "rollout": {"kv_cache_gib": None, "gpu_memory_utilization": 0.3, "max_tokens": 8}}
    assert check_resume_config({**old, "rollout": {"kv_cache_gib": 1.0, "max_tokens": 8}}, memory) == [
        "rollout.gpu_memory_utilization", "rollout.kv_cache_gib"]
    with pytest.raises(ConfigError, match=r"in \['rollout.max_tokens'\]"):
        check_resume_config({**old, "rollout": {"max_tokens": 8}}, {**old, "rollout": {"max_tokens": 16}})
    bad = {**new, "train": {"lr": 2e-3, "checkpoint_every": 5}, "model": {"path": "b"}}
    with pytest.raises(ConfigError, match=r"differs from the run's own in \['model.path', 'train.lr'\]"):
        check_resume_config(old, bad)


def test_metrics_after_the_checkpoint_are_cut(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "x": s}) + "\n" for s in range(6)]
    path.write_text("".join(rows) + '{"step": 6, "x"')  # a torn last line
    assert truncate_metrics(path, 4) == 3
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 3]
    assert truncate_metrics(path, 4) == 0


def test_prompt_accounts_reconcile_only_when_ids_and_counts_agree():
    from pipeline.checkpoint import reconcile_prompt_ids

    def ids(frontier, above=()):
        return {"frontier": frontier, "above": list(above)}

    ok = reconcile_prompt_ids(ids(8), 8, ids(6, [6, 7]), 8)  # {0..7} both ways
    assert ok["reconciles"] and ok["missing"] == [] and ok["unexpected"] == []
    lost = reconcile_prompt_ids(ids(8), 8, ids(6, [7]), 7)  # prompt 6 never finished
    assert not lost["reconciles"] and lost["missing"] == [6]
    twice = reconcile_prompt_ids(ids(8), 8, ids(8), 9)  # one prompt trained twice: 9 for a set of 8
    assert not twice["reconciles"] and twice["repeated_finish"] == 1
    stray = reconcile_prompt_ids(ids(4), 4, ids(4, [9]), 5)  # finished a prompt nobody issued
    assert not stray["reconciles"] and stray["unexpected"] == [9]


def test_resume_with_the_original_config_and_relative_paths_is_accepted(tmp_path, monkeypatch):
    """The saved config.yaml holds pre-flight's absolute paths; the same config given
    again with relative ones is the same run, not a changed one."""
    import argparse

    import yaml

    from pipeline.cli import _load_resume
    from pipeline.config import load_config, to_dict
    from pipeline.preflight import absolutise_paths

    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1="}\n')
    original = tmp_path / "job.yaml"
    original.write_text(yaml.safe_dump({"data": {"path": "prompts.jsonl"}, "run": {"dir": "run"}}))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    saved = to_dict(absolutise_paths(load_config(original)))
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    write_checkpoint(run_dir, ResumeState(version=2, trained_prompts=16), _save("2"), keep=1)
    args = argparse.Namespace(resume=str(run_dir), config=str(original), overrides=["run.steps=5"])
    cfg = _load_resume(args)
    assert cfg.run.resume_from.endswith("step-00000002") and cfg.run.steps == 5


def test_resume_with_another_number_of_trainer_ranks_exits_2_naming_the_key(tmp_path, capsys):
    """Each rank saved its own optimizer partition: ``launch --resume`` with
    train.num_ranks changed is a bad config (exit 2) naming the key, before Ray starts."""
    import yaml

    from pipeline.cli import main
    from pipeline.config import load_config, to_dict
    from pipeline.preflight import absolutise_paths

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    saved = to_dict(absolutise_paths(load_config(None, [f"run.dir={run_dir}", "train.num_ranks=2"])))
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    write_checkpoint(run_dir, ResumeState(version=2, trained_prompts=16, num_ranks=2), _save("2"), keep=1)
    assert main(["launch", "--resume", str(run_dir), "train.num_ranks=1"]) == 2
    err = capsys.readouterr().err
    assert "invalid config" in err and "['train.num_ranks']" in err, err


def test_a_checkpoint_is_loaded_only_by_as_many_ranks_as_wrote_it(tmp_path):
    """``run.resume_from`` given directly skips the config comparison; the trainer checks
    the ranks the checkpoint records before it loads anything (the engine here would
    fail if it were asked to)."""
    from pipeline.config import load_config
    from stages.trainer.checkpoint import TrainerCheckpoints

    cfg = load_config(None, [f"run.dir={tmp_path}", "train.num_ranks=3"])
    path = write_checkpoint(tmp_path, ResumeState(version=2, trained_prompts=16, num_ranks=2), _save("2"), keep=1)
    with pytest.raises(ValueError, match=r"train.num_ranks: .* written by 2 trainer ranks.*got 3"):
        TrainerCheckpoints(cfg, engine=None).restore(path)


def test_a_truncated_checkpoint_fails_its_manifest_and_is_skipped(tmp_path):
    write_checkpoint(tmp_path, ResumeState(version=3, trained_prompts=24), _save("3"), keep=5)
    newest = write_checkpoint(tmp_path, ResumeState(version=5, trained_prompts=40), _save("55555"), keep=5)
    # The manifest lists every file with its size: trainer/weights holds "55555", 5 bytes.
    assert json.loads((newest / "manifest.json").read_text())["files"]["trainer/weights"] == 5
    (newest / "trainer" / "weights").write_text("55")  # cut short, as a full disk or a crash leaves it
    found, state, skipped = find_latest_checkpoint(tmp_path)
    assert found.name == "step-00000003" and state.version == 3
    assert skipped == [f"{newest}: skipped, it fails its manifest check: trainer/weights holds 2 bytes, "
                       f"its manifest says 5 (truncated?)"]


class FakeFullDisk:
    """A trainer state writer that writes part of a file, then fails as a full disk does."""

    def __call__(self, path):
        path.mkdir(parents=True)
        (path / "weights").write_text("part")
        raise OSError(errno.ENOSPC, "No space left on device")


class FakeEngine:
    """The version and ``save_state`` a ``TrainerCheckpoints`` needs of an engine."""

    def __init__(self, version: int, save_state) -> None:
        self.version, self.save_state = version, save_state


@pytest.mark.parametrize("policy", ["stop", "continue"])
def test_a_full_disk_fails_the_write_cleanly(tmp_path, policy):
    from pipeline.config import load_config
    from stages.trainer.checkpoint import CheckpointWriteError, TrainerCheckpoints

    cfg = load_config(None, [f"run.dir={tmp_path}", f"train.on_checkpoint_error={policy}"])
    good = TrainerCheckpoints(cfg, FakeEngine(2, _save("2"))).write()
    checkpoints = TrainerCheckpoints(cfg, FakeEngine(4, FakeFullDisk()))
    checkpoints.dirty = True
    if policy == "stop":
        with pytest.raises(CheckpointWriteError, match=rf"version 4 could not be written .*No space left.*"
                                                       rf"the last good checkpoint is {good}"):
            checkpoints.write()
    else:
        assert checkpoints.write() is None and checkpoints.failed_writes == 1
        assert checkpoints.dirty and checkpoints.last_written == -1  # written again at the next chance
    # Nothing half-written left: the good checkpoint alone, and found.
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [good.name]
    assert find_latest_checkpoint(tmp_path)[0] == good


def test_a_resumed_auto_staleness_run_starts_at_the_eta_its_last_step_trained_under(tmp_path):
    """``max_staleness: auto``: the checkpoint keeps the bound of the last step it covers
    and the resumed run's controller starts there (within the start and the cap); a
    fixed η is the config's whatever the checkpoint says."""
    from pipeline.config import load_config
    from pipeline.runner import _resumed_counts, _staleness_start
    from stages.trainer.checkpoint import TrainerCheckpoints

    cfg = load_config(None, [f"run.dir={tmp_path}", "dataflow.max_staleness=auto"])
    checkpoints = TrainerCheckpoints(cfg, FakeEngine(4, _save("4")))
    checkpoints.record_step([], {"dataflow/max_staleness": 1})
    checkpoints.record_step([], {"dataflow/max_staleness": 3})
    path = checkpoints.write()
    assert find_latest_checkpoint(tmp_path)[1].max_staleness == 3
    resumed = load_config(None, [f"run.dir={tmp_path}", "dataflow.max_staleness=auto", f"run.resume_from={path}"])
    counts = _resumed_counts(resumed)
    assert counts["max_staleness"] == 3
    assert _staleness_start(resumed, counts) == {"max_staleness": 3, "auto_staleness": True}
    assert _staleness_start(resumed, None) == {"max_staleness": 1, "auto_staleness": True}  # a fresh run
    # A checkpoint beyond a lowered cap resumes at the cap; a fixed η stays the config's.
    capped = load_config(None, ["dataflow.max_staleness=auto", "dataflow.max_staleness_cap=2"])
    assert _staleness_start(capped, counts)["max_staleness"] == 2
    fixed = load_config(None, ["dataflow.max_staleness=1"])
    assert _staleness_start(fixed, counts) == {"max_staleness": 1, "auto_staleness": False}
    assert _staleness_start(None, counts) == {}


def test_an_empty_checkpoints_dir_is_no_run_and_a_mounted_one_is_kept(tmp_path, monkeypatch):
    from pipeline.checkpoint import prepare_run_dir
    from pipeline.config import ConfigError

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)  # e.g. a volume of its own, mounted for the run
    prepare_run_dir(run_dir, None, overwrite=False)  # accepted: nothing of a run is there
    (run_dir / "checkpoints" / "step-00000002").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"already holds a run \(checkpoints\)"):
        prepare_run_dir(run_dir, None, overwrite=False)
    # Overwritten, a mount point is emptied, not removed (its volume stays mounted).
    monkeypatch.setattr("pipeline.checkpoint.os.path.ismount", lambda p: Path(p).name == "checkpoints")
    prepare_run_dir(run_dir, None, overwrite=True)
    assert (run_dir / "checkpoints").is_dir() and not any((run_dir / "checkpoints").iterdir())
