"""Benchmark results: where they are written, what they record, and the generated catalogue."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import bench.common as common
from bench.catalogue import describe_host, headline, render_catalogue
from bench.common import RESULTS_DIR, hash_config, note_config, publish_result, result_files, result_label
from pipeline.config import load_config

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
NAME = re.compile(r"^\d{4}-\d{2}-\d{2}_[0-9a-f]{7}_[A-Za-z0-9_.=-]{1,40}$")


def test_the_committed_catalogue_is_the_generated_one() -> None:
    """bench/results/README.md is what ``python -m bench catalogue`` writes from the files:
    a result committed without regenerating it fails here."""
    assert (RESULTS_DIR / "README.md").read_text() == render_catalogue(RESULTS_DIR), \
        "bench/results/README.md is stale: run `python -m bench catalogue`"


def test_every_committed_result_is_named_by_date_commit_and_label_and_loads() -> None:
    jsons = sorted(RESULTS_DIR.glob("*/*.json"))
    assert jsons and not list(RESULTS_DIR.glob("*.json"))  # none left at the top
    for path in jsons:
        assert NAME.match(path.stem), path.name
        doc = json.loads(path.read_text())
        assert doc["machine"]["cpu_count"] >= 1 and "ratios" in doc, path
        assert path.with_suffix(".png").is_file(), path


def test_a_label_is_safe_for_a_file_name_and_at_most_40_characters() -> None:
    assert result_label("colocate-trl") == "colocate-trl"
    # "[", "=", ";" and " " are not kept: each run of them is one "_", an outer one dropped.
    assert result_label("colocate[train.lr=1; run.seed=2]") == "colocate_train.lr_1_run.seed_2"
    assert result_label("default", quick=True) == "quick" and result_label("trl", quick=True) == "quick-trl"
    long_a, long_b = "a" * 50, "a" * 49 + "b"
    # 33 characters of the label, "-", 6 of its sha256: 40 in all, and two labels never meet.
    assert len(result_label(long_a)) == 40 and result_label(long_a).startswith("a" * 33 + "-")
    assert result_label(long_a) != result_label(long_b)


def test_a_config_hash_ignores_the_run_directory_but_not_a_setting() -> None:
    a = load_config(QUICKSTART, ["run.dir=/tmp/one"])
    assert hash_config(a) == hash_config(load_config(QUICKSTART, ["run.dir=/tmp/two"]))
    assert hash_config(a) != hash_config(load_config(QUICKSTART, ["run.dir=/tmp/one", "train.lr=0.5"]))
    assert re.fullmatch(r"[0-9a-f]{64}", hash_config(a))


def test_a_result_records_commit_command_configs_and_machine_with_its_figure_beside(tmp_path) -> None:
    from bench.common import new_figure

    first = load_config(QUICKSTART, ["run.name=bench-a"])
    other = load_config(QUICKSTART, ["run.name=bench-a", "train.lr=0.5"])
    note_config(first)
    note_config(first)  # the same config again: one entry
    note_config(other)  # another config under a name taken: "#2"

    def plot(payload):
        fig, axes = new_figure()
        axes[0][0].plot([0, 1], [payload["ratios"]["x"], 1.0])
        return fig

    out = publish_result(tmp_path, "demo", {"quick": False, "params": {}, "ratios": {"x": 0.5}}, plot, label="a b")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    [path] = result_files(tmp_path, "demo")
    assert out["result_path"] == path and path.parent == tmp_path / "demo"
    assert path.name.endswith(f"_{commit[:7]}_a_b.json") and NAME.match(path.stem)
    assert path.with_suffix(".png").stat().st_size > 0
    doc = json.loads(path.read_text())
    prov = doc["provenance"]
    assert prov["commit"] == commit and isinstance(prov["dirty"], bool) and prov["command"] == sys.argv
    assert prov["configs"] == {"bench-a": hash_config(first), "bench-a#2": hash_config(other)}
    assert path.name.startswith(prov["utc"][:10]) and doc["label"] == "a_b" and doc["benchmark"] == "demo"
    assert {"hostname", "cpu_count", "memory_gib", "gpu", "python", "versions"} <= doc["machine"].keys()
    assert common._CONFIGS == {}  # the next result starts with none


def test_the_catalogue_shows_headlines_and_the_machine_of_old_and_new_results() -> None:
    old = {"ratios": {"device": "GPU-X", "gpus": 1, "async_over_sync": 1.23456, "efficiency": None},
           "machine": {"cpu_count": 16, "memory_gib": 125.8}}
    assert headline("overlap", old) == "async_over_sync 1.235"  # 4 significant digits; None left out
    assert describe_host(old) == "1 x GPU-X, 16 CPUs, 126 GiB"
    new = {"ratios": {}, "machine": {"cpu_count": 2, "memory_gib": 23.5, "gpu": None, "gpu_count": 0}}
    assert describe_host(new) == "2 CPUs, 24 GiB"
    assert headline("gpu_e2e", {"status": "skipped", "error": "no CUDA GPU"}) == "skipped: no CUDA GPU"


def test_gpu_scale_8_compares_with_the_newest_full_gpu_e2e_result(tmp_path) -> None:
    from bench.common import write_json
    from bench.gpu_scale_8 import one_gpu_rate

    assert one_gpu_rate(tmp_path) is None  # none yet
    import datetime as dt

    day1, day2 = dt.date(2026, 1, 2), dt.date(2026, 1, 3)
    for day, hour, stem, rate in ((day1, 10, "aaaaaaa_default", 2.0), (day1, 9, "bbbbbbb_default", 1.0),
                                  (day2, 9, "ccccccc_colocate-trl", 9.0)):
        when = dt.datetime.combine(day, dt.time(hour), dt.UTC).isoformat()
        write_json(tmp_path / "gpu_e2e" / f"{day.isoformat()}_{stem}.json",
                   {"machine": {"date": when}, "ratios": {"async_samples_per_s_per_gpu": rate}})
    # Both full results are of one day: the later one by its recorded time; a subset's is not full.
    assert one_gpu_rate(tmp_path) == 2.0


def test_a_copied_tree_names_its_commit_in_the_environment(tmp_path, monkeypatch) -> None:
    """On a lent GPU machine the working tree arrives beside a ``.git`` that is not its
    own: ``CONVEYOR_SOURCE_COMMIT`` names the commit, and the result says where it came from."""
    monkeypatch.setenv("CONVEYOR_SOURCE_COMMIT", "f" * 40)
    publish_result(tmp_path, "demo", {"quick": False, "params": {}, "ratios": {}}, lambda p: None)
    [path] = result_files(tmp_path, "demo")
    prov = json.loads(path.read_text())["provenance"]
    assert path.name.endswith("_fffffff_default.json")
    assert prov["commit"] == "f" * 40 and prov["dirty"] is None and prov["commit_from"] == "CONVEYOR_SOURCE_COMMIT"
