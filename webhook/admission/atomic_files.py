"""Files written whole or not at all: a temporary file in the same directory, fsync, then rename or link.

Used for the certificate directory (:mod:`webhook.serving.dev_certs`, :mod:`webhook.serving.cert_rotation`) and the
state key file (:mod:`webhook.admission.state_key`). A reader sees either the old or the new content of a file, never a
mix. Pure: imports nothing from the package, Flask, kubernetes or prometheus_client.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Replace ``path`` with ``data`` (mode ``mode``, umask ignored): temp file in the dir, fsync, rename."""
    tmp = write_temp(path, data, mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def write_temp(path: Path, data: bytes, mode: int) -> str:
    """Write ``data`` to a new temporary file beside ``path`` (mode ``mode``, fsynced); returns its name."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            os.fchmod(file.fileno(), mode)
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def fsync_dir(directory: Path) -> None:
    """Make a rename or link in ``directory`` durable; a file system that cannot sync a directory is skipped."""
    with contextlib.suppress(OSError):  # not every file system lets a directory be opened or synced
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def create_exclusive(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` with ``data`` complete or not at all; an existing file (a racing writer's) wins."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = write_temp(path, data, mode)
    try:
        os.link(tmp, path)  # atomic, and fails when the file exists
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    fsync_dir(path.parent)
