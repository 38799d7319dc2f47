"""Hub names: ``model.path`` / ``data.path`` given as Hugging Face Hub ids are resolved
into the Hub cache by pre-flight. Every test runs offline against a cache it builds
itself (``tests/hub_cache.py``); nothing is downloaded."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.cli import main
from pipeline.config import ConfigError, TinyModelConfig, load_config
from pipeline.hub import is_hub_id, resolve_hub_names, split_patterns
from pipeline.preflight import run_preflight
from stages.data.files import open_data
from stages.models.tiny import write_tiny_checkpoint
from tests.hub_cache import add_to_hub_cache

OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def parquet_bytes(rows: list[dict]) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    """A real tiny checkpoint's files (config, weights, tokenizer), to place in the cache."""
    out = tmp_path_factory.mktemp("tiny")
    write_tiny_checkpoint(TinyModelConfig(architecture="qwen2"), out)
    return {f.name: f for f in out.iterdir() if f.is_file()}


# Unlike tests.hub_cache.GSM8K_CARD, the socratic config has no test split: a split the
# card lacks is refused by key.
GSM8K_CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*
---
# a card
"""


def test_hub_ids_are_told_from_local_paths(tmp_path):
    (tmp_path / "org" / "local").mkdir(parents=True)
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct")
    assert is_hub_id("openai/gsm8k")
    assert not is_hub_id("tiny")  # no slash: the embedded model
    assert not is_hub_id(str(tmp_path / "org" / "local"))  # absolute path
    assert not is_hub_id("./org/name") and not is_hub_id("~/models/x") and not is_hub_id("a/b/c")
    assert not is_hub_id(None)


def test_a_model_id_resolves_to_its_cached_snapshot(hub_cache, tiny_files, capsys):
    snapshot = add_to_hub_cache(hub_cache, "acme/tiny-chat", tiny_files)
    cfg, report = run_preflight(load_config(None, ["model.path=acme/tiny-chat", "rollout.n=2"]))
    assert cfg.model.path == str(snapshot)
    assert report.model_path == str(snapshot)
    assert f"hub: model.path acme/tiny-chat -> {snapshot}" in report.describe()
    assert "hub: fetching model acme/tiny-chat (revision main)" in capsys.readouterr().out


def test_model_revision_picks_the_branch_s_commit(hub_cache, tiny_files):
    add_to_hub_cache(hub_cache, "acme/tiny-chat", tiny_files)
    other = add_to_hub_cache(hub_cache, "acme/tiny-chat", tiny_files, commit=OTHER_COMMIT, branch="v2")
    cfg, _ = resolve_hub_names(load_config(None, ["model.path=acme/tiny-chat", "model.revision=v2"]))
    assert cfg.model.path == str(other)


def test_an_uncached_id_offline_exits_2_naming_the_key(hub_cache, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": "acme/not-cached"}, "run": {"dir": str(tmp_path / "r")}}))
    assert main(["launch", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "conveyor: invalid config: model.path: model 'acme/not-cached' (revision main) is not in the " \
           "Hugging Face cache and the Hub cannot be reached" in err
    assert "hf download acme/not-cached" in err


@pytest.fixture
def gsm_like(hub_cache):
    """A dataset laid out as openai/gsm8k is: two configs named in the card, one folder each."""
    train = [{"question": "1+1?", "answer": "2\n#### 2"}, {"question": "2+2?", "answer": "#### 4"}]
    return add_to_hub_cache(hub_cache, "acme/gsm", {
        "README.md": GSM8K_CARD,
        "main/train-00000-of-00001.parquet": parquet_bytes(train),
        "main/test-00000-of-00001.parquet": parquet_bytes(train[:1]),
        "socratic/train-00000-of-00001.parquet": parquet_bytes(train[:1]),
    }, kind="dataset")


def test_a_dataset_split_is_read_from_the_card_s_configs(gsm_like):
    cfg, notes = resolve_hub_names(load_config(None, ["data.path=acme/gsm", "data.config_name=main"]))
    assert cfg.data.path == str(gsm_like / "main/train-00000-of-00001.parquet")
    assert notes == [f"hub: data.path acme/gsm (main/train) -> {cfg.data.path}"]
    cfg, _ = resolve_hub_names(load_config(None, ["data.path=acme/gsm", "data.config_name=main", "data.split=test"]))
    assert cfg.data.path == str(gsm_like / "main/test-00000-of-00001.parquet")
    assert [row for _, row in open_data(cfg.data.path).scan()] == [{"question": "1+1?", "answer": "2\n#### 2"}]


@pytest.mark.parametrize(("overrides", "expected"), [
    ([], "data.config_name: the dataset has configs ['main', 'socratic']; choose one"),
    (["data.config_name=nope"], "data.config_name: expected one of ['main', 'socratic'], got 'nope'"),
    (["data.config_name=socratic", "data.split=test"], "data.split: expected one of ['train'], got 'test'"),
])
def test_a_config_or_split_the_card_lacks_is_refused_by_key(gsm_like, overrides, expected):
    with pytest.raises(ConfigError) as err:
        resolve_hub_names(load_config(None, ["data.path=acme/gsm", *overrides]))
    assert str(err.value) == expected


def test_without_a_card_the_standard_layout_finds_the_split_s_shards(hub_cache):
    shard = [[{"prompt": f"{i}=", "ground_truth": str(i)} for i in range(j, j + 3)] for j in (0, 3)]
    snapshot = add_to_hub_cache(hub_cache, "acme/digits", {
        "data/train-00000-of-00002.parquet": parquet_bytes(shard[0]),
        "data/train-00001-of-00002.parquet": parquet_bytes(shard[1]),
        "data/test-00000-of-00001.parquet": parquet_bytes(shard[0][:1]),
    }, kind="dataset")
    cfg, _ = resolve_hub_names(load_config(None, ["data.path=acme/digits"]))
    # The two train shards' common name prefix "train-0000", then "*" and the suffix.
    assert cfg.data.path == str(snapshot / "data" / "train-0000*.parquet")
    data = open_data(cfg.data.path)
    # Rows numbered on across the shards: 1-3 in the first, 4-6 in the second.
    assert [(n, r["prompt"]) for n, r in data.scan()] == [(i + 1, f"{i}=") for i in range(6)]
    assert data.index() == 6
    seen = sorted(n for n, _ in data.iter_epoch(epoch=0, seed=3, shuffle=True))
    assert seen == [1, 2, 3, 4, 5, 6]  # every row once per epoch, shuffled


def test_a_split_with_no_file_is_refused_naming_data_split(hub_cache):
    add_to_hub_cache(hub_cache, "acme/only-train", {"train.jsonl": json.dumps({"prompt": "1="}) + "\n"},
                     kind="dataset")
    cfg, _ = resolve_hub_names(load_config(None, ["data.path=acme/only-train"]))
    assert cfg.data.path.endswith("/train.jsonl")
    with pytest.raises(ConfigError, match=r"^data.split: no data file of split 'validation' in the dataset "
                                          r"acme/only-train"):
        resolve_hub_names(load_config(None, ["data.path=acme/only-train", "data.split=validation"]))


def test_card_data_files_as_one_list_are_the_train_split():
    card = {"configs": [{"config_name": "default", "data_files": "corpus/*.jsonl"}]}
    assert split_patterns(card, "train", None) == ["corpus/*.jsonl"]
    assert split_patterns(None, "train", None) is None  # no card: the standard layouts
    with pytest.raises(ConfigError, match="data.split: expected one of \\['train'\\], got 'test'"):
        split_patterns(card, "test", None)
