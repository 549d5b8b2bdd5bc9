"""Logging setup: JSON lines on standard error (python-json-logger), one call per process.

Every line ``serve`` writes to its log stream is one JSON object: the guard's own loggers through the root
handler set here, gunicorn's error log through :class:`webhook.serving.workers.JsonGunicornLogger` (the same
formatter), and Python warnings through the ``py.warnings`` logger (``logging.captureWarnings``).
"""

from __future__ import annotations

import logging
import sys

from pythonjsonlogger.json import JsonFormatter


def json_formatter() -> logging.Formatter:
    """The JSON line formatter: ``{"time", "level", "logger", "pid", "message"}`` plus any ``extra`` fields
    (and ``exc_info`` for a traceback, inside the same JSON line)."""
    return JsonFormatter(
        "%(asctime)s %(levelname)s %(name)s %(process)d %(message)s",
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger", "process": "pid"},
    )


def setup_logging(level: str = "info", json_format: bool = True) -> None:
    """Configure the root logger: ``level`` name (debug/info/warning/error), JSON or plain text to stderr;
    Python warnings are logged through it (``py.warnings``) instead of printed."""
    handler = logging.StreamHandler(sys.stderr)
    if json_format:
        handler.setFormatter(json_formatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.captureWarnings(True)
