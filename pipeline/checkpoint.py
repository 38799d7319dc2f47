"""Resumable checkpoints: what a run needs to continue exactly once, written atomically.

A checkpoint is a directory ``<run dir>/checkpoints/step-<version>/`` holding the trainer's
state (``trainer/``: model, optimizer, RNG, version, written by the trainer engine) and
``state.msgpack`` (``ResumeState``: the ledger's counters and which prompts are done).

Guarantees:
- ``write_checkpoint`` builds the directory under a temporary name, ``state.msgpack``
  and then ``manifest.json`` (every file's size) last, fsyncs every file and the
  directory, and renames it into place in one step: a directory under a final name is
  complete. A write that fails (a full disk: ``OSError``) removes its temporary
  directory and raises, leaving the checkpoints already there as they were.
  It keeps the newest ``keep`` checkpoints and removes older ones after the new one is
  in place, so a crash at any moment leaves at least one complete checkpoint once one
  was written.
- ``find_latest_checkpoint`` returns the newest checkpoint whose state decodes, whose
  trainer state exists and whose files match its manifest (checkpoints written before
  manifests existed have none to check); a damaged, truncated or half-written one is
  skipped, with a message naming it, for the one before.
- Exactly once: ``ConsumedPrompts`` is the set of prompt indices trained or dropped (with
  a reason) up to the checkpoint, as a frontier (every index below it) plus the few
  above it. A resumed source skips exactly those, so prompts trained before the
  checkpoint are not trained again and prompts that were in flight are issued again.
- ``check_resume_config`` refuses a resumed run whose config differs from the
  original's in any key outside ``SAFE_RESUME_KEYS``, naming the keys
  (``train.num_ranks`` among them: optimizer state is saved per rank, and the trainer
  checks it against ``ResumeState.num_ranks`` again when it loads a checkpoint).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import msgspec

from pipeline.config import ConfigError
from pipeline.metrics import is_eval_row

SCHEMA_VERSION = 1
CHECKPOINTS_DIR = "checkpoints"
STATE_FILE = "state.msgpack"
MANIFEST_FILE = "manifest.json"  # {"files": {relative path: size in bytes}}, written last
TRAINER_DIR = "trainer"
# Keys a resumed run may change: how long it runs and how it reports, not what it learns.
SAFE_RESUME_KEYS = (
    "run.steps", "run.progress", "run.tensorboard", "run.trackers", "run.log_level", "run.address", "run.resume_from",
    "run.overwrite", "run.dir", "run.max_restarts", "run.auto_resume", "rollout.max_engine_restarts",
    "train.checkpoint_every", "train.keep_checkpoints", "train.weight_sync_timeout_s", "train.save_checkpoint",
    "train.on_checkpoint_error", "train.max_bad_steps",
    "record.", "placement.", "eval.",  # evaluation reads the weights, never changes them
    # Where vLLM's memory goes and how many sequences it batches, not what is learned (runs saved before the planned KV
    # cache hold kv_cache_gib: 1.0; resume them with rollout.kv_cache_gib=null).
    "rollout.kv_cache_gib", "rollout.gpu_memory_utilization", "rollout.max_model_len", "rollout.max_num_seqs",
    "rollout.compile",  # how vLLM runs the same model, not what is learned
)


class ConsumedPrompts(msgspec.Struct, kw_only=True):
    """Prompt indices that are done: every index below ``frontier`` plus ``above``."""

    frontier: int = 0
    above: list[int] = []

    def add(self, indices: Iterable[int]) -> None:
        extra = set(self.above)
        extra.update(i for i in indices if i >= self.frontier)
        while self.frontier in extra:
            extra.remove(self.frontier)
            self.frontier += 1
        self.above = sorted(extra)

    def __contains__(self, index: int) -> bool:
        return index < self.frontier or index in set(self.above)

    def as_set_checker(self) -> Callable[[int], bool]:
        """A fast membership test for a source skipping many indices."""
        frontier, above = self.frontier, frozenset(self.above)
        return lambda i: i < frontier or i in above


class ResumeState(msgspec.Struct, kw_only=True):
    """Everything beside the trainer's own state that a resumed run starts from.

    ``version``: the policy version (= optimizer steps taken); ``trained_prompts`` and
    ``dropped`` (reason -> prompts) are the ledger's counters; ``consumed`` the prompt
    indices they cover; ``recent_metrics`` the trainer's metrics of the steps since the
    previous checkpoint (the driver may not have logged them before a crash);
    ``curriculum`` the curriculum's state (``stages/data/curriculum.py``) with a
    ``data.curriculum``: the source resumes at its level, the trainer with its window.
    ``num_ranks``: the data-parallel trainer ranks that wrote it (each saved its own
    optimizer partition, so only as many ranks can load it); None in checkpoints
    written before it was recorded. ``max_staleness``: the η the last step trained
    under (``max_staleness: auto`` resumes from it); None before any step or record.
    """

    schema: int = SCHEMA_VERSION
    version: int
    trained_prompts: int
    dropped: dict[str, int] = {}
    consumed: ConsumedPrompts = msgspec.field(default_factory=ConsumedPrompts)
    recent_metrics: list[dict[str, Any]] = []
    curriculum: dict[str, Any] | None = None
    num_ranks: int | None = None
    max_staleness: int | None = None


def checkpoint_name(version: int) -> str:
    return f"step-{version:08d}"


def write_checkpoint(run_dir: Path, state: ResumeState, save_trainer: Callable[[Path], None], keep: int) -> Path:
    """Write ``<run dir>/checkpoints/step-<version>`` atomically; see the module guarantees."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(state.version)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        save_trainer(tmp / TRAINER_DIR)
        (tmp / STATE_FILE).write_bytes(msgspec.msgpack.encode(state))
        write_manifest(tmp)
        old = None
        if final.exists():  # the same version again (drops recorded since): moved aside first,
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old.", dir=root))  # removed once replaced
            os.replace(final, old / "step")
        os.rename(tmp, final)
        _fsync_dir(root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep or None]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def write_manifest(directory: Path) -> None:
    """fsync every file under ``directory`` and its folders, then write and fsync
    ``manifest.json`` listing their sizes."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        with path.open("rb") as f:  # fsync needs no write access on Linux
            os.fsync(f.fileno())
        files[path.relative_to(directory).as_posix()] = path.stat().st_size
    with (directory / MANIFEST_FILE).open("w", encoding="utf-8") as f:
        json.dump({"files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    for folder in {p.parent for p in directory.rglob("*")} | {directory}:
        _fsync_dir(folder)


def check_manifest(directory: Path) -> str | None:
    """Why ``directory``'s files do not match its manifest (a file missing or of another
    size), or None when they do or it has no manifest."""
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its {MANIFEST_FILE} is damaged ({exc})"
    for name, size in files.items():
        f = Path(directory) / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} holds {f.stat().st_size} bytes, its manifest says {size} (truncated?)"
    return None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def find_latest_checkpoint(run_dir: Path) -> tuple[Path, ResumeState, list[str]] | None:
    """(directory, state, messages about skipped damaged ones) of the newest complete
    checkpoint under ``run_dir``, or None when there is none."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    skipped: list[str] = []
    for path in sorted((p for p in root.glob("step-*") if p.is_dir()), reverse=True):
        try:
            state = msgspec.msgpack.decode((path / STATE_FILE).read_bytes(), type=ResumeState)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            skipped.append(f"{path}: skipped, its {STATE_FILE} is missing or damaged ({exc})")
            continue
        if state.schema != SCHEMA_VERSION or not (path / TRAINER_DIR).is_dir():
            skipped.append(f"{path}: skipped, schema {state.schema} or no {TRAINER_DIR}/ directory")
            continue
        damage = check_manifest(path)
        if damage is not None:
            skipped.append(f"{path}: skipped, it fails its manifest check: {damage}")
            continue
        return path, state, skipped
    return None


def load_resume_state(checkpoint: Path) -> ResumeState:
    return msgspec.msgpack.decode((Path(checkpoint) / STATE_FILE).read_bytes(), type=ResumeState)


def diff_configs(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two plain config mappings."""
    keys: list[str] = []
    for key in sorted(set(old) | set(new)):
        a, b, path = old.get(key), new.get(key), f"{prefix}{key}"
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            keys += diff_configs(a, b, f"{path}.")
        elif a != b:
            keys.append(path)
    return keys


def check_resume_config(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """The safe keys that changed; ``ConfigError`` naming the others if any changed."""
    changed = diff_configs(old, new)
    unsafe = [k for k in changed if not any(k == s or (s.endswith(".") and k.startswith(s)) for s in SAFE_RESUME_KEYS)]
    if "run.steps" in changed and (new.get("train") or {}).get("lr_scheduler", "constant") != "constant":
        unsafe.append("run.steps (the learning rate decays over run.steps)")
    if unsafe:
        raise ConfigError(
            f"--resume: the config differs from the run's own in {unsafe}; a resumed run must learn "
            f"what the original learned (keys that may change: {', '.join(SAFE_RESUME_KEYS)})"
        )
    return changed


def restore_metrics(path: Path, rows: list[dict[str, Any]]) -> int:
    """Append the rows of steps after the file's last one (the driver logs steps in
    order, so what a crash lost is a suffix); returns how many were appended."""
    last = -1
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            if not is_eval_row(row):  # an evaluation's step is a version, not a logged step
                last = max(last, int(row["step"]))
    missing = sorted((r for r in rows if int(r["step"]) > last), key=lambda r: int(r["step"]))
    if missing:
        with path.open("a", encoding="utf-8") as f:
            for row in missing:
                f.write(json.dumps({k: v for k, v in row.items() if isinstance(v, int | float)}) + "\n")
    return len(missing)


def truncate_metrics(path: Path, before_step: int) -> int:
    """Keep the rows of ``metrics.jsonl`` for steps below ``before_step`` (the resumed run
    logs the later ones again), and the evaluations of versions up to ``before_step`` (the
    checkpoint's weights and older ones); a torn line is dropped too. Returns the lines removed."""
    if not path.is_file():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and (
                row["step"] < before_step or (is_eval_row(row) and row["step"] == before_step)):
            kept.append(line if line.endswith("\n") else line + "\n")
    if len(kept) == len(lines):
        return 0
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    tmp.replace(path)
    return len(lines) - len(kept)


def reconcile_prompt_ids(issued: Mapping[str, Any], issued_count: int, done: Mapping[str, Any],
                         done_count: int) -> dict[str, Any]:
    """Compare two independent accounts of a run's prompts: the source's (every index it
    issued) and the trainer's (every index it trained or dropped with a reason).

    They reconcile when the index sets are equal and each count equals its set's size:
    a prompt issued twice or finished twice makes a count exceed its set, one lost
    leaves it in ``missing``, one finished but never issued in ``unexpected``.
    """
    a = msgspec.convert(issued, ConsumedPrompts)
    b = msgspec.convert(done, ConsumedPrompts)

    def members(s: ConsumedPrompts) -> set[int]:
        return set(range(s.frontier)) | set(s.above)

    sa, sb = members(a), members(b)
    out = {"issued": issued_count, "finished": done_count, "missing": sorted(sa - sb)[:10],
           "unexpected": sorted(sb - sa)[:10], "repeated_issue": issued_count - len(sa),
           "repeated_finish": done_count - len(sb)}
    out["reconciles"] = sa == sb and out["repeated_issue"] == 0 and out["repeated_finish"] == 0
    return out


# ---------------------------------------------------------------------------- the run dir

RUN_FILES = ("metrics.jsonl", "summary.json", CHECKPOINTS_DIR)


def prepare_run_dir(run_dir: Path, resume_from: str | None, overwrite: bool) -> None:
    """Make ``run_dir`` ready before anything is written to it.

    A fresh run refuses a directory that already holds a run (so a failed or mistaken
    launch leaves it exactly as it was) unless ``overwrite``, which clears that run's
    outputs first. Empty directories are no run: ``checkpoints/`` may be a volume of its
    own, mounted before the launch (``overwrite`` empties a mount point, never removes
    it). A resumed run keeps it and cuts ``metrics.jsonl`` back to the steps before its
    checkpoint.
    """
    run_dir = Path(run_dir)
    if resume_from:
        state = load_resume_state(resume_from)
        truncate_metrics(run_dir / "metrics.jsonl", state.version)
        restore_metrics(run_dir / "metrics.jsonl", state.recent_metrics)
        return
    existing = [name for name in RUN_FILES if _holds_output(run_dir / name)]
    if existing and not overwrite:
        raise ConfigError(
            f"run.dir: {run_dir} already holds a run ({', '.join(existing)}); continue it with "
            f"`conveyor launch --resume {run_dir}` or replace it with run.overwrite=true"
        )
    for name in (*RUN_FILES, "tensorboard", "recording", "checkpoint"):
        path = run_dir / name
        if path.is_dir() and os.path.ismount(path):  # a volume mounted for the run: emptied, kept
            for entry in path.iterdir():
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _holds_output(path: Path) -> bool:
    """A file, or a directory with something in it: an empty directory (a volume
    mounted at ``checkpoints/`` before the run) holds no run."""
    return (path.is_dir() and any(path.iterdir())) or (path.exists() and not path.is_dir())


def resolve_resume(run_dir: Path, new_config: Mapping[str, Any]) -> tuple[str, list[str], list[str]]:
    """(checkpoint to resume from, safe keys changed, skipped damaged checkpoints) for
    ``conveyor launch --resume RUN_DIR``; ``ConfigError`` when there is nothing to resume
    or the config changed in a key that matters."""
    import yaml

    run_dir = Path(run_dir)
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"--resume: {run_dir} holds no run (no config.yaml)")
    changed = check_resume_config(yaml.safe_load(saved.read_text()) or {}, new_config)
    found = find_latest_checkpoint(run_dir)
    if found is None:
        raise ConfigError(f"--resume: no complete checkpoint under {run_dir / CHECKPOINTS_DIR}")
    path, _, skipped = found
    return str(path), changed, skipped
