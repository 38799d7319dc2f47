"""``FaultInjectingDisk``: a full disk under one directory, for a soak where no small
filesystem can be mounted (``bench soak --faults disk_full`` without root).

While its trigger file exists, a file opened for writing under the directory (by
``open``, ``io.open`` or ``pathlib``, which is how checkpoints, their manifests and,
through ``stages.trainer.engine.save_state_file``, DeepSpeed's state files are written)
is created empty and fails its first write with ``OSError(ENOSPC)``, as a full disk
does. Other paths, reads, and everything while the trigger is absent are untouched.
``bench/soak_site/sitecustomize.py`` installs it in every Python process of a run
whose environment names the directory and the trigger. Standard library only: it loads
before anything else in the process.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
from typing import Any

DIR_ENV, TRIGGER_ENV = "CONVEYOR_FAULT_DISK_DIR", "CONVEYOR_FAULT_DISK_TRIGGER"


class _FullFile:
    """A file on a full disk: what it holds stays as written so far, the next write fails."""

    def __init__(self, file: Any) -> None:
        self._file = file

    def write(self, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), getattr(self._file, "name", None))

    def __enter__(self) -> _FullFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._file.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


class FaultInjectingDisk:
    def __init__(self, directory: str, trigger: str, opener: Any = io.open) -> None:
        self.directory = os.path.abspath(directory) + os.sep
        self.trigger = trigger
        self._open = opener

    def is_full(self, file: Any) -> bool:
        if not isinstance(file, str | bytes | os.PathLike):
            return False
        path = os.path.abspath(os.fsdecode(file))
        return path.startswith(self.directory) and os.path.exists(self.trigger)

    def open(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = self._open(file, mode, *args, **kwargs)
        if any(c in mode for c in "wax+") and self.is_full(file):
            return _FullFile(f)
        return f


def install(environ: Any = os.environ) -> FaultInjectingDisk | None:
    """Replace ``open`` in this process when ``environ`` names a directory and a trigger."""
    directory, trigger = environ.get(DIR_ENV), environ.get(TRIGGER_ENV)
    if not directory or not trigger:
        return None
    disk = FaultInjectingDisk(directory, trigger)
    builtins.open = io.open = disk.open
    return disk
