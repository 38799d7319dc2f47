"""structlog setup shared by the driver and every actor.

Every stage logger is bound with ``stage``; per-batch events add ``batch_id`` and
``policy_version`` so one grep follows a micro-batch through the pipeline.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging(level: str = "info") -> None:
    os.environ["CONVEYOR_LOG_LEVEL"] = level
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        # The stream is looked up per logger, not once: a replaced sys.stderr (pytest's
        # capture, a redirect) must not leave loggers writing to a closed file.
        logger_factory=lambda *_: structlog.PrintLogger(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(**bound: object) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger().bind(**bound)
