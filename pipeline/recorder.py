"""Record and replay of queued values: the on-disk format, its writer and its reader.

A recording (``record.dir``, default ``<run dir>/recording``) holds a ``manifest.json``,
an ``index.jsonl``, one msgpack file per value tapped from a DataFlow edge and one
``StepRecord`` per optimizer step; each file is ``{"header", "payload"}`` with the
payload's sha256 in the header. Layout: docs/architecture.md, "Recorder".

Guarantees:
- opening a recording never runs code: msgspec decodes plain msgpack into typed Structs;
- every file read is checked (schema version, payload checksum, decodability, the
  index's whole-file sha256); a failure is a ``RecordingError`` "<file>: <what is
  wrong>", or with ``on_error="skip"`` lands in ``reader.errors``; a lost index only
  costs a directory scan;
- ``write_item``/``write_step`` never raise and never wait beyond a short lock: a full
  backlog drops the write and counts it, so a slow disk costs completeness, never
  throughput, and ``stats()`` says what was missed;
- a file appears under its final name only complete (no fsync); one writer per directory.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import hashlib
import json
import os
import queue
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple, Self

import msgspec
import numpy as np

from pipeline.log import get_logger
from pipeline.types import SCHEMA_VERSION, WIRE_TYPES, PromptBatch, RolloutBatch, StepRecord, decode, encode

FORMAT = "conveyor-recording"
MANIFEST = "manifest.json"
INDEX = "index.jsonl"
STEPS_DIR = "steps"
OnError = Literal["raise", "skip"]

log = get_logger(stage="recorder")


class RecordingError(ValueError):
    """One recording file is unusable; ``str(err)`` is "<file>: <what is wrong>"."""

    def __init__(self, path: str | Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason


class ItemHeader(msgspec.Struct, frozen=True, kw_only=True):
    """Describes one recorded file without decoding its payload. ``payload_type`` is a key
    of ``WIRE_TYPES``; ``payload_sha256``/``payload_bytes`` are those of the stored payload.
    Fields a value lacks are -1 (``batch_id`` of a StepRecord, ``policy_version`` of a
    PromptBatch); ``edge`` is "" for steps."""

    schema_version: int
    kind: Literal["item", "step"]
    edge: str
    seq: int
    batch_id: int
    step: int
    policy_version: int
    sample_ids: list[str]
    payload_type: str
    payload_sha256: str
    payload_bytes: int


class _Envelope(msgspec.Struct, frozen=True):
    header: ItemHeader
    payload: bytes


_envelope_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)


@dataclass(frozen=True)
class RecordedItem:
    """One verified file: its header, the decoded wire value and where it was read."""

    header: ItemHeader
    value: Any
    path: Path


def sanitise_edge(edge: str) -> str:
    """"reward->trainer" -> "reward_to_trainer": a directory name safe on any filesystem."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", edge.replace("->", "_to_")).lstrip(".")
    return name or "edge"


def extract_header_fields(value: Any) -> dict[str, Any]:
    """The header fields a wire value supplies itself; raises TypeError for a non-wire value."""
    name = type(value).__name__
    if WIRE_TYPES.get(name) is not type(value):
        raise TypeError(f"{name} is not a wire type (record the resolved value, not an ObjectRef)")
    ids = getattr(value, "sample_ids", None)
    if ids is None:
        ids = [value.prompt_id] if hasattr(value, "prompt_id") else []
    return {
        "batch_id": int(getattr(value, "batch_id", -1)),
        "step": int(getattr(value, "step", -1)),
        "policy_version": int(getattr(value, "policy_version", getattr(value, "version", -1))),
        "sample_ids": list(ids),
        "payload_type": name,
    }


def pack_record(*, kind: str, edge: str, seq: int, fields: dict[str, Any], payload: bytes) -> tuple[ItemHeader, bytes]:
    """Header (with the payload checksum) and the file bytes for one encoded value."""
    header = ItemHeader(
        schema_version=SCHEMA_VERSION, kind=kind, edge=edge, seq=seq, **fields,  # type: ignore[arg-type]
        payload_sha256=hashlib.sha256(payload).hexdigest(), payload_bytes=len(payload),
    )
    return header, _envelope_encoder.encode(_Envelope(header=header, payload=payload))


def _version_error(path: Path, version: object) -> RecordingError:
    return RecordingError(path, f"schema version {version}, this build reads {SCHEMA_VERSION}")


def _unpack(path: Path, data: bytes) -> _Envelope:
    try:
        env = _envelope_decoder.decode(data)
    except msgspec.DecodeError as exc:
        # A file of another version may no longer fit ``ItemHeader``: read its version
        # untyped, so it gets the version error rather than "not a recording".
        try:
            version = msgspec.msgpack.decode(data)["header"]["schema_version"]
        except Exception:
            version = SCHEMA_VERSION
        if version != SCHEMA_VERSION:
            raise _version_error(path, version) from None
        raise RecordingError(path, f"truncated or not a Conveyor recording ({exc})") from None
    if env.header.schema_version != SCHEMA_VERSION:
        raise _version_error(path, env.header.schema_version)
    return env


def read_record(path: str | Path, expected_sha256: str | None = None) -> RecordedItem:
    """Read and verify one file; ``expected_sha256`` is the whole file's, from the index."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise RecordingError(path, f"unreadable ({exc.strerror or exc})") from None
    env = _unpack(path, data)
    header = env.header
    if len(env.payload) != header.payload_bytes or hashlib.sha256(env.payload).hexdigest() != header.payload_sha256:
        raise RecordingError(path, "checksum mismatch (payload altered or corrupt)")
    typ = WIRE_TYPES.get(header.payload_type)
    if typ is None:
        raise RecordingError(path, f"unknown payload type {header.payload_type!r}")
    try:
        value = decode(env.payload, typ)
    except Exception as exc:
        raise RecordingError(path, f"payload does not decode as {header.payload_type} ({exc})") from None
    if expected_sha256 is not None and hashlib.sha256(data).hexdigest() != expected_sha256:
        raise RecordingError(path, "header altered (file sha256 differs from index.jsonl)")
    return RecordedItem(header=header, value=value, path=path)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------- writer

class _Job(NamedTuple):
    kind: str
    edge: str
    seq: int
    file: str  # relative to the recording root
    fields: dict[str, Any]
    payload: bytes


class RecordingWriter:
    """Taps wire values to a recording without blocking or failing the pipeline.

    Call ``write_item(edge, value)`` from a stage's event loop (the resolved value, not
    its ObjectRef), ``write_step(record)`` once per optimizer step, ``close()`` at the end.
    ``every`` applies to items only: every step is recorded, since replay verifies steps.
    """

    _LOG_EVERY = 100  # a full disk fails every write: log the first and every 100th

    def __init__(
        self, root: str | Path, config_snapshot: dict[str, Any] | None = None, every: int = 1, *,
        run_name: str = "", edges: Sequence[str] = (), max_backlog: int = 64,
        max_backlog_bytes: int = 256 << 20,
    ) -> None:
        if every < 1 or max_backlog < 1:
            raise ValueError(f"every and max_backlog must be >= 1, got {every} and {max_backlog}")
        self.root = Path(root)
        self.every = every
        self._config = dict(config_snapshot or {})
        self._run_name = run_name
        self._created = _now()
        self._max_bytes = max_backlog_bytes
        self._lock = threading.Lock()  # guards everything below that both threads touch
        self._edge_dirs: dict[str, str] = {}
        self._seen: collections.Counter[str] = collections.Counter()
        self._steps = 0
        self._pending_bytes = 0
        self._closed = False
        self._counts = {"written": 0, "bytes": 0, "skipped": 0, "errors": 0}
        self._dropped: collections.Counter[str] = collections.Counter()
        self._last_error: str | None = None
        for edge in edges:
            self._assign_dir(edge)
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=max_backlog)
        # Writer-thread state only.
        self._index: Any = None
        self._index_torn = False
        self._made_dirs: set[Path] = set()
        self._manifest_edges = -1
        self._thread = threading.Thread(target=self._run, name=f"recorder-{self.root.name}", daemon=True)
        self._thread.start()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write_item(self, edge: str, value: Any) -> bool:
        """Queue ``value`` seen on ``edge`` (e.g. "reward->trainer"); True if queued."""
        with self._lock:
            seq = self._seen[edge]
            self._seen[edge] += 1
            if seq % self.every:
                self._counts["skipped"] += 1
                return False
            if edge not in self._edge_dirs:
                self._assign_dir(edge)
            directory = self._edge_dirs[edge]
        job = self._encode("item", edge, seq, value, lambda f: f"{directory}/{seq:08d}-b{f['batch_id']}.msgpack")
        return job is not None and self._submit(job)

    def write_step(self, record: StepRecord) -> bool:
        """Queue one optimizer step's ``StepRecord``; True if queued."""
        with self._lock:
            seq = self._steps
            self._steps += 1
        job = self._encode("step", "", seq, record, lambda f: f"{STEPS_DIR}/{f['step']:08d}.msgpack")
        return job is not None and self._submit(job)

    def stats(self) -> dict[str, Any]:
        """written/bytes (files and their bytes on disk), skipped (by ``every``), dropped by
        reason (backlog, closed, unsupported_type, encode_error), errors, last_error, backlog."""
        with self._lock:
            return {**self._counts, "dropped": dict(self._dropped), "last_error": self._last_error,
                    "backlog": self._queue.qsize(), "backlog_bytes": self._pending_bytes}

    def flush(self) -> None:
        """Wait until everything queued so far is on disk (blocks: not for the hot path)."""
        self._queue.join()

    def close(self, timeout: float | None = None) -> dict[str, Any]:
        """Write what is queued, finish the manifest, stop the thread; returns ``stats()``.
        The thread is a daemon: a writer never closed loses what is queued at exit."""
        with self._lock:
            first = not self._closed
            self._closed = True
        if first:
            self._queue.put(None)
        self._thread.join(timeout)
        return self.stats()

    # -- caller side

    def _assign_dir(self, edge: str) -> None:
        base = sanitise_edge(edge)
        used = {*self._edge_dirs.values(), STEPS_DIR}
        name, n = base, 2
        while name in used:  # "a->b" and "a_to_b" sanitise alike: keep them apart
            name, n = f"{base}-{n}", n + 1
        self._edge_dirs[edge] = name

    def _encode(self, kind: str, edge: str, seq: int, value: Any, name_file: Any) -> _Job | None:
        try:
            fields = extract_header_fields(value)
        except TypeError as exc:
            self._drop("unsupported_type", edge=edge, error=str(exc))
            return None
        try:
            payload = encode(value)
        except Exception as exc:
            self._drop("encode_error", edge=edge, batch_id=fields["batch_id"], error=str(exc))
            return None
        return _Job(kind, edge, seq, name_file(fields), fields, payload)

    def _submit(self, job: _Job) -> bool:
        size = len(job.payload)
        with self._lock:
            if self._closed:
                reason = "closed"
            # An item larger than the whole byte budget still goes when nothing is pending.
            elif self._pending_bytes and self._pending_bytes + size > self._max_bytes:
                reason = "backlog"
            else:
                try:
                    self._queue.put_nowait(job)
                except queue.Full:
                    reason = "backlog"
                else:
                    self._pending_bytes += size
                    return True
        self._drop(reason, edge=job.edge, batch_id=job.fields["batch_id"], seq=job.seq)
        return False

    def _drop(self, reason: str, **kw: Any) -> None:
        with self._lock:
            self._dropped[reason] += 1
            n = self._dropped[reason]
        if n == 1 or n % self._LOG_EVERY == 0:
            log.warning("recording dropped a write", reason=reason, dropped=n, **kw)

    # -- writer thread

    def _run(self) -> None:
        self._guarded(self._write_manifest, None)
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    break
                self._guarded(self._write_job, job)
            finally:
                if job is not None:
                    with self._lock:
                        self._pending_bytes -= len(job.payload)
                self._queue.task_done()
        self._guarded(self._write_manifest, self.stats())
        if self._index is not None:
            with contextlib.suppress(OSError):
                self._index.close()

    def _guarded(self, fn: Any, arg: Any) -> None:
        try:
            fn(arg)
        except Exception as exc:
            with self._lock:
                self._counts["errors"] += 1
                self._last_error = f"{type(exc).__name__}: {exc}"
                n = self._counts["errors"]
            if n == 1 or n % self._LOG_EVERY == 0:
                what = arg.file if isinstance(arg, _Job) else MANIFEST
                log.warning("recording write failed", file=what, error=str(exc), errors=n)

    def _write_manifest(self, final_stats: dict[str, Any] | None) -> None:
        with self._lock:
            edges = dict(self._edge_dirs)
        self._manifest_edges = len(edges)  # set first: a failing disk is retried once per change
        doc = {"format": FORMAT, "schema_version": SCHEMA_VERSION, "created": self._created,
               "run_name": self._run_name, "every": self.every, "edges": edges, "config": self._config}
        if final_stats is not None:
            doc.update(closed=_now(), stats=final_stats)
        self.root.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.root / MANIFEST, json.dumps(doc, indent=2, default=str).encode())

    def _write_job(self, job: _Job) -> None:
        with self._lock:
            edges_changed = len(self._edge_dirs) != self._manifest_edges
        if edges_changed:
            self._guarded(self._write_manifest, None)
        header, data = pack_record(kind=job.kind, edge=job.edge, seq=job.seq, fields=job.fields, payload=job.payload)
        path = self.root / job.file
        if path.parent not in self._made_dirs:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._made_dirs.add(path.parent)
        _write_atomic(path, data)
        with self._lock:
            self._counts["written"] += 1
            self._counts["bytes"] += len(data)
        line = {"kind": job.kind, "edge": job.edge, "seq": job.seq, "batch_id": header.batch_id,
                "step": header.step, "policy_version": header.policy_version, "file": job.file,
                "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        self._append_index(json.dumps(line).encode() + b"\n")

    def _append_index(self, line: bytes) -> None:
        if self._index is None:
            self._index = open(self.root / INDEX, "ab", buffering=0)
        if self._index_torn:  # a failed append may have left half a line: start a fresh one
            line = b"\n" + line
        self._index_torn = True
        view = memoryview(line)
        while view:
            view = view[self._index.write(view):]
        self._index_torn = False


# ---------------------------------------------------------------------------- reader

_FILE_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]*/(-?\d+)[^/]*\.msgpack$")


class _Entry(NamedTuple):
    kind: str
    edge: str | None  # None: a scanned file in a directory the manifest does not name
    seq: int
    file: str
    sha256: str | None


class RecordingReader:
    """Reads a recording, verifying every file it returns (see the module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise RecordingError(self.root, "not a directory (no recording here)")
        self.errors: list[RecordingError] = []
        self.manifest: dict[str, Any] = self._read_manifest()
        self._entries = self._list_entries()
        if not self.manifest and not self._entries:
            raise RecordingError(self.root, "not a Conveyor recording (no manifest, index or item files)")

    @property
    def edges(self) -> list[str]:
        """Recorded edges: the manifest's order, then any the index adds."""
        return list(self._edge_rank)

    def items(self, edge: str | None = None, on_error: OnError = "raise") -> Iterator[RecordedItem]:
        """Items of ``edge`` (all edges, one after another, when None) in seq order."""
        self._check_on_error(on_error)
        rank = self._edge_rank
        entries = [e for e in self._entries.values() if e.kind == "item" and (edge is None or e.edge in (edge, None))]
        entries.sort(key=lambda e: (rank.get(e.edge, len(rank)), e.file.split("/")[0], e.seq, e.file))
        for entry in entries:
            item = self._load_entry(entry, on_error)
            if item is not None and (edge is None or item.header.edge == edge):
                yield item

    def steps(self, on_error: OnError = "raise") -> list[StepRecord]:
        """Every recorded ``StepRecord``, by step."""
        self._check_on_error(on_error)
        out = []
        for entry in sorted((e for e in self._entries.values() if e.kind == "step"), key=lambda e: (e.seq, e.file)):
            item = self._load_entry(entry, on_error)
            if item is not None:
                out.append(item.value)
        return sorted(out, key=lambda r: r.step)

    def load(self, path: str | Path) -> RecordedItem:
        """Read and verify one file (against the index's sha256 when it lists the file)."""
        path = Path(path)
        try:
            entry = self._entries.get(path.resolve().relative_to(self.root.resolve()).as_posix())
        except ValueError:  # outside this recording: no index entry to check against
            entry = None
        return read_record(path, entry.sha256 if entry else None)

    # -- internals

    @staticmethod
    def _check_on_error(on_error: str) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error: expected 'raise' or 'skip', got {on_error!r}")

    def _load_entry(self, entry: _Entry, on_error: OnError) -> RecordedItem | None:
        try:
            item = self.load(self.root / entry.file)
            if entry.kind == "step" and not isinstance(item.value, StepRecord):
                raise RecordingError(item.path, f"holds a {item.header.payload_type}, expected a StepRecord")
            return item
        except RecordingError as err:
            if on_error == "raise":
                raise
            if all(str(e) != str(err) for e in self.errors):
                self.errors.append(err)
                log.warning("recording file skipped", error=str(err))
            return None

    def _read_manifest(self) -> dict[str, Any]:
        path = self.root / MANIFEST
        try:
            doc = json.loads(path.read_bytes())
            if not isinstance(doc, dict) or doc.get("format") != FORMAT:
                raise ValueError(f"format is not {FORMAT!r}")
        except FileNotFoundError:
            self.errors.append(RecordingError(path, "missing; edges taken from the index and the files"))
            return {}
        except (OSError, ValueError) as exc:
            self.errors.append(RecordingError(path, f"unreadable ({exc}); edges taken from the index and the files"))
            return {}
        if doc.get("schema_version") != SCHEMA_VERSION:
            raise _version_error(path, doc.get("schema_version"))
        return doc

    def _list_entries(self) -> dict[str, _Entry]:
        entries: dict[str, _Entry] = {}
        try:
            lines = (self.root / INDEX).read_bytes().splitlines()
        except OSError:
            lines = []
        bad = 0
        for line in lines:
            try:
                rec = json.loads(line)
                entry = _Entry(
                    str(rec["kind"]), str(rec["edge"]), int(rec["seq"]), str(rec["file"]), str(rec["sha256"])
                )
                if entry.kind not in ("item", "step") or not _FILE_RE.match(entry.file):
                    raise ValueError(entry.file)  # never follow an index outside the recording
            except (ValueError, KeyError, TypeError):
                bad += 1
                continue
            entries[entry.file] = entry  # a later line (rewrite_item) wins
        if bad:
            log.info("index lines unreadable; the directory scan covers their files", lines=bad)
        dir_edges = {d: e for e, d in self.manifest.get("edges", {}).items()}
        for sub in sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            for f in sorted(sub.glob("*.msgpack")):
                rel = f"{sub.name}/{f.name}"
                m = _FILE_RE.match(rel)
                if rel in entries or not m:
                    continue
                kind = "step" if sub.name == STEPS_DIR else "item"
                edge = "" if kind == "step" else dir_edges.get(sub.name)
                entries[rel] = _Entry(kind, edge, int(m.group(1)), rel, None)
        self._edge_rank: dict[str | None, int] = {}
        for edge in [*self.manifest.get("edges", {}), *(e.edge for e in entries.values() if e.kind == "item")]:
            if edge is not None:
                self._edge_rank.setdefault(edge, len(self._edge_rank))
        return entries


def rewrite_item(path: str | Path, value: Any) -> ItemHeader:
    """Replace the value in one recorded file with a fresh checksum, keeping kind, edge and
    seq, and update its index line. A debugging tool: alter one reward, then replay. The
    file keeps its name even if ``value`` has another batch id; the header is authoritative."""
    path = Path(path)
    try:
        old = _unpack(path, path.read_bytes()).header
    except OSError as exc:
        raise RecordingError(path, f"unreadable ({exc.strerror or exc})") from None
    header, data = pack_record(kind=old.kind, edge=old.edge, seq=old.seq,
                               fields=extract_header_fields(value), payload=encode(value))
    _write_atomic(path, data)
    index = path.parent.parent / INDEX
    if index.is_file():
        rel = f"{path.parent.name}/{path.name}"
        lines = []
        for line in index.read_bytes().splitlines():
            with contextlib.suppress(ValueError, TypeError):
                rec = json.loads(line)
                if rec.get("file") == rel:
                    rec.update(batch_id=header.batch_id, step=header.step, policy_version=header.policy_version,
                               sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
                    line = json.dumps(rec).encode()
            lines.append(line)
        _write_atomic(index, b"".join(ln + b"\n" for ln in lines))
    return header


# --------------------------------------------------------------------------- inspect

def _clip(text: str, max_chars: int) -> str:
    return repr(text if len(text) <= max_chars else text[:max_chars] + "...")


def _decode_ids(tokenizer: Any, ids: np.ndarray) -> str:
    return str(tokenizer.decode([int(t) for t in ids]))


def describe_item(item: RecordedItem | Any, tokenizer: Any = None, *, max_chars: int = 200) -> str:
    """Text for ``conveyor replay --inspect``: ids, versions, step, array shapes, rewards
    (mean and per sample) and each sample's text; with a tokenizer, the ids decoded too."""
    value, lines = item, []
    if isinstance(item, RecordedItem):
        h, value = item.header, item.value
        lines.append(f"file {item.path}  kind {h.kind}  edge {h.edge or '-'}  seq {h.seq}  "
                     f"payload {h.payload_type} {h.payload_bytes} B sha256 {h.payload_sha256[:16]}")
    fields = msgspec.structs.asdict(value) if isinstance(value, msgspec.Struct) else {}
    scalars = "  ".join(f"{k}={v}" for k, v in fields.items() if isinstance(v, (int, float, str)) and k != "rng_state")
    lines.append(f"{type(value).__name__}  {scalars}")
    lines += [f"  {k:<20} {v.dtype}{list(v.shape)}" for k, v in fields.items() if isinstance(v, np.ndarray)]
    if isinstance(value, RolloutBatch):
        lines += _describe_rollout(value, tokenizer, max_chars)
    elif isinstance(value, PromptBatch):
        lines += [f"  {p.prompt_id}  {_clip(p.text, max_chars)}  truth {p.ground_truth!r}" for p in value.prompts]
    elif isinstance(value, StepRecord):
        lines.append(f"  batch_ids {value.batch_ids}  rng_state {len(value.rng_state)} B  metrics {value.metrics}")
    elif not fields:
        lines.append(f"  {value!r}")
    return "\n".join(lines)


def _describe_rollout(b: RolloutBatch, tokenizer: Any, max_chars: int) -> list[str]:
    lines = [f"  samples {b.num_samples}  prompts {len(b.prompts)}  tokens {b.num_tokens}"]
    lens = b.completion_lens
    valid = np.arange(b.token_versions.shape[1]) < lens[:, None]
    if valid.any():
        versions = b.token_versions[valid]
        lines.append(f"  token versions {int(versions.min())}..{int(versions.max())}")
    if b.rewards is not None:
        lines.append(f"  rewards mean {float(np.mean(b.rewards)):.4g} over {len(b.rewards)} samples")
    lines += [f"  reward error: {e}" for e in b.reward_errors]
    for i, sid in enumerate(b.sample_ids):
        g = i // b.group_size
        if i % b.group_size == 0 and g < len(b.prompts):
            p = b.prompts[g]
            lines.append(f"  prompt {p.prompt_id}: {_clip(p.text, max_chars)}")
            if tokenizer is not None:
                ids = b.prompt_ids[i, : b.prompt_lens[i]]
                lines.append(f"    prompt ids decoded: {_clip(_decode_ids(tokenizer, ids), max_chars)}")
        parts = [f"    {sid}"]
        if b.rewards is not None:
            parts.append(f"reward {float(b.rewards[i]):.4g}")
        parts += [f"{k} {float(v[i]):.4g}" for k, v in b.reward_extras.items() if i < len(v)]
        parts.append(f"{int(lens[i])} tokens")
        if i < len(b.finish_reasons):
            parts.append(b.finish_reasons[i])
        if valid[i].any():
            tv = b.token_versions[i][valid[i]]
            parts.append(f"v{int(tv.min())}" + (f"..{int(tv.max())}" if tv.max() != tv.min() else ""))
        if i < len(b.completions):
            parts.append(_clip(b.completions[i], max_chars))
        lines.append("  ".join(parts))
        if tokenizer is not None:
            text = _decode_ids(tokenizer, b.completion_ids[i, : lens[i]])
            lines.append(f"      ids decoded: {_clip(text, max_chars)}")
    return lines
