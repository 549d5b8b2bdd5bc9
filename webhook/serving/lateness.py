"""Answers the apiserver no longer waits for: after its deadline, or on a connection it has closed.

kube-apiserver calls a webhook with ``?timeout=Ns``: the webhook's ``timeoutSeconds`` (or what is left of the
request's own deadline, when that is shorter), rounded up to whole seconds. Past it, the apiserver stops waiting
and applies the webhook's ``failurePolicy`` (``Ignore``: the write goes on unjudged; ``Fail``: it is refused), and
closes the connection. An answer given after that has no effect, although the guard judged and recorded it.

Two signs, either is enough (:func:`judge_lateness`):

- ``deadline``: the time since the worker first read the request's bytes (:func:`mark_request_started`, from
  :mod:`webhook.serving.wholerequest`) exceeds the ``timeout`` the apiserver sent. The apiserver started its clock
  before it sent them, so this elapsed time is a lower bound of the apiserver's: never a false alarm. It covers a
  worker stalled after it began to read (a stopped process, CPU starvation, a slow lookup, a queue of requests
  waiting for a thread).
- ``client-closed``: the peer has already closed the connection (``POLLRDHUP``, ``POLLHUP`` or ``POLLERR`` on the
  socket, checked without reading, so it works under TLS). It covers what the clock cannot see: a request that
  waited in the kernel's socket buffer of a keep-alive connection while the worker was stopped (the worker cannot
  know when its bytes arrived). The apiserver's HTTP client closes a connection when it gives up and never
  half-closes one it still waits on.

Checked when the audit record is written, just before the answer is sent (the record is written first so that no
answered request lacks one); only the audit write's own deadline (0.5 s) lies between the two.
"""

from __future__ import annotations

import contextlib
import select
import time
from dataclasses import dataclass
from typing import Any

from webhook.admission.durations import parse_duration

_STARTED_ATTRIBUTE = "csinode_guard_request_started"
_CLOSED_EVENTS = getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR


def mark_request_started(sock: Any, started: float) -> None:
    """Remember on ``sock`` that the worker began reading its current request at ``started``
    (``time.monotonic()`` seconds). A socket that takes no attributes (a plain ``socket.socket``; the guard
    always serves TLS) is left alone: the application's own start time is used instead."""
    with contextlib.suppress(AttributeError):
        setattr(sock, _STARTED_ATTRIBUTE, started)


def request_started(sock: Any) -> float | None:
    """When the worker began reading the current request of ``sock`` (``time.monotonic()``), or None."""
    value = getattr(sock, _STARTED_ATTRIBUTE, None)
    return value if isinstance(value, float) else None


def apiserver_timeout(value: str | None) -> float | None:
    """Seconds in the ``timeout`` query parameter (a Go duration: ``10s``, ``1m0s``, ``1.5s``, ``500ms``), or
    None when absent or unreadable (then only a closed connection makes an answer late)."""
    if not value:
        return None
    try:
        seconds = parse_duration(value)
    except ValueError:
        return None
    return seconds if seconds > 0 else None


def peer_closed(sock: Any) -> bool:
    """True when the peer of ``sock`` has closed the connection or reset it (poll, no wait, nothing read)."""
    fileno = getattr(sock, "fileno", None)
    if fileno is None:
        return False
    try:
        fd = fileno()
        if fd < 0:
            return False  # closed on this side: not the peer's doing
        poller = select.poll()
        poller.register(fd, _CLOSED_EVENTS)
        return any(events & _CLOSED_EVENTS for _, events in poller.poll(0))
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class Lateness:
    """Why an answer is late: ``reason`` ``deadline`` or ``client-closed``; ``elapsed_seconds`` since the worker
    began reading the request; ``deadline_seconds`` the apiserver's ``timeout`` (None when it sent none)."""

    reason: str
    elapsed_seconds: float
    deadline_seconds: float | None

    def record_fields(self) -> dict[str, Any]:
        """The audit record's fields: ``late``, ``lateReason``, ``elapsedSeconds``, ``deadlineSeconds``."""
        return {
            "late": True,
            "lateReason": self.reason,
            "elapsedSeconds": round(self.elapsed_seconds, 3),
            "deadlineSeconds": self.deadline_seconds,
        }


def judge_lateness(sock: Any, started: float, deadline_seconds: float | None,
                   now: float | None = None) -> Lateness | None:
    """The :class:`Lateness` of answering now a request the worker began reading at ``started`` (monotonic
    seconds) on ``sock``, with the apiserver's ``timeout`` ``deadline_seconds``; None when it is on time."""
    elapsed = (time.monotonic() if now is None else now) - started
    if deadline_seconds is not None and elapsed > deadline_seconds:
        return Lateness("deadline", elapsed, deadline_seconds)
    if peer_closed(sock):
        return Lateness("client-closed", elapsed, deadline_seconds)
    return None
