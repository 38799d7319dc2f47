"""Where ``conveyor bench`` writes when no ``--out`` is given."""

from __future__ import annotations

from pathlib import Path

from bench.__main__ import build_parser, default_out_dir
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
