"""Recording format, writer and reader (pipeline/recorder.py): round trips, verification
errors named by file, writer failures counted and never raised."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import msgspec
import numpy as np
import pytest

from pipeline.recorder import (
    RecordingError,
    RecordingReader,
    RecordingWriter,
    describe_item,
    rewrite_item,
)
from pipeline.types import (
    SCHEMA_VERSION,
    Prompt,
    PromptBatch,
    RolloutBatch,
    Span,
    StepRecord,
    WeightUpdate,
)


def make_prompts(batch_id: int, n: int = 2) -> list[Prompt]:
    return [
        Prompt(prompt_id=f"p{batch_id}-{i}", text=f"what is {i}+{batch_id}?", ground_truth=str(i + batch_id),
               data_source="arith", extra_info={"level": i}, index=i)
        for i in range(n)
    ]


def make_rollout(batch_id: int = 3, rewards: list[float] | None = None) -> RolloutBatch:
    """2 prompts x group 2 = 4 samples, prompts of 3 tokens, completions of up to 4, every
    optional field set."""
    rng = np.random.default_rng(batch_id)
    s, p, c = 4, 3, 4
    rewards = rewards if rewards is not None else [1.0, 0.0, 0.5, 0.25]
    return RolloutBatch(
        batch_id=batch_id, step=1, prompts=make_prompts(batch_id), group_size=2,
        sample_ids=[f"s{batch_id}-{i}" for i in range(s)],
        prompt_ids=rng.integers(97, 123, (s, p), dtype=np.int32),
        prompt_lens=np.full(s, p, np.int32),
        completion_ids=rng.integers(97, 123, (s, c), dtype=np.int32),
        completion_lens=np.array([4, 2, 3, 1], np.int32),
        completions=["abcd", "ef", "ghi", "j"],
        behaviour_logprobs=rng.normal(size=(s, c)).astype(np.float32),
        token_versions=np.array([[2, 2, 3, 3]] * s, np.int32),
        policy_version=2, finish_reasons=["length", "stop", "stop", "stop"],
        rewards=np.array(rewards, np.float32), reward_errors=[f"s{batch_id}-3: timeout"],
        reward_extras={"format": [1.0, 0.0, 1.0, 0.0]},
        ref_logprobs=rng.normal(size=(s, c)).astype(np.float32),
    )


def make_step(step: int = 0) -> StepRecord:
    return StepRecord(step=step, policy_version=step + 1, batch_ids=[step * 2, step * 2 + 1], loss=0.125,
                      grad_norm=2.5, weights_sha256="ab" * 32, metrics={"kl": 0.01}, rng_state=b"\x00\x01rng")


def assert_same(a: object, b: object) -> None:
    """Struct equality that compares arrays by dtype, shape and value."""
    assert type(a) is type(b)
    for name in a.__struct_fields__:  # type: ignore[attr-defined]
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            assert (x.dtype, x.shape) == (y.dtype, y.shape) and np.array_equal(x, y), name
        else:
            assert x == y, name


def record(root: Path, values: list[object], edge: str = "reward->trainer", **kw: object) -> dict:
    with RecordingWriter(root, None, **kw) as writer:
        for value in values:
            writer.write_item(edge, value)
    return writer.stats()


def item_file(root: Path, seq: int, batch_id: int, directory: str = "reward_to_trainer") -> Path:
    return root / directory / f"{seq:08d}-b{batch_id}.msgpack"


def rewrite_raw(path: Path, **header_changes: object) -> None:
    """Edit a file's header as an outsider would: plain msgpack, payload untouched."""
    doc = msgspec.msgpack.decode(path.read_bytes())
    doc["header"].update(header_changes)
    path.write_bytes(msgspec.msgpack.encode(doc))


def test_every_wire_type_round_trips(tmp_path: Path) -> None:
    prompts = PromptBatch(batch_id=7, step=2, prompts=make_prompts(7))
    rollout = make_rollout(3)
    others = [make_prompts(1)[0], WeightUpdate(version=4, sha256="cd" * 32, fingerprint=(1.5, 2.5), num_bytes=10),
              Span(stage="reward", kind="busy", start=1.0, end=2.0, batch_id=3)]
    step = make_step(5)
    config = {"run": {"name": "t"}, "train": {"lr": 3e-4}}
    with RecordingWriter(tmp_path, config, run_name="t") as writer:
        writer.write_item("source->rollout", prompts)
        writer.write_item("reward->trainer", rollout)
        for value in others:
            writer.write_item("misc->sink", value)
        writer.write_step(step)
    stats = writer.stats()
    assert (stats["written"], stats["errors"], stats["dropped"]) == (6, 0, {})

    reader = RecordingReader(tmp_path)
    assert reader.manifest["config"] == config and reader.manifest["run_name"] == "t"
    assert reader.manifest["edges"]["reward->trainer"] == "reward_to_trainer"
    assert reader.edges == ["source->rollout", "reward->trainer", "misc->sink"]
    [got_prompts] = reader.items("source->rollout")
    assert_same(got_prompts.value, prompts)
    assert (got_prompts.header.batch_id, got_prompts.header.policy_version) == (7, -1)
    assert got_prompts.header.sample_ids == ["p7-0", "p7-1"]
    [got_rollout] = reader.items("reward->trainer")
    assert_same(got_rollout.value, rollout)
    h = got_rollout.header
    assert (h.schema_version, h.kind, h.edge, h.seq, h.batch_id, h.step, h.policy_version, h.payload_type) == (
        SCHEMA_VERSION, "item", "reward->trainer", 0, 3, 1, 2, "RolloutBatch")
    assert h.sample_ids == rollout.sample_ids
    assert got_rollout.path == item_file(tmp_path, 0, 3)
    misc = list(reader.items("misc->sink"))
    assert [i.header.seq for i in misc] == [0, 1, 2]
    for got, want in zip(misc, others, strict=True):
        assert_same(got.value, want)
    assert reader.steps() == [step]
    assert len(list(reader.items())) == 5 and reader.errors == []
    index = [json.loads(line) for line in (tmp_path / "index.jsonl").read_text().splitlines()]
    assert {(r["kind"], r["edge"]) for r in index} == {
        ("item", "source->rollout"), ("item", "reward->trainer"), ("item", "misc->sink"), ("step", "")}
    assert {r["file"] for r in index if r["kind"] == "step"} == {"steps/00000005.msgpack"}


def test_checksum_detects_a_flipped_payload_byte(tmp_path: Path) -> None:
    record(tmp_path, [make_rollout(3)])
    path = item_file(tmp_path, 0, 3)
    data = bytearray(path.read_bytes())
    payload = msgspec.msgpack.decode(bytes(data))["payload"]
    data[len(data) - len(payload) // 2] ^= 0x01  # the payload is the envelope's last field
    path.write_bytes(bytes(data))
    with pytest.raises(RecordingError) as err:
        RecordingReader(tmp_path).load(path)
    assert str(err.value) == f"{path}: checksum mismatch (payload altered or corrupt)"


def test_header_edit_is_caught_by_the_index_checksum(tmp_path: Path) -> None:
    record(tmp_path, [make_rollout(3)])
    path = item_file(tmp_path, 0, 3)
    rewrite_raw(path, batch_id=99)
    with pytest.raises(RecordingError) as err:
        list(RecordingReader(tmp_path).items())
    assert str(err.value) == f"{path}: header altered (file sha256 differs from index.jsonl)"


def test_truncated_file_is_named_and_the_rest_stays_readable(tmp_path: Path) -> None:
    record(tmp_path, [make_rollout(b) for b in range(3)])
    bad = item_file(tmp_path, 1, 1)
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    with pytest.raises(RecordingError) as err:
        list(RecordingReader(tmp_path).items())
    assert str(err.value).startswith(f"{bad}: truncated or not a Conveyor recording (")

    reader = RecordingReader(tmp_path)
    assert [i.value.batch_id for i in reader.items("reward->trainer", on_error="skip")] == [0, 2]
    assert [e.path for e in reader.errors] == [str(bad)]


def test_other_schema_version_is_named(tmp_path: Path) -> None:
    record(tmp_path, [make_rollout(0), make_rollout(1)])
    path = item_file(tmp_path, 0, 0)
    rewrite_raw(path, schema_version=SCHEMA_VERSION + 1, new_field="x")
    reader = RecordingReader(tmp_path)
    with pytest.raises(RecordingError) as err:
        reader.load(path)
    assert str(err.value) == f"{path}: schema version {SCHEMA_VERSION + 1}, this build reads {SCHEMA_VERSION}"
    assert [i.value.batch_id for i in reader.items(on_error="skip")] == [1]

    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "schema_version": SCHEMA_VERSION + 1}))
    with pytest.raises(RecordingError, match=f"^{manifest}: schema version {SCHEMA_VERSION + 1}, this build"):
        RecordingReader(tmp_path)


def test_reads_with_a_truncated_or_missing_index(tmp_path: Path) -> None:
    record(tmp_path, [make_rollout(b) for b in range(3)])
    index = tmp_path / "index.jsonl"
    text = index.read_text()
    index.write_text(text[: text.index("\n") + 20])  # one whole line, then a torn one
    assert [i.value.batch_id for i in RecordingReader(tmp_path).items("reward->trainer")] == [0, 1, 2]
    index.unlink()
    reader = RecordingReader(tmp_path)
    assert [i.header.seq for i in reader.items("reward->trainer")] == [0, 1, 2] and reader.errors == []


def test_root_that_is_a_file_counts_errors_without_raising(tmp_path: Path) -> None:
    root = tmp_path / "not-a-dir"
    root.write_text("occupied")
    stats = record(root, [make_rollout(0), make_rollout(1)])
    assert stats["written"] == 0 and stats["errors"] >= 2  # both items, at least
    assert "NotADirectoryError" in stats["last_error"] or "FileExistsError" in stats["last_error"]


def test_disk_full_is_counted_and_later_writes_go_on(tmp_path: Path) -> None:
    (tmp_path / "reward_to_trainer").mkdir()
    # The first item's temporary file points at /dev/full: its write fails with ENOSPC.
    os.symlink("/dev/full", tmp_path / "reward_to_trainer" / "00000000-b0.msgpack.tmp")
    stats = record(tmp_path, [make_rollout(0), make_rollout(1)])
    assert (stats["written"], stats["errors"]) == (1, 1)
    assert "No space left on device" in stats["last_error"]
    assert not (tmp_path / "reward_to_trainer" / "00000000-b0.msgpack.tmp").exists()
    assert [i.value.batch_id for i in RecordingReader(tmp_path).items()] == [1]


def test_stalled_disk_drops_with_backlog_instead_of_blocking(tmp_path: Path) -> None:
    # The index is a FIFO nobody reads yet: the writer thread blocks on opening it after
    # the first item, exactly like a hung disk. At most one job in hand plus one queued.
    os.mkfifo(tmp_path / "index.jsonl")
    writer = RecordingWriter(tmp_path, None, max_backlog=1)
    calls = threading.Thread(target=lambda: [writer.write_item("a->b", make_rollout(b)) for b in range(5)], daemon=True)
    calls.start()
    calls.join(timeout=60)
    assert not calls.is_alive(), "write_item blocked on a stalled disk"
    fd = os.open(tmp_path / "index.jsonl", os.O_RDONLY | os.O_NONBLOCK)  # unstall the disk
    try:
        stats = writer.close()
        index_lines = os.read(fd, 1 << 16).splitlines()
    finally:
        os.close(fd)
    assert stats["dropped"]["backlog"] >= 3 and stats["errors"] == 0
    assert stats["written"] + stats["dropped"]["backlog"] == 5 and len(index_lines) == stats["written"]


def test_every_second_item_with_every_2(tmp_path: Path) -> None:
    stats = record(tmp_path, [make_rollout(b) for b in range(5)], every=2)
    assert (stats["written"], stats["skipped"]) == (3, 2)
    items = list(RecordingReader(tmp_path).items())
    assert [(i.header.seq, i.value.batch_id) for i in items] == [(0, 0), (2, 2), (4, 4)]


def test_unsupported_and_late_writes_are_dropped_with_a_reason(tmp_path: Path) -> None:
    writer = RecordingWriter(tmp_path, None)
    assert writer.write_item("a->b", object()) is False
    writer.close()
    assert writer.write_item("a->b", make_rollout(0)) is False
    assert writer.write_step(make_step()) is False
    assert writer.stats()["dropped"] == {"unsupported_type": 1, "closed": 2}


class CharTokenizer:
    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def test_describe_item_shows_ids_versions_and_rewards(tmp_path: Path) -> None:
    batch = make_rollout(3, rewards=[1.0, 0.0, 0.5, 0.25])
    record(tmp_path, [batch])
    [item] = RecordingReader(tmp_path).items()
    text = describe_item(item, tokenizer=CharTokenizer())
    # mean reward = (1 + 0 + 0.5 + 0.25) / 4 = 0.4375
    assert "rewards mean 0.4375 over 4 samples" in text
    for sid, reward in zip(batch.sample_ids, ["1", "0", "0.5", "0.25"], strict=True):
        assert f"{sid}  reward {reward}  " in text
    assert "batch_id=3" in text and "policy_version=2" in text and "token versions 2..3" in text
    assert "completion_ids" in text and "int32[4, 4]" in text
    assert "'what is 0+3?'" in text and "'ef'" in text
    decoded = "".join(chr(i) for i in batch.completion_ids[1, :2])
    assert f"ids decoded: {decoded!r}" in text


def test_rewrite_item_alters_one_reward_and_stays_verifiable(tmp_path: Path) -> None:
    record(tmp_path, [make_rollout(0), make_rollout(1)])
    path = item_file(tmp_path, 1, 1)
    old = RecordingReader(tmp_path).load(path).value
    changed = msgspec.structs.replace(old, rewards=np.array([0.0, 0.0, 0.0, 9.0], np.float32))
    rewrite_item(path, changed)
    reader = RecordingReader(tmp_path)
    items = list(reader.items())
    assert [float(r) for r in items[1].value.rewards] == [0.0, 0.0, 0.0, 9.0]
    assert_same(items[0].value, make_rollout(0))
    assert reader.errors == []
