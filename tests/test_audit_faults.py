"""The audit log under faults, through the real server: its file mode, a worker killed while writing, a stalled
standard output, the file deleted or rotated under load."""

from __future__ import annotations

import os
import stat
from typing import Any


def test_the_audit_log_the_server_creates_is_0640(server_factory: Any) -> None:
    old = os.umask(0o022)
    try:
        server = server_factory()
    finally:
        os.umask(old)
    assert server.post("/mutate", b"{}").status == 400  # served: the workers have opened it too
    assert stat.S_IMODE(server.audit_log.stat().st_mode) == 0o640
