"""conveyor init: templates listed, written, refused over a non-empty directory, decodable."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.config import load_config, to_dict
from pipeline.templates import describe_templates, list_templates, write_template

CONFIGS = Path(__file__).parents[2] / "configs"


def test_list_names_every_template_with_one_line(capsys):
    assert main(["init", "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == list_templates()
    assert "grpo" in list_templates()
    assert all(describe_templates().values())


@pytest.mark.parametrize("name", list_templates())
def test_each_template_writes_a_config_headed_by_its_command_that_decodes(tmp_path, name):
    target = tmp_path / name
    written = write_template(name, target)
    config = target / "config.yaml"
    assert config in written
    first = config.read_text().splitlines()[0]
    assert first == f"# cd {target} && conveyor launch --config config.yaml"
    load_config(str(config), [])  # every shipped template is a valid config


def test_non_empty_directory_is_refused_with_exit_2_unless_forced(tmp_path, capsys):
    (tmp_path / "mine.txt").write_text("keep me")
    assert main(["init", "--template", "grpo", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert not (tmp_path / "config.yaml").exists()
    assert main(["init", "--template", "grpo", str(tmp_path), "--force"]) == 0
    assert (tmp_path / "config.yaml").is_file()
    assert (tmp_path / "mine.txt").read_text() == "keep me"


def test_unknown_template_or_missing_dir_exit_2(tmp_path, capsys):
    assert main(["init", "--template", "nope", str(tmp_path / "x")]) == 2
    assert "expected one of" in capsys.readouterr().err
    assert main(["init", "--template", "grpo"]) == 2
    assert not Path(tmp_path / "x").exists()


@pytest.mark.parametrize(("name", "shipped"), [("grpo", "quickstart.yaml"), ("ppo", "ppo.yaml")])
def test_templates_that_point_at_a_shipped_config_run_the_same_job(tmp_path, name, shipped):
    # A source checkout's configs/ are not installed, so the template carries a copy: it
    # must not drift from the job it points at (run name and directory aside).
    write_template(name, tmp_path)
    ours = to_dict(load_config(str(tmp_path / "config.yaml"), []))
    theirs = to_dict(load_config(str(CONFIGS / shipped), []))
    for cfg in (ours, theirs):
        cfg.pop("run")
    assert ours == theirs
