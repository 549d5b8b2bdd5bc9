"""The guard's audit log: one JSON line per decision and change, written whole, never dropped silently.

The records and their line encoding are built by :mod:`webhook.admission.audit_records` (pure); this module writes them.

Several gunicorn worker processes append to the same file or pipe, and a worker may be killed at any moment, so
nothing they share may stay held by a dead one (``python -m benchmarks.audit_lines`` measured what keeps lines
whole with 8 writers: an ``O_APPEND`` file keeps every line whole with no lock, records of 100 KB too; a pipe
tears lines over ``PIPE_BUF`` (4 KB) without a lock, and none with ``flock``):

- a file: one ``os.write`` per whole line, ``O_APPEND``, no lock. At most every ``check_interval`` seconds the
  writer checks that the path still names the open file: a file deleted or rotated away is reopened (created
  0640), and the records written to a deleted file since the last check are written again to the new one;
- a pipe (standard output, the default): its own non-blocking descriptor of the pipe; a line up to
  ``PIPE_BUF`` is one atomic write, a longer one is written under an ``flock`` on that descriptor (the kernel
  releases it when its holder dies) once the pipe has room for all of it;
- a write must finish within ``deadline`` seconds (a reader that stopped reading): past it the record is not
  written, :meth:`AuditWriter.write` reports it, and the log counts as stalled until a write succeeds again
  (later writes wait only briefly meanwhile). The caller then follows the design's asymmetry.

A record that cannot be written (an error after one retry, or the deadline) goes to the error log with the
reason, and a hook counts it: never dropped silently.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import select
import stat
import struct
import termios
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from webhook.admission.audit_records import encode_record

log = logging.getLogger("csinode_guard.audit")

AUDIT_LOG_MODE = 0o640
"""Permissions of an audit log file the guard creates (owner read-write, group read; the umask may take more)."""

DEFAULT_WRITE_DEADLINE = 0.5
"""Seconds one audit record may take to write (a stalled reader of standard output) before it counts as not
written; well inside the webhook's 5 s timeoutSeconds."""
STALLED_WAIT = 0.01
"""Seconds a write waits while the log is stalled (the next requests are answered at once, not after the
whole deadline each)."""
DEFAULT_CHECK_INTERVAL = 0.25
"""Seconds between two checks that the audit file's path still names the open file."""
MAX_REPLAY_LINES = 20_000
"""Records since the last check kept for writing again after the file is deleted (at most this many)."""

_F_GETPIPE_SZ = 1032
_F_SETPIPE_SZ = 1031
_PIPE_BUF = select.PIPE_BUF


class AuditTimeoutError(OSError):
    """An audit record could not be written within the deadline (the reader of the log stalled)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(errno.ETIMEDOUT, f"not written within {seconds:g}s (the log's reader stalled)")


@dataclass(frozen=True)
class AuditHooks:
    """Callbacks of an :class:`AuditWriter` (metrics): each may be None.

    ``failure(reason)`` per record not written; ``timeout()`` per record not written in time; ``stalled(flag)``
    when the log becomes stalled or writable again; ``reopened(reason)`` when the file was ``removed`` or
    ``replaced`` (rotated) and was opened again; ``orphaned(n)`` for records that had gone to a deleted file.
    """

    failure: Callable[[str], object] | None = None
    timeout: Callable[[], object] | None = None
    stalled: Callable[[bool], object] | None = None
    reopened: Callable[[str], object] | None = None
    orphaned: Callable[[int], object] | None = None


class AuditWriter:
    """Appends audit records as JSON lines to ``path`` (``-`` = standard output); see the module docstring.

    ``on_failure(reason)`` is called for every record that could not be written (a metric); ``hooks``, when
    given, replaces it with every callback. ``deadline`` bounds each record's write (seconds),
    ``check_interval`` the time between two checks of the file's identity. Raises OSError at construction when
    the file cannot be opened.
    """

    def __init__(
        self,
        path: str,
        on_failure: Callable[[str], None] | None = None,
        *,
        hooks: AuditHooks | None = None,
        deadline: float = DEFAULT_WRITE_DEADLINE,
        check_interval: float = DEFAULT_CHECK_INTERVAL,
    ) -> None:
        self.path = path
        self.deadline = deadline
        self.check_interval = check_interval
        self._hooks = hooks if hooks is not None else AuditHooks(failure=on_failure)
        self._thread_lock = threading.Lock()  # big pipe lines; the file's descriptor and replay buffer
        self._recent: deque[bytes] = deque()
        self._checked = time.monotonic()
        self._stalled_since: float | None = None
        self._not_written_in_time = 0
        self._in_flight: dict[int, float] = {}
        self._torn = False
        self._open()

    # -- destinations ------------------------------------------------------------------------------------------

    def _open(self) -> None:
        self._pid = os.getpid()
        if self.path == "-":
            self._fd = 1
        else:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, AUDIT_LOG_MODE)
        mode = os.fstat(self._fd).st_mode
        self.kind = "file" if stat.S_ISREG(mode) else "pipe" if stat.S_ISFIFO(mode) else "other"
        self._out = self._fd
        if self.kind == "pipe":
            # A descriptor of our own: non-blocking without changing the one the other processes share, and an
            # open file of its own for flock (locks belong to the open file, so forked copies would share one).
            try:
                self._out = os.open(f"/proc/self/fd/{self._fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                self._out = self._fd
                self.kind = "other"

    def _reopen_after_fork(self) -> None:
        if os.getpid() != self._pid:
            self._open()

    def _check_file(self) -> None:
        """Reopen the file when its path no longer names the open file; write again what went to a deleted one.

        Called with ``_thread_lock`` held, at most every ``check_interval`` seconds."""
        self._checked = time.monotonic()
        opened = os.fstat(self._fd)
        try:
            current = os.stat(self.path)
            same = (current.st_dev, current.st_ino) == (opened.st_dev, opened.st_ino)
        except FileNotFoundError:
            same = False
        if same and opened.st_nlink > 0:
            self._recent.clear()
            return
        reason = "removed" if opened.st_nlink == 0 else "replaced"
        old = self._fd
        self._fd = self._out = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                                       AUDIT_LOG_MODE)
        with contextlib.suppress(OSError):
            os.close(old)
        orphaned = list(self._recent) if reason == "removed" else []
        self._recent.clear()
        log.error("audit log %s was %s; reopened it%s", self.path, reason,
                  f" and wrote again the {len(orphaned)} records that had gone to the deleted file"
                  if orphaned else "")
        if self._hooks.reopened is not None:
            self._hooks.reopened(reason)
        if orphaned:
            if self._hooks.orphaned is not None:
                self._hooks.orphaned(len(orphaned))
            for line in orphaned:
                self._write_all(line)

    # -- writing -----------------------------------------------------------------------------------------------

    def _write_all(self, line: bytes) -> None:
        view = memoryview(line)
        while view:
            view = view[os.write(self._out, view):]

    def _write_file(self, line: bytes) -> None:
        with self._thread_lock:
            if self.path == "-":  # standard output redirected to a file: no path of ours to watch or reopen
                self._write_all(line)
                return
            if time.monotonic() - self._checked >= self.check_interval:
                self._check_file()
            self._write_all(line)
            if len(self._recent) < MAX_REPLAY_LINES:
                self._recent.append(line)

    def _wait_writable(self, until: float) -> None:
        remaining = until - time.monotonic()
        if remaining <= 0:
            raise AuditTimeoutError(self._limit)
        poller = select.poll()
        poller.register(self._out, select.POLLOUT)
        poller.poll(max(1, int(remaining * 1000)))

    def _pipe_room(self) -> int:
        buf = bytearray(4)
        fcntl.ioctl(self._out, termios.FIONREAD, buf)
        size: int = fcntl.fcntl(self._out, _F_GETPIPE_SZ)
        return size - int(struct.unpack("i", buf)[0])

    def _write_pipe(self, line: bytes, until: float) -> None:
        if len(line) <= _PIPE_BUF:  # atomic: all of it or EAGAIN
            while True:
                try:
                    os.write(self._out, line)
                    return
                except BlockingIOError:
                    self._wait_writable(until)
        if not self._thread_lock.acquire(timeout=max(0.0, until - time.monotonic())):
            raise AuditTimeoutError(self._limit)
        try:
            while True:
                try:
                    fcntl.flock(self._out, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= until:
                        raise AuditTimeoutError(self._limit) from None
                    time.sleep(0.001)
            try:
                with contextlib.suppress(OSError):
                    if fcntl.fcntl(self._out, _F_GETPIPE_SZ) < len(line):
                        fcntl.fcntl(self._out, _F_SETPIPE_SZ, len(line))
                while self._pipe_room() < len(line) and len(line) <= fcntl.fcntl(self._out, _F_GETPIPE_SZ):
                    if time.monotonic() >= until:
                        raise AuditTimeoutError(self._limit)
                    time.sleep(0.001)
                view = memoryview(b"\n" + line if self._torn else line)
                self._torn = False
                while view:
                    try:
                        view = view[os.write(self._out, view):]
                    except BlockingIOError:
                        try:
                            self._wait_writable(until)
                        except AuditTimeoutError:
                            self._torn = len(view) < len(line)  # a record larger than the pipe, cut short
                            raise
            finally:
                fcntl.flock(self._out, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()

    def _write_other(self, line: bytes, until: float) -> None:
        """A terminal, socket or device: wait until writable within the deadline, then a blocking write."""
        poller = select.poll()
        poller.register(self._out, select.POLLOUT)
        remaining = until - time.monotonic()
        if not poller.poll(max(0, int(remaining * 1000))):
            raise AuditTimeoutError(self._limit)
        with self._thread_lock:
            self._write_all(line)

    def _write_whole(self, line: bytes, until: float) -> None:
        """One line, whole, by ``until`` (monotonic) for pipes and terminals; raises OSError."""
        if self.kind == "file":
            self._write_file(line)
        elif self.kind == "pipe":
            self._write_pipe(line, until)
        else:
            self._write_other(line, until)

    @property
    def _limit(self) -> float:
        return STALLED_WAIT if self._stalled_since is not None else self.deadline

    def write(self, records: list[dict[str, Any]]) -> int:
        """Write ``records`` (each one line) within the deadline; returns how many were written. Never raises.

        A record not written goes to the error log with the reason and is counted (``hooks.failure``; also
        ``hooks.timeout`` when the deadline passed). Callers compare the result with ``len(records)``.
        """
        self._reopen_after_fork()
        written = 0
        me = threading.get_ident()
        self._in_flight[me] = time.monotonic()
        try:
            for record in records:
                line = encode_record(record)
                error = ""
                timed_out = False
                for _attempt in range(2):
                    try:
                        self._write_whole(line, time.monotonic() + self._limit)
                        error = ""
                        break
                    except AuditTimeoutError as exc:
                        error, timed_out = f"timeout: {exc.strerror}", True
                        break
                    except OSError as exc:
                        error = f"{type(exc).__name__}: {exc.strerror or exc}"
                if error:
                    self._not_written(line, error, timed_out)
                else:
                    written += 1
                    if self._stalled_since is not None:
                        self._stalled_since = None
                        log.warning("audit log %s is written again", self.path)
                        if self._hooks.stalled is not None:
                            self._hooks.stalled(False)
        finally:
            self._in_flight.pop(me, None)
        return written

    def _not_written(self, line: bytes, error: str, timed_out: bool) -> None:
        if timed_out:
            self._not_written_in_time += 1
            if self._hooks.timeout is not None:
                self._hooks.timeout()
            if self._stalled_since is None:
                self._stalled_since = time.monotonic()
                if self._hooks.stalled is not None:
                    self._hooks.stalled(True)
        if self._hooks.failure is not None:
            self._hooks.failure(error)
        log.error("audit record not written to %s (%s): %s", self.path, error, line.decode().rstrip())

    def problems(self) -> list[str]:
        """Why reviews cannot complete with an audit record right now (for /readyz); empty when none."""
        now = time.monotonic()
        found = []
        if self._stalled_since is not None:
            found.append(f"audit log {self.path} stalled for {now - self._stalled_since:.1f}s: "
                         f"{self._not_written_in_time} records not written within {self.deadline:g}s so far")
        stuck = [now - t for t in list(self._in_flight.values()) if now - t > 2 * self.deadline + 1]
        if stuck:
            found.append(f"an audit write to {self.path} has been blocked for {max(stuck):.1f}s")
        return found

    def close(self) -> None:
        """Close the file and this writer's own pipe descriptor (never standard output itself)."""
        for fd in {self._out, self._fd} - {0, 1, 2}:
            with contextlib.suppress(OSError):
                os.close(fd)
