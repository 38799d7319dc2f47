"""The faults ``bench soak --faults`` injects into a running job, and how each is checked.

- ``stage``: SIGKILL of a rollout, reward or reference actor; recovered when Ray has
  restarted it (``restarts`` in ``status.json``).
- ``driver``: SIGKILL of the driver's process group (its Ray cluster and every stage),
  then ``conveyor launch --resume``; recovered at the resumed run's first step.
- ``nan``: ``NaNFault``, a node the soak's graph puts before the trainer
  (``bench/soak_flow.py``), makes one sample's reward NaN in the next micro-batch once
  its trigger file appears: that step's loss is not finite, so the trainer must not
  apply it (``actor/skipped_nonfinite`` grows) and go on; recovered at the next
  applied step.
- ``disk_full``: the run's ``checkpoints/`` fills up: a tmpfs of its own, mounted there
  before the launch and filled by a file (root only), else ``FaultInjectingDisk``
  (``bench/fault_disk.py``) failing every write there with ENOSPC. With
  ``train.on_checkpoint_error=continue`` a write fails cleanly (no partial checkpoint
  under a final name) while the run goes on; recovered at the first complete
  checkpoint after the disk is freed.
- ``ckpt_truncate``: the newest checkpoint's largest file cut to half its size while the
  driver is down (killed as ``driver``): the resume must skip it, naming it, for the one
  before; the prompts the damaged one had finished are issued and trained again, and must
  be in the final account once.
- ``engine``: SIGKILL of the rollout's vLLM engine core process
  (``rollout.engine_core=subprocess``); recovered when the rollout, having counted the
  death (``engine_restarts`` in its status), generated a micro-batch on its rebuilt
  engine (and a step followed).
Each check returns the fault's record: ``kind``, ``t_s``, ``recovered``, ``recovery_s``,
``details``.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from pipeline.checkpoint import CHECKPOINTS_DIR, TRAINER_DIR, check_manifest, find_latest_checkpoint, load_resume_state
from pipeline.types import RolloutBatch

FAULT_KINDS = ("stage", "driver", "nan", "disk_full", "ckpt_truncate", "engine")  # round one's order
DEFAULT_FAULTS = ("stage", "driver")
REPEATED = ("stage", "nan", "disk_full", "engine")  # after round one; a resume's fault happens once
FAULT_DIR_ENV = "CONVEYOR_SOAK_FAULT_DIR"  # where the triggers lie (the soak's graph reads it)
NAN_TRIGGER, NAN_DONE = "nan", "nan.done"
TMPFS_MIB = 256
ROOT = Path(__file__).resolve().parent.parent


def parse_faults(text: str) -> tuple[str, ...]:
    """``--faults``: ``all`` or a comma list of ``FAULT_KINDS``, in round one's order."""
    names = FAULT_KINDS if text.strip() == "all" else tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in FAULT_KINDS]
    if unknown or not names:
        raise ValueError(f"--faults: expected 'all' or a comma list of {', '.join(FAULT_KINDS)}, got {text!r}")
    return tuple(k for k in FAULT_KINDS if k in names)


def read_status(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def count_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def read_rows(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The whole rows of ``metrics.jsonl`` from byte ``offset``, and the offset after them."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return [], offset
    end = data.rfind(b"\n") + 1
    rows = []
    for line in data[:end].splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # the tail of a row that started before ``offset``
            continue
    return rows, offset + end


def read_last_row(path: Path, tail: int = 1 << 16) -> dict[str, Any]:
    """The last whole row of ``metrics.jsonl`` ({} when there is none)."""
    size = path.stat().st_size if path.is_file() else 0
    rows, _ = read_rows(path, max(0, size - tail))  # a row cut by the offset is skipped
    return rows[-1] if rows else {}


def stage_counter(status: dict[str, Any], stage: str, key: str) -> int:
    """``key`` of ``stage``'s status, added up over its replicas (``rollout``, ``rollout:1``)."""
    return int(sum(s.get(key) or 0 for name, s in (status.get("stages") or {}).items()
                   if name.split(":")[0] == stage and isinstance(s, dict)))


def list_complete_checkpoints(run_dir: Path) -> list[Path]:
    """The checkpoints under final names whose state decodes and whose files match their manifest."""
    out = []
    for path in sorted((Path(run_dir) / CHECKPOINTS_DIR).glob("step-*")):
        try:
            load_resume_state(path)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            continue
        if (path / TRAINER_DIR).is_dir() and check_manifest(path) is None:
            out.append(path)
    return out


def members(consumed: Any) -> set[int]:
    """The prompt indices of a ``ConsumedPrompts`` (or its plain form)."""
    frontier, above = (consumed["frontier"], consumed["above"]) if isinstance(consumed, dict) else (
        consumed.frontier, consumed.above)
    return set(range(frontier)) | set(above)


# ---------------------------------------------------------------------------- nan

class NaNFault:
    """A stage core: passes micro-batches on unchanged, but the first one after its
    ``trigger`` file appears leaves with its first sample's reward NaN (the trigger is
    removed, so once per trigger), and ``<trigger>.done`` says when and which batch."""

    takes = gives = RolloutBatch
    takes_fields = ("rewards",)
    gives_fields = ("rewards",)

    def __init__(self, trigger: str) -> None:
        self.trigger = Path(trigger)
        self.injected = 0

    async def process(self, batch: RolloutBatch) -> RolloutBatch:
        try:
            self.trigger.unlink()
        except FileNotFoundError:
            return batch
        rewards = np.array(batch.rewards, dtype=np.float32)
        rewards[0] = np.nan
        self.injected += 1
        done = self.trigger.with_name(self.trigger.name + ".done")
        tmp = done.with_suffix(".tmp")
        tmp.write_text(json.dumps({"time": time.time(), "batch_id": batch.batch_id}))
        tmp.replace(done)
        return msgspec.structs.replace(batch, rewards=rewards)

    def status(self) -> dict[str, Any]:
        return {"injected": self.injected}


# ---------------------------------------------------------------------------- disk_full

class TmpfsDisk:
    """``checkpoints/`` on a tmpfs of its own, mounted before the launch (root only);
    ``fill`` takes its every free byte with a file, ``free`` removes that file."""

    method = "tmpfs"

    def __init__(self, mount: Path) -> None:
        self.mount = mount
        self.filler = mount / ".filler"
        self.env: dict[str, str] = {}

    @classmethod
    def try_mount(cls, run_dir: Path, size_mib: int = TMPFS_MIB) -> TmpfsDisk | None:
        if os.geteuid() != 0:
            return None
        mount = Path(run_dir) / CHECKPOINTS_DIR
        mount.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(mount)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            mount.rmdir()
            return None
        return cls(mount)

    def fill(self) -> dict[str, Any]:
        chunk = 1 << 20
        buf = bytes(chunk)
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        written = 0
        try:
            while chunk:
                try:
                    written += os.write(fd, buf[:chunk])
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    chunk //= 2
        finally:
            os.close(fd)
        return {"filler_mib": round(written / (1 << 20), 1), "free_bytes": os.statvfs(self.mount).f_bavail}

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def close(self) -> None:
        self.free()
        if subprocess.run(["umount", str(self.mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(self.mount)], capture_output=True)


class ShimDisk:
    """Where no filesystem can be mounted: every process of the run starts
    ``FaultInjectingDisk`` (``bench/soak_site/sitecustomize.py``), which fails writes
    under ``checkpoints/`` with ENOSPC while the trigger file exists."""

    method = "python_shim"

    def __init__(self, run_dir: Path, fault_dir: Path) -> None:
        self.trigger = fault_dir / "disk_full"
        path = [str(ROOT / "bench" / "soak_site"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        self.env = {"PYTHONPATH": os.pathsep.join(path), "CONVEYOR_FAULT_DISK_DIR": str(Path(run_dir) / CHECKPOINTS_DIR),
                    "CONVEYOR_FAULT_DISK_TRIGGER": str(self.trigger)}

    def fill(self) -> dict[str, Any]:
        self.trigger.touch()
        return {}

    def free(self) -> None:
        self.trigger.unlink(missing_ok=True)

    def close(self) -> None:
        self.free()


def prepare_disk(run_dir: Path, fault_dir: Path) -> TmpfsDisk | ShimDisk:
    """A real small filesystem where one can be mounted, else the shim."""
    return TmpfsDisk.try_mount(run_dir) or ShimDisk(run_dir, fault_dir)


# ---------------------------------------------------------------------------- ckpt_truncate and engine

def truncate_largest_file(checkpoint: Path) -> dict[str, Any]:
    """Cut the largest file of ``checkpoint``'s trainer state to half its size."""
    files = [p for p in (checkpoint / TRAINER_DIR).rglob("*") if p.is_file()]
    victim = max(files, key=lambda p: p.stat().st_size)
    size = victim.stat().st_size
    os.truncate(victim, size // 2)
    return {"file": str(victim.relative_to(checkpoint)), "bytes_before": size, "bytes_after": size // 2}


def find_engine_core(actor_pid: int) -> Any:
    """The vLLM engine core process (``VLLM::EngineCore``) under the rollout actor, or None."""
    import psutil

    try:
        children = psutil.Process(actor_pid).children(recursive=True)
    except psutil.Error:
        return None
    for child in children:
        try:
            if "EngineCor" in child.name() or "EngineCore" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    return None


class FaultNotRecovered(RuntimeError):
    """The run did not recover from a fault in time (or ended); the message says what was missing."""


def wait_until(soak: Any, what: str, ready: Callable[[], Any], timeout: float) -> Any:
    """Poll ``ready()`` (the soak sampling meanwhile) until it is truthy; ``FaultNotRecovered``
    when the run ends or ``timeout`` passes first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not soak.job.alive():
            raise FaultNotRecovered(f"the run ended (exit {soak.job.proc.returncode}) before {what}: "
                                    f"{soak.job.tail(1500)}")
        value = ready()
        if value:
            return value
        soak.sample_when_due(2)
        time.sleep(0.5)
    raise FaultNotRecovered(f"not within {timeout:.0f}s: {what}")


def record(kind: str, t_s: float, recovery_s: float | None, **details: Any) -> dict[str, Any]:
    """A fault's entry in the result; ``recovery_s`` None: it did not recover."""
    return {"kind": kind, "t_s": t_s, "recovered": recovery_s is not None, "recovery_s": recovery_s,
            "details": details}


class Injector:
    """The faults other than ``stage`` and ``driver`` (``bench/soak.py`` kills those), on
    a running soak: ``soak.job``, ``soak.run_dir``, ``soak.t0``, ``soak.sample_when_due``
    and ``soak.resume_after_kill``."""

    def __init__(self, soak: Any, fault_dir: Path, disk: TmpfsDisk | ShimDisk | None, timeout: float) -> None:
        self.soak, self.fault_dir, self.disk, self.timeout = soak, fault_dir, disk, timeout
        # (prompts the damaged checkpoint had finished, its record): checked against the final account
        self.truncated: list[tuple[Any, dict[str, Any]]] = []

    def _status(self) -> dict[str, Any]:
        return read_status(self.soak.run_dir)

    def nan(self) -> dict[str, Any]:
        metrics = self.soak.run_dir / "metrics.jsonl"
        offset = metrics.stat().st_size
        before = int(read_last_row(metrics).get("actor/skipped_nonfinite") or 0)  # this launch's count
        done = self.fault_dir / NAN_DONE
        done.unlink(missing_ok=True)
        t = time.time()
        (self.fault_dir / NAN_TRIGGER).touch()
        injected = json.loads(wait_until(self.soak, "the NaN was injected", lambda: done.is_file() and done.read_text(),
                                          self.timeout))
        seen: list[dict[str, Any]] = []

        def applied_after_skip() -> dict[str, Any] | None:
            nonlocal offset
            new, offset = read_rows(metrics, offset)
            seen.extend(new)
            return next((r for r in seen if int(r.get("actor/skipped_nonfinite") or 0) > before), None)

        row = wait_until(self.soak, "a step applied after the non-finite one", applied_after_skip, self.timeout)
        return record("nan", t - self.soak.t0, row["time"] - injected["time"], batch_id=injected["batch_id"],
                      injected_after_s=injected["time"] - t,
                      skipped_nonfinite=int(row["actor/skipped_nonfinite"]), next_applied_step=int(row["step"]),
                      recovery_from="the NaN micro-batch's injection to the next applied step's end")

    def disk_full(self) -> dict[str, Any]:
        assert self.disk is not None
        run_dir = self.soak.run_dir
        wait_until(self.soak, "a first checkpoint", lambda: list_complete_checkpoints(run_dir), self.timeout)
        failures = stage_counter(self._status(), "trainer", "checkpoint_write_failures")
        t = time.time()
        try:
            filled = self.disk.fill()
            wait_until(self.soak, "a checkpoint write failed on the full disk",
                       lambda: stage_counter(self._status(), "trainer", "checkpoint_write_failures") > failures,
                       self.timeout)
            failed_at, steps_failed = time.time(), count_steps(run_dir)
            # The run goes on while the disk is full: a step more.
            wait_until(self.soak, "a step while the disk is full", lambda: count_steps(run_dir) > steps_failed,
                       self.timeout)
            newest_good = list_complete_checkpoints(run_dir)[-1]
            names = [p.name for p in (run_dir / CHECKPOINTS_DIR).iterdir() if p.name.startswith("step-")]
            partial = sorted(set(names) - {p.name for p in list_complete_checkpoints(run_dir)})
            steps_full = count_steps(run_dir) - steps_failed
        finally:
            self.disk.free()
        freed = time.time()
        fresh = wait_until(self.soak, "a complete checkpoint after the disk was freed",
                           lambda: [p for p in list_complete_checkpoints(run_dir) if p.name > newest_good.name],
                           self.timeout)
        recovered = time.time() - freed if not partial else None
        return record("disk_full", t - self.soak.t0, recovered, method=self.disk.method, **filled,
                     failed_write_after_s=failed_at - t, full_s=freed - t, steps_after_failure_while_full=steps_full,
                     partial_checkpoints=partial, last_good_while_full=newest_good.name, next_checkpoint=fresh[0].name,
                      recovery_from="the disk freed to the next complete checkpoint")

    def ckpt_truncate(self) -> dict[str, Any]:
        run_dir = self.soak.run_dir
        wait_until(self.soak, "two complete checkpoints", lambda: len(list_complete_checkpoints(run_dir)) >= 2,
                   self.timeout)
        damaged: dict[str, Any] = {}

        def damage() -> None:
            newest = list_complete_checkpoints(run_dir)[-1]
            state = load_resume_state(newest)
            damaged.update(path=str(newest), version=state.version, consumed=msgspec.to_builtins(state.consumed),
                           **truncate_largest_file(newest))
            found = find_latest_checkpoint(run_dir)  # what the resume must take: the one before
            assert found is not None
            damaged.update(good=found[0], good_state=found[1])

        t = time.time()
        steps_before = count_steps(run_dir)
        resumed = self.soak.resume_after_kill(damage)
        good, state = damaged["good"], damaged["good_state"]
        log = self.soak.job.tail(200_000)
        regenerated = members(damaged["consumed"]) - members(msgspec.to_builtins(state.consumed))
        details = {"damaged": damaged["path"], "damaged_version": damaged["version"], "file": damaged["file"],
                   "bytes_before": damaged["bytes_before"], "bytes_after": damaged["bytes_after"],
                   "resumed_from": str(good), "resumed_version": state.version,
                   "skip_named_in_log": f"{damaged['path']}: skipped" in log,
                   "resumed_from_in_log": f"resuming from {good}" in log,
                   "rolled_back_steps": steps_before - state.version, "regenerated_prompts": len(regenerated),
                   "resume_s": resumed - t}
        ok = details["skip_named_in_log"] and details["resumed_from_in_log"] and state.version < damaged["version"]
        out = record("ckpt_truncate", t - self.soak.t0, resumed - t if ok else None, **details,
                     recovery_from="the driver's kill to the resumed run's first step")
        self.truncated.append((damaged["consumed"], out))
        return out

    def engine(self) -> dict[str, Any]:
        status = self._status()
        actor = status["processes"]["rollout:0"][1]
        core = find_engine_core(actor)
        if core is None:
            raise FaultNotRecovered(f"no vLLM engine core process under the rollout actor (pid {actor}): "
                                    f"is rollout.engine_core subprocess?")
        before = stage_counter(status, "rollout", "engine_restarts")
        t = time.time()
        os.kill(core.pid, signal.SIGKILL)
        wait_until(self.soak, "the rollout saw its engine die",
                   lambda: stage_counter(self._status(), "rollout", "engine_restarts") > before, self.timeout)
        seen, generated = time.time(), stage_counter(self._status(), "rollout", "samples")
        # Generated since the death was seen: only the rebuilt engine can have.
        wait_until(self.soak, "a micro-batch generated by the rebuilt engine",
                   lambda: stage_counter(self._status(), "rollout", "samples") > generated, self.timeout)
        back, steps = time.time(), count_steps(self.soak.run_dir)
        wait_until(self.soak, "a step after the engine was rebuilt", lambda: count_steps(self.soak.run_dir) > steps,
                   self.timeout)
        return record("engine", t - self.soak.t0, back - t, pid=core.pid, actor_pid=actor,
                      death_seen_after_s=seen - t, next_step_after_s=time.time() - t,
                      recovery_from="the kill to the first micro-batch the rebuilt engine generated")

    def check_final(self, trainer_done: dict[str, Any] | None) -> None:
        """Each truncated checkpoint's finished prompts are in the run's final account."""
        final = members(trainer_done) if trainer_done else set()
        for consumed, out in self.truncated:
            out["details"]["damaged_prompts_in_final_account"] = bool(final) and members(consumed) <= final
            out["recovered"] = out["recovered"] and out["details"]["damaged_prompts_in_final_account"]
