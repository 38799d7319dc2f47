"""structlog setup shared by the driver and every actor.

Every stage logger is bound with ``stage``; per-batch events add ``batch_id`` and
``policy_version`` so one grep follows a micro-batch through the pipeline.

A stage of a launched run writes everything it prints (its own log, its libraries',
its engine processes') to ``RUN_DIR/logs/<stage>.log`` (``redirect_process_output``);
only its warnings and errors also reach the console (``console_fd``).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _TeeLogger:
    """structlog's ``PrintLogger`` that also writes warnings and errors to ``console_fd``."""

    def __init__(self, console_fd: int) -> None:
        self._console = console_fd

    def msg(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def _tee(self, message: str) -> None:
        self.msg(message)
        try:
            os.write(self._console, (message + "\n").encode())
        except OSError:  # the console went away; the log file has it
            pass

    log = debug = info = msg
    warn = warning = error = err = critical = fatal = exception = _tee


def redirect_process_output(path: Path) -> int:
    """Point this process's stdout and stderr (descriptors 1 and 2, so Python, native
    libraries and child processes alike) at ``path``, appended to; returns a descriptor
    of the former stderr for what the console must still see."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    console = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return console


def configure_logging(level: str = "info", console_fd: int | None = None) -> None:
    """``console_fd``: also write warnings and errors there (see the module doc)."""
    os.environ["CONVEYOR_LOG_LEVEL"] = level
    factory = (lambda *_: structlog.PrintLogger(file=sys.stderr)) if console_fd is None else (
        lambda *_: _TeeLogger(console_fd))
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        # The stream is looked up per logger, not once: a replaced sys.stderr (pytest's
        # capture, a redirect) must not leave loggers writing to a closed file.
        logger_factory=factory,
        cache_logger_on_first_use=False,
    )


def get_logger(**bound: object) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger().bind(**bound)
