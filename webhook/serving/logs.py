"""Logging setup: JSON lines on standard error (python-json-logger), one call per process."""

from __future__ import annotations

import logging
import sys

from pythonjsonlogger.json import JsonFormatter


def setup_logging(level: str = "info", json_format: bool = True) -> None:
    """Configure the root logger: ``level`` name (debug/info/warning/error), JSON or plain text to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    if json_format:
        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(process)d %(message)s",
                rename_fields={"asctime": "time", "levelname": "level", "name": "logger", "process": "pid"},
            )
        )
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
