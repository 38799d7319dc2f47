"""The command line: where `conveyor bench` writes, and where overrides may go."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.__main__ import build_parser, default_out_dir
from bench.__main__ import main as bench_main
from bench.common import result_files
from pipeline.cli import build_parser as cli_parser


def test_a_quick_run_never_writes_into_the_committed_results(tmp_path: Path) -> None:
    checkout = tmp_path / "src"
    (checkout / "bench" / "results").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("")
    results = checkout / "bench" / "results"
    cwd = tmp_path / "work"
    assert default_out_dir(False, results, cwd) == results
    assert default_out_dir(True, results, cwd) == cwd / "bench-results" / "quick"


def test_an_installed_package_writes_under_the_working_directory(tmp_path: Path) -> None:
    results = tmp_path / "site-packages" / "bench" / "results"  # no pyproject.toml two levels up
    cwd = tmp_path / "work"
    assert default_out_dir(False, results, cwd) == cwd / "bench-results"


def test_conveyor_bench_takes_out_as_python_m_bench_does() -> None:
    args = cli_parser().parse_args(["bench", "overlap", "--quick", "--out", "/tmp/x"])
    assert (args.name, args.quick, args.out) == ("overlap", True, "/tmp/x")
    assert build_parser().parse_args(["overlap", "--out", "/tmp/x"]).out == Path("/tmp/x")


def test_overrides_may_follow_the_options() -> None:
    from pipeline.cli import parse_command_line

    args = parse_command_line(["replay", "rec", "--steps", "2", "train.lr=1e-5", "--verify", "run.seed=3"])
    assert (args.recording, args.steps, args.verify) == ("rec", 2, True)
    assert args.overrides == ["train.lr=1e-5", "run.seed=3"]
    assert parse_command_line(["replay", "rec", "train.lr=1e-5", "--steps", "2"]).overrides == ["train.lr=1e-5"]
    with pytest.raises(SystemExit):
        parse_command_line(["replay", "rec", "--no-such-flag"])
    with pytest.raises(SystemExit):  # bench takes no overrides
        parse_command_line(["bench", "overlap", "x=1"])


def test_gpu_e2e_rows_are_chosen_by_name_and_a_bad_one_exits_2(capsys) -> None:
    from bench.gpu_e2e import parse_systems

    assert parse_systems("colocate_in_process, trl") == ("colocate_in_process", "trl")
    assert parse_systems("async_subprocess") == ("async_subprocess",)
    with pytest.raises(SystemExit) as info:
        bench_main(["gpu_e2e", "--systems", "async,fast"])
    assert info.value.code == 2 and "--systems: expected names from" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        bench_main(["overlap", "--systems", "async"])
    assert info.value.code == 2 and "have rows to choose, not overlap" in capsys.readouterr().err


def test_gpu_e2e_rows_repeat_in_order_and_carry_their_own_overrides(capsys) -> None:
    from bench.common import result_label as file_label
    from bench.gpu_e2e import parse_systems, result_label, row_labels

    specs = parse_systems("colocate, trl, colocate[train.chunk_size=256; rollout.engine_kwargs={a: 1, b: 2}], colocate,trl")
    assert specs == ("colocate", "trl", "colocate[train.chunk_size=256;rollout.engine_kwargs={a: 1, b: 2}]", "colocate", "trl")
    labels = row_labels(specs)
    assert labels == ["colocate", "trl", specs[2], "colocate#2", "trl#2"]
    # The label names every row in order; in a file name, its first 33 characters (the
    # brackets, "=", ";" and spaces each run turned to one "_") and a hash of the whole.
    assert result_label(specs) == "-".join(specs)
    name = file_label(result_label(specs))
    assert name.startswith("colocate-trl-colocate_train.chunk-") and len(name) == 40
    assert file_label(result_label(("colocate", "trl"))) == "colocate-trl"
    assert result_label(("colocate", "trl")) != result_label(("colocate", "trl", "colocate", "trl"))
    assert result_label(("async", "sync", "colocate", "trl")) == "default"
    for bad, says in (("trl[train.lr=1]", "takes no overrides"), ("colocate[train.lr]", "overrides are key=value"),
                      ("colocate[train.lr=1", "unbalanced brackets"), ("colocate,,fast", "got 'fast'")):
        with pytest.raises(ValueError, match=says):
            parse_systems(bad)
    # An override the config refuses stops the bench before any row runs, naming the row.
    with pytest.raises(SystemExit) as info:
        bench_main(["gpu_e2e", "--systems", "trl,colocate[train.chunk_sz=64]"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "row 'colocate[train.chunk_sz=64]'" in err and "train.chunk_sz" in err


def test_gpu_e2e_checks_each_row_as_its_mode_runs_it() -> None:
    """A row's overrides go on top of its mode's: on-policy only settings pass on the
    lock-step rows and are refused on the streaming one; a colocated row that undoes its
    mode's lock-step is refused before anything runs."""
    from bench.gpu_e2e import check_rows, parse_systems
    from pipeline.config import ConfigError

    check_rows(parse_systems("colocate[rollout.logprobs=false],sync_in_process[rollout.logprobs=false],trl"))
    with pytest.raises(ConfigError, match=r"row 'async\[rollout.logprobs=false\]'.*max_staleness: expected 0"):
        check_rows(parse_systems("async[rollout.logprobs=false]"))
    with pytest.raises(ConfigError, match=r"row 'colocate\[dataflow.max_staleness=1\]'.*placement: colocate"):
        check_rows(parse_systems("colocate[dataflow.max_staleness=1]"))


def test_gpu_e2e_rates_by_spec_and_each_rows_ratio_to_its_rounds_trl_row() -> None:
    from bench.gpu_e2e import over_trl_by_round, rates_by_spec, row_labels

    specs = ("colocate", "trl", "colocate[train.chunk_size=256]", "trl", "colocate")
    rows = {label: {"spec": spec, "status": "ok", "samples_per_s_per_gpu": rate}
            for label, spec, rate in zip(row_labels(specs), specs, (200.0, 160.0, 240.0, 200.0, 180.0), strict=True)}
    assert rates_by_spec(rows) == {"colocate": [200.0, 180.0], "trl": [160.0, 200.0],
                                   "colocate[train.chunk_size=256]": [240.0]}
    # Each row against the first TRL row after it; the last colocate row, after every
    # TRL row, against the last one.
    assert over_trl_by_round(rows) == {"colocate": [200.0 / 160.0, 180.0 / 200.0],
                                       "colocate[train.chunk_size=256]": [240.0 / 200.0]}
    rows["trl#2"]["status"] = "error"
    assert over_trl_by_round(rows)["colocate[train.chunk_size=256]"] == [None]
    assert rates_by_spec(rows)["trl"] == [160.0, None]
    assert over_trl_by_round({k: v for k, v in rows.items() if not k.startswith("trl")}) == {}


@pytest.mark.parametrize("name", ["trainer_gpu", "rollout_gpu"])
def test_a_gpu_benchmark_without_a_gpu_writes_skipped_and_exits_0(tmp_path: Path, name: str, monkeypatch) -> None:
    import json

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on CPU, also where a GPU is
    assert bench_main([name, "--quick", "--out", str(tmp_path)]) == 0
    [path] = result_files(tmp_path, name)
    doc = json.loads(path.read_text())
    assert (doc["status"], doc["reason"], doc["quick"]) == ("skipped", "needs a CUDA GPU", True)
    assert doc["machine"]["cpu_count"] > 0 and doc["machine"]["gpu"] is None


def test_gpu_scale_runs_a_chosen_subset_under_its_own_name(tmp_path: Path, monkeypatch, capsys) -> None:
    """``--systems`` picks gpu_scale's configurations (one device call holds two of the
    four); an unknown one exits 2 naming the known ones, and a subset's result never
    takes the full result's name."""
    import json

    import bench.gpu_scale as scale

    assert scale.parse_configs(None) == tuple(scale.CONFIGS)
    assert scale.parse_configs(" shared_1gpu, disaggregated_2gpu") == ("shared_1gpu", "disaggregated_2gpu")
    for bad in ("shared_2gpu", " , "):
        with pytest.raises(ValueError, match="gpu_scale runs shared_1gpu, colocate_1gpu"):
            scale.parse_configs(bad)
    with pytest.raises(SystemExit) as info:
        bench_main(["gpu_scale", "--systems", "shared_1gpu,tp_2gpu"])
    assert info.value.code == 2 and "gpu_scale runs shared_1gpu" in capsys.readouterr().err
    monkeypatch.setattr(scale, "list_gpus", lambda: [])  # as on CPU: skipped, under the subset's name
    assert bench_main(["gpu_scale", "--systems", "shared_1gpu,disaggregated_2gpu", "--out", str(tmp_path)]) == 0
    [path] = result_files(tmp_path, "gpu_scale")
    assert path.name.endswith("_shared_1gpu-disaggregated_2gpu.json")
    assert json.loads(path.read_text())["status"] == "skipped"
    assert path.with_suffix(".png").exists()


def test_the_eight_gpu_benchmark_reads_nvidia_smi_and_sums_staleness(tmp_path: Path, monkeypatch) -> None:
    import json

    import bench.gpu_scale_8 as b8

    sample = b8.parse_gpu_sample("0, 97, 40960\n1, 3, 1024\nnot a gpu line\n")
    assert sample == {"0": (97.0, 40960.0), "1": (3.0, 1024.0)}
    gpus = b8.summarise_gpu_samples([sample, {"0": (53.0, 20480.0), "1": (5.0, 2048.0)}])
    assert gpus == {"0": {"busy_share": 0.75, "peak_memory_gib": 40.0}, "1": {"busy_share": 0.04, "peak_memory_gib": 2.0}}
    rows = [{"staleness/hist/0": 40, "staleness/hist/1": 24, "reward/mean": 0.1}, {"staleness/hist/1": 64}]
    assert b8.sum_staleness(rows) == {0: 40, 1: 88}
    # Fewer than four GPUs: skipped, saying why, exit 0.
    monkeypatch.setattr(b8, "list_gpus", lambda: [("0", "NVIDIA GPU (fake)")])
    assert bench_main(["gpu_scale_8", "--quick", "--out", str(tmp_path)]) == 0
    [path] = result_files(tmp_path, "gpu_scale_8")
    doc = json.loads(path.read_text())
    assert (doc["status"], doc["reason"], doc["gpus"]) == ("skipped", "needs 4 or more CUDA GPUs", 1)
