"""``bench gpu_e2e --model NAME``: the choice of shape and rows, the job it builds (chat
rows of the config's task, the same for Conveyor, TRL and the engines alone), the
stage rates and their fractions of the engines alone. No GPU: what runs on one is
``bench/gpu_e2e.py``'s rows."""

import json
from pathlib import Path

import numpy as np
import pytest

import stages.models.shapes
from bench.__main__ import main as bench_main
from bench.common import describe_startup_parts, stage_log_timings
from bench.gpu_e2e import (
    CONFIG,
    SHAPE_SYSTEMS,
    SYSTEMS,
    compute_engine_fractions,
    compute_stage_rates,
    compute_wall_rates,
    over_trl_by_round,
    parse_systems,
    result_label,
)
from bench.shape_job import build_job_rows, prepare_job
from pipeline.config import load_config
from stages.models.shapes import SCALED_DOWN, build_real_shape_checkpoint


def test_model_picks_the_shape_rows_and_the_result_label():
    assert parse_systems(None) == SYSTEMS == ("async", "sync", "colocate", "trl")  # gpu_small as before
    assert result_label(SYSTEMS) == "default"
    assert parse_systems(None, "qwen3_0.6b") == SHAPE_SYSTEMS == ("engines", "async", "colocate", "trl")
    assert result_label(SHAPE_SYSTEMS, "qwen3_0.6b") == "qwen3_0.6b-default"
    chosen = parse_systems("engines,colocate[train.chunk_size=16]", "qwen3_4b")
    assert result_label(chosen, "qwen3_4b") == "qwen3_4b-engines-colocate[train.chunk_size=16]"
    assert result_label(SYSTEMS, "qwen3_4b") == "qwen3_4b-async-sync-colocate-trl"
    job = ("train.gradient_checkpointing=true",)
    assert result_label(SHAPE_SYSTEMS, "qwen3_4b", job) == "qwen3_4b-default-train.gradient_checkpointing=true"


def test_set_overrides_every_rows_job_and_a_bad_one_exits_2(tmp_path: Path, monkeypatch, capsys):
    """``--set`` reaches every row's config, TRL's included: TRL follows the job's
    gradient checkpointing and takes as many rows a pass as Conveyor's trainer does."""
    import torch

    from bench.e2e import build_trl_args
    from bench.gpu_e2e import trl_micro_batch

    for bad, says in ((["train.gradient_checkpointing"], "--set: overrides are key=value"),
                      (["train.gradient_chekpointing=true"], "--set: ")):
        with pytest.raises(SystemExit) as info:
            bench_main(["gpu_e2e", "--model", "qwen3_4b", "--set", *bad])
        err = capsys.readouterr().err
        assert info.value.code == 2 and says in err and bad[0].split("=")[0] in err
    with pytest.raises(SystemExit) as info:
        bench_main(["e2e", "--set", "train.lr=1e-5"])
    assert info.value.code == 2 and "only gpu_e2e takes job overrides" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_main(["gpu_e2e", "--model", "qwen3_4b", "--out", str(tmp_path), "--set",
                       "train.gradient_checkpointing=true"]) == 0
    (path,) = (tmp_path / "gpu_e2e").glob("*.json")
    doc = json.loads(path.read_text())
    assert doc["label"].startswith("qwen3_4b-default-train.gradient")
    assert doc["params"]["job_overrides"] == ["train.gradient_checkpointing=true"]
    cfg = load_config(CONFIG, ["train.gradient_checkpointing=true"])
    assert build_trl_args(cfg, tmp_path, 3)["gradient_checkpointing"] is True
    assert build_trl_args(load_config(CONFIG), tmp_path, 3)["gradient_checkpointing"] is False
    # 256 samples of up to 64 + 128 tokens: 16384 tokens a pass hold 85 rows, 64 divide the step.
    assert trl_micro_batch(cfg) == 64
    assert trl_micro_batch(load_config(CONFIG, ["train.pass_tokens=0", "train.chunk_size=32"])) == 32
    assert trl_micro_batch(load_config(CONFIG, ["train.pass_tokens=100000"])) == 256
    assert trl_micro_batch(load_config(CONFIG, ["train.pass_tokens=0", "train.chunk_size=48"])) == 32


def test_a_bad_model_or_one_for_another_bench_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        bench_main(["gpu_e2e", "--model", "qwen9_1b"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--model: model shape: expected one of" in err and "qwen3_0.6b" in err
    with pytest.raises(SystemExit) as info:
        bench_main(["e2e", "--model", "qwen3_0.6b"])
    assert info.value.code == 2
    assert "only gpu_e2e, longtail and trainer_memory run at a chosen shape, not e2e" in capsys.readouterr().err


def test_without_a_gpu_the_shape_result_is_skipped_under_its_name(tmp_path: Path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_main(["gpu_e2e", "--model", "gemma3_1b", "--out", str(tmp_path)]) == 0
    (path,) = (tmp_path / "gpu_e2e").glob("*.json")
    doc = json.loads(path.read_text())
    assert path.stem.endswith("_gemma3_1b-default") and doc["label"] == "gemma3_1b-default"
    assert doc["status"] == "skipped" and doc["params"]["model"] == "gemma3_1b"


def test_stage_rates_per_busy_second():
    rows = [
        # rollout: 100 tokens x 256 samples / 2 s busy = 12,800/s; trainer: 1,000 tokens/s
        # x 4 s step = 4,000 tokens over 1.5 + 0.5 s of passes and update = 2,000/s.
        {"timing_s/rollout": 2.0, "response_length/mean": 100.0, "throughput/tokens_per_s": 1000.0,
         "time/step_s": 4.0, "timing_s/train": 1.5, "timing_s/update": 0.5},
        # rollout: 50 x 256 / 2 s = 6,400/s; trainer: 3,000 x 2 s / 1 s = 6,000/s.
        {"timing_s/rollout": 2.0, "response_length/mean": 50.0, "throughput/tokens_per_s": 3000.0,
         "time/step_s": 2.0, "timing_s/train": 1.0, "timing_s/update": 0.0},
        {"response_length/mean": 80.0},  # no timings: left out of both means
    ]
    assert compute_stage_rates(rows, 256) == {"rollout_tokens_per_busy_s": (12800.0 + 6400.0) / 2,
                                              "trainer_tokens_per_busy_s": (2000.0 + 6000.0) / 2}
    assert compute_stage_rates([], 256) == {"rollout_tokens_per_busy_s": None, "trainer_tokens_per_busy_s": None}


def test_wall_rates_count_the_steady_steps_tokens_over_the_windows_seconds():
    rows = [{"time": 10.0, "response_length/mean": 999.0, "throughput/tokens_per_s": 9e9, "time/step_s": 9.0},
            {"time": 12.0, "response_length/mean": 100.0, "throughput/tokens_per_s": 1000.0, "time/step_s": 4.0},
            {"time": 16.0, "response_length/mean": 50.0, "throughput/tokens_per_s": 3000.0, "time/step_s": 2.0}]
    # The window is 10 s -> 16 s (the warm-up step is left out): (100 + 50) x 256 tokens
    # generated and 4,000 + 6,000 trained in 6 s, however the steps overlapped.
    assert compute_wall_rates(rows, 256, 1) == {"rollout_tokens_per_wall_s": 150 * 256 / 6.0,
                                                "trainer_tokens_per_wall_s": 10000.0 / 6.0}
    none = {"rollout_tokens_per_wall_s": None, "trainer_tokens_per_wall_s": None}
    assert compute_wall_rates(rows[:1], 256, 1) == none  # no steady step
    rows[2].pop("response_length/mean")
    assert compute_wall_rates(rows, 256, 1) == {**none, "trainer_tokens_per_wall_s": 10000.0 / 6.0}


def test_engine_fractions_and_trl_ratios_leave_the_engines_row_out():
    rows = {
        "engines": {"spec": "engines", "system": "engines-alone", "status": "ok",
                    "rollout_tokens_per_s": 20000.0, "trainer_tokens_per_s": 50000.0},
        "async": {"spec": "async", "system": "conveyor-async", "status": "ok", "samples_per_s_per_gpu": 300.0,
                  "rollout_tokens_per_wall_s": 15000.0, "trainer_tokens_per_wall_s": 40000.0,
                  # per busy second (higher under streaming): not what a fraction divides
                  "rollout_tokens_per_busy_s": 30000.0, "trainer_tokens_per_busy_s": 45000.0},
        "colocate": {"spec": "colocate", "system": "conveyor-colocate", "status": "error"},
        "trl": {"spec": "trl", "system": "trl-grpo-vllm-colocate", "status": "ok", "samples_per_s_per_gpu": 150.0},
    }
    # 15,000 / 20,000 = 0.75 of vLLM alone; 40,000 / 50,000 = 0.8 of the trainer alone.
    assert compute_engine_fractions(rows) == {"async": {"rollout": 0.75, "trainer": 0.8}}
    assert over_trl_by_round(rows) == {"async": [2.0], "colocate": [None]}
    rows["engines"]["status"] = "error"
    assert compute_engine_fractions(rows) == {}


def test_the_job_is_the_checkpoint_and_the_tasks_rows_as_chat(tmp_path: Path, monkeypatch):
    """prepare_job's overrides name the shape's checkpoint and a JSONL of the task's rows as
    one user message each; TRL's rows are the same; the engines alone render them as the
    run does, through the checkpoint's chat template."""
    from transformers import AutoTokenizer

    from bench.engine_alone import build_prompt_ids

    # A scaled-down build stands in for the published shape (building that is the GPU's job).
    ckpt = build_real_shape_checkpoint("qwen3_0.6b", tmp_path / "ckpt", overrides=SCALED_DOWN)
    monkeypatch.setattr(stages.models.shapes, "build_in_subprocess", lambda name: ckpt)
    job = prepare_job("qwen3_0.6b", 2, tmp_path / "job", CONFIG)
    data = tmp_path / "job" / "prompts.jsonl"
    assert job == (f"model.path={ckpt}", f"data.path={data}")
    cfg = load_config(CONFIG, list(job))
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(rows) == 2 * cfg.train.prompts_per_step  # two steps of 32 prompts
    trl_rows = build_job_rows(cfg, len(rows), chat=True)
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in trl_rows]
    plain = build_job_rows(cfg, 1, chat=False)[0]  # gpu_small's copy task: "<digits>=" -> "<digits>"
    assert rows[0]["prompt"] == [{"role": "user", "content": plain["prompt"]}]
    assert rows[0]["ground_truth"] == plain["ground_truth"] == plain["prompt"].removesuffix("=")
    tok = AutoTokenizer.from_pretrained(ckpt)
    ids = build_prompt_ids(cfg, tok, ckpt, 4)
    text = f"<|im_start|>user\n{plain['prompt']}<|im_end|>\n<|im_start|>assistant\n"  # ChatML
    assert ids[0] == tok(text, add_special_tokens=False).input_ids
    with pytest.raises(ValueError, match="64 usable prompts, the engines' step needs 65"):
        build_prompt_ids(cfg, tok, ckpt, 65)


def test_a_row_says_whether_its_start_up_compiled_vllm_cold(tmp_path: Path, monkeypatch):
    from bench.e2e import _attempt

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    cache = tmp_path / "torch_compile_cache"

    def compiles(entry: str | None) -> dict:
        if entry:  # what vLLM's first start of a model and config leaves behind
            (cache / entry).mkdir(parents=True, exist_ok=True)
        return {"system": "fake"}

    def added(entry: str | None) -> int:
        return _attempt("row", compiles, entry, describe=str)["vllm_compile_cache_entries_added"]

    assert added("a1b2c3d4e5") == 1
    assert added("a1b2c3d4e5") == 0  # the second start found it cached
    assert added("torch_aot_compile/f00d") == 1
    assert added(None) == 0  # eager: nothing compiled


def test_a_rows_start_up_names_its_parts_and_slowest_set_up():
    summary = {"startup": {"first_step_s": 66.3, "preflight_s": 10.1, "ray_s": 6.3, "stages": {
        "trainer:0": {"setup_s": 22.3, "engine_s": 21.9},
        "rollout:0": {"setup_s": 32.2, "imports_s": 10.2, "engine_s": 12.0, "compile_cached_s": 9.9}}}}
    assert describe_startup_parts(summary) == {
        "first_step_s": 66.3, "preflight_s": 10.1, "ray_s": 6.3,
        "slowest_setup": {"stage": "rollout:0", "setup_s": 32.2, "imports_s": 10.2, "engine_s": 12.0,
                          "compile_cached_s": 9.9}}
    assert describe_startup_parts({"status": "failed"}) == {}  # a run that never started its stages


def test_a_rows_start_up_keeps_the_stage_logs_timing_lines(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rollout.log").write_text(
        "INFO starting\n"
        "INFO Loading weights took 0.91 seconds\n"
        "INFO Dynamo bytecode transform time: 5.20 s\n"
        "INFO torch.compile takes 21.4 s in total\n"
        "Capturing CUDA graphs: 50%\rCapturing CUDA graphs: 100%\n"
        "INFO Graph capturing finished in 9 secs, took 0.38 GiB\n"
        "INFO init engine (profile, create kv cache, warmup model) took 31.02 seconds\n"
        "INFO generated 256 samples\n")
    (logs / "reward.log").write_text("INFO scored a micro-batch\n")  # nothing timed: left out
    found = stage_log_timings(tmp_path)
    assert found == {"rollout.log": [
        "INFO Loading weights took 0.91 seconds", "INFO Dynamo bytecode transform time: 5.20 s",
        "INFO torch.compile takes 21.4 s in total", "Capturing CUDA graphs: 100%",
        "INFO Graph capturing finished in 9 secs, took 0.38 GiB",
        "INFO init engine (profile, create kv cache, warmup model) took 31.02 seconds"]}
    assert stage_log_timings(tmp_path, per_file=2)["rollout.log"] == found["rollout.log"][-2:]
    assert stage_log_timings(tmp_path / "never-ran") == {}


def test_every_kind_of_row_is_run_and_reported(monkeypatch, capsys):
    """``run_rows`` with each row's runner faked by the row it returns on a GPU: each
    gets its console line, and the engines row's has no samples per second to print."""
    import bench.e2e
    import bench.gpu_e2e as gpu_e2e

    conveyor = {"samples_per_s": 160.0, "reward_final": 0.5, "time_to_threshold_s": {}}
    monkeypatch.setattr(gpu_e2e, "run_conveyor", lambda name, steps, where, job: {"system": f"conveyor-{name}",
                                                                                  **conveyor})
    monkeypatch.setattr(gpu_e2e, "run_trl_isolated", lambda steps, where, job: {"system": "trl-grpo", **conveyor})
    monkeypatch.setattr(gpu_e2e, "run_engines_isolated", lambda where, job: {
        "system": "engines-alone", "rollout_tokens_per_s": 61234.5, "trainer_tokens_per_s": 40321.0})
    monkeypatch.setattr(gpu_e2e, "_version", lambda dist: "1.16.0")
    monkeypatch.setattr(bench.e2e, "vllm_compile_cache_entries", lambda: set())
    rows = gpu_e2e.run_rows(("engines", "async", "trl"), steps=3)
    assert [r["status"] for r in rows.values()] == ["ok", "ok", "ok"]
    out = capsys.readouterr().out
    assert "engines-alone: rollout alone 61234 tokens per s, trainer alone 40321 tokens per s" in out
    assert "conveyor-async: 160.0 samples per s" in out and "trl-grpo: 160.0 samples per s" in out
    # A console line that cannot be made loses the line, not the row.
    row = bench.e2e._attempt("odd", lambda: {"system": "odd"})
    assert row["status"] == "ok" and "odd: ok (KeyError describing it: 'samples_per_s')" in capsys.readouterr().out


def test_the_engines_row_measures_each_engine_in_a_process_of_its_own(monkeypatch, tmp_path):
    """vLLM first, then the trainer, each a child of its own (a GPU each starts empty),
    read back into one row whose rates are theirs."""
    import bench.gpu_e2e as gpu_e2e

    children = []

    def child(kind, steps, root, overrides):
        children.append((kind, overrides))
        return {"tokens_per_s": 100.0 if kind == "engines-rollout" else 40.0, "prompt_len_mean": 25.0}

    monkeypatch.setattr(gpu_e2e, "_run_child", child)
    row = gpu_e2e.run_engines_isolated(tmp_path, ("rollout.compile=on",))
    assert children == [("engines-rollout", ("rollout.compile=on",)), ("engines-trainer", ("rollout.compile=on",))]
    assert (row["rollout_tokens_per_s"], row["trainer_tokens_per_s"]) == (100.0, 40.0)
    assert row["status"] == "ok" and not row["rollout_logprobs"]


def test_the_trainer_alone_trains_every_completion_at_the_cap():
    """The engines row's trainer step: completions at ``max_tokens`` (its best rate at the
    job's shape); ``bench trainer_gpu`` keeps its spread from half the cap."""
    from bench.trainer_gpu import build_step_batches

    full = build_step_batches(8, 2, 4, 16, 100, min_tokens=16)
    assert len(full) == 4 and all((b.completion_lens == 16).all() for b in full)
    spread = np.concatenate([b.completion_lens for b in build_step_batches(8, 2, 4, 16, 100)])
    assert spread.min() >= 8 and spread.max() <= 16 and len(set(spread.tolist())) > 1


def test_a_trainer_step_is_told_in_its_parts_and_the_rest():
    from bench.gpu_e2e import summarize_trainer_timing

    rows = [{"time/step_s": 2.0, "timing_s/train": 1.2, "timing_s/update": 0.1, "timing_s/weight_publish": 0.1},
            {"time/step_s": 4.0, "timing_s/train": 2.8, "timing_s/update": 0.1, "timing_s/weight_publish": 0.1}]
    timing = summarize_trainer_timing(rows)
    assert timing["step"] == 3.0 and timing["train"] == 2.0
    assert timing["other"] == pytest.approx(3.0 - 2.0 - 0.1 - 0.1)
    assert summarize_trainer_timing([{"time/step_s": 1.0}])["other"] is None  # parts unknown: no rest
    assert timing["passes"] is None and timing["pass_s"] is None  # no pass counts in these rows
    # 4 then 12 passes of 4,000 then 36,000 computed tokens: 8 a step, 2,500 tokens and 0.25 s
    # a pass, 20,000 / 2.0 s while passes ran.
    rows[0] |= {"actor/passes": 4.0, "actor/pass_tokens": 4000.0}
    rows[1] |= {"actor/passes": 12.0, "actor/pass_tokens": 36000.0}
    timing = summarize_trainer_timing(rows)
    assert timing["passes"] == 8.0 and timing["pass_tokens"] == 2500.0
    assert timing["pass_s"] == pytest.approx(0.25) and timing["pass_tokens_per_s"] == pytest.approx(10000.0)
