"""configs/gsm8k_qwen2.5_0.5b.yaml decodes and resolves offline against a stand-in Hub
cache of the same layout: a tiny Qwen2-family checkpoint saved as
``Qwen/Qwen2.5-0.5B-Instruct`` and a GSM8K-shaped dataset as ``openai/gsm8k`` (its
card's two configs, one parquet file per split); nothing is downloaded."""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import ConfigError, TinyModelConfig, load_config
from pipeline.preflight import run_preflight
from stages.models.tiny import write_tiny_checkpoint
from tests.hub_cache import GSM8K_CARD, add_to_hub_cache

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "gsm8k_qwen2.5_0.5b.yaml"
ROWS = [{"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
        {"question": "What is 6 times 2?", "answer": "6*2=<<6*2=12>>12\n#### 12"}]


def _parquet(rows: list[dict]) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


def test_the_config_is_headed_by_its_command():
    assert CONFIG.read_text().splitlines()[0] == "# conveyor launch --config configs/gsm8k_qwen2.5_0.5b.yaml"


def test_the_gsm8k_config_resolves_against_a_stand_in_hub_cache(hub_cache, tmp_path, capsys):
    model_dir = tmp_path / "tiny_qwen2"
    write_tiny_checkpoint(TinyModelConfig(architecture="qwen2"), model_dir)
    model = add_to_hub_cache(hub_cache, "Qwen/Qwen2.5-0.5B-Instruct",
                             {f.name: f for f in model_dir.iterdir() if f.is_file()})
    data = add_to_hub_cache(hub_cache, "openai/gsm8k", {
        "README.md": GSM8K_CARD,
        "main/train-00000-of-00001.parquet": _parquet(ROWS),
        "main/test-00000-of-00001.parquet": _parquet(ROWS[:1]),
        "socratic/train-00000-of-00001.parquet": _parquet(ROWS[:1]),
        "socratic/test-00000-of-00001.parquet": _parquet(ROWS[:1]),
    }, kind="dataset")
    cfg = load_config(CONFIG, [f"run.dir={tmp_path / 'run'}"])
    assert (cfg.model.path, cfg.data.path, cfg.reward.function) == ("Qwen/Qwen2.5-0.5B-Instruct", "openai/gsm8k", "gsm8k")
    assert (cfg.eval.path, cfg.eval.split, cfg.eval.every) == ("openai/gsm8k", "test", 50)
    assert cfg.train.lr == 1e-6

    cfg, report = run_preflight(cfg)
    assert cfg.model.path == str(model)
    assert cfg.data.path == str(data / "main" / "train-00000-of-00001.parquet")
    assert report.reward_function == "gsm8k"
    assert report.to_summary() == {"data/rows_total": 2, "data/rows_usable": 2}  # both rows of the train split
    # The held-out set is the test split of the same repository, resolved the same way.
    assert cfg.eval.path == str(data / "main" / "test-00000-of-00001.parquet")
    assert (report.eval_data.rows_total, report.eval_data.rows_usable) == (1, 1)
    out = capsys.readouterr().out
    assert "hub: fetching model Qwen/Qwen2.5-0.5B-Instruct (revision main)" in out
    assert "hub: fetching dataset openai/gsm8k (main/train, revision main)" in out
    assert "hub: fetching dataset openai/gsm8k (main/test, revision main)" in out
    with pytest.raises(ConfigError, match=r"^eval.split: expected one of \['test', 'train'\], got 'validation'"):
        run_preflight(load_config(CONFIG, ["eval.split=validation"]))
