"""A lock file in the Prometheus multiprocess directory, so a scrape never sees half of a flushed batch.

Each serving worker writes its batched samples (:class:`webhook.serving.metrics.PendingUpdates`) one value at a time
into its own mmap'd files; the master merges those files when it is scraped. Without a lock a scrape can land
between two writes of one batch and see, for example, a request counted but not its latency. The flusher holds
an exclusive ``flock`` on ``DIR/flush.lock`` while it writes a batch, the scrape a shared one while it reads.
``flock`` locks belong to the open file: the kernel releases them when the holder dies, so a worker killed in
the middle of a flush never blocks a scrape.

This module is tiny on purpose: the master imports it without importing :mod:`webhook.serving.metrics` (which would
create the worker metrics, with zero values, in the master too).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from typing import Final

LOCK_NAME: Final = "flush.lock"
"""File name of the lock inside ``PROMETHEUS_MULTIPROC_DIR`` (not a ``*.db`` sample file, so never merged)."""


@contextlib.contextmanager
def flush_lock(directory: str | None, *, shared: bool) -> Iterator[None]:
    """Hold the batch lock of the multiprocess ``directory`` (no-op when ``directory`` is None or empty).

    ``shared=True`` for readers (a scrape), ``False`` for a writer (one worker's flush). Blocks until granted.
    Raises ``OSError`` only when the lock file cannot be created.
    """
    if not directory:
        yield
        return
    fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
