"""A gthread worker that gives a connection a thread only once its request has arrived whole.

gunicorn 27's gthread worker reads the TLS handshake, the headers and the body in a pool thread with blocking
reads: a client that sends slowly holds the thread for as long as it likes (or until
:class:`webhook.serving.workers.DeadlineSSLSocket` gives up), and 64 of them held every thread of a worker, so the
apiserver's reviews waited seconds (``python -m benchmarks.slow_clients``). Here a pool thread only ever does
what needs no waiting: it completes as much of the TLS handshake as has arrived, reads what the socket holds
without blocking, and, when the request is not complete yet, hands the connection back to the worker's poller
(gunicorn's own "deferred" path) and is free again. Only a request whose headers and body (``Content-Length``
or a complete chunked body) are all buffered reaches gunicorn's parser and the application, so every thread is
kept for requests that arrived whole.

The whole request — the handshake with the first request from the connection's first byte, and each later
request of a keep-alive connection from its first byte — must arrive within the client read deadline
(``CSINODE_GUARD_CLIENT_READ_TIMEOUT``, 5 s) measured on the clock, not on a thread; past it the connection is
closed and counted as a client fault (``csinode_guard_client_faults_total{reason="too_slow"}``). A connection
that has sent nothing yet waits in the poller as in gthread (until the keep-alive timeout). A request larger
than ``max_request_bytes`` is handed over as soon as its headers are in: the application answers 413 without
reading the body. When the worker began reading each request — or, earlier, when the connection with its bytes
was handed to the thread pool and waited there for a free thread — is remembered for the application, which
marks an answer given after the apiserver's deadline (:mod:`webhook.serving.lateness`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import re
import ssl
import time
from collections import deque
from typing import Any, ClassVar

from gunicorn import sock as gsock
from gunicorn.http import get_parser
from gunicorn.workers import gthread

from webhook.serving.lateness import mark_request_started

log = logging.getLogger("csinode_guard.serving")

_WAIT = gthread._DEFER  # gunicorn's marker: "park this connection in the poller"
_HEADER_END = b"\r\n\r\n"
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length[ \t]*:[ \t]*([0-9]+)[ \t]*(?=\r\n)", re.IGNORECASE)
_CHUNKED = re.compile(rb"\r\ntransfer-encoding[ \t]*:[^\r\n]*chunked", re.IGNORECASE)
_EXPECT = re.compile(rb"\r\nexpect[ \t]*:", re.IGNORECASE)
_QUEUED = "csinode_guard_queued"
"""The attribute of a connection holding when (monotonic) it was handed to the thread pool with a new request."""
MAX_HEADER_BYTES = 64 * 1024
"""Headers longer than this are handed to gunicorn's parser, which refuses them (its field limits)."""


def request_complete(data: bytes | bytearray, max_body: int) -> bool:
    """True when ``data`` (bytes received on a connection) holds one whole HTTP/1.1 request, or as much of it as
    the server should read before answering: the headers of a body over ``max_body`` bytes, headers too long
    to be valid, or framing gunicorn's parser will refuse anyway.

    Linear in ``len(data)``; never raises.
    """
    end = data.find(_HEADER_END)
    if end < 0:
        return len(data) > MAX_HEADER_BYTES
    head = b"\r\n" + data[: end + 2]
    body = end + len(_HEADER_END)
    if _EXPECT.search(head):
        return True  # the client waits for "100 Continue" before sending its body
    if _CHUNKED.search(head):
        return _chunked_complete(data, body, max_body)
    match = _CONTENT_LENGTH.search(head)
    if match is None:
        return True
    length = int(match.group(1)[:20])
    return length > max_body or len(data) - body >= length


def _chunked_complete(data: bytes | bytearray, pos: int, max_body: int) -> bool:
    """True when the chunked body starting at ``pos`` ended (the last chunk and the trailers' empty line), is
    malformed (the parser refuses it), or already carries more than ``max_body`` bytes."""
    total = 0
    while True:
        line_end = data.find(b"\r\n", pos)
        if line_end < 0:
            return len(data) - pos > 1024  # a chunk-size line this long is malformed
        size_text = data[pos:line_end].split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            return True
        pos = line_end + 2
        if size == 0:
            trailers = data.find(b"\r\n", pos)
            while trailers >= 0 and trailers != pos:  # a trailer line; the body ends at an empty line
                pos = trailers + 2
                trailers = data.find(b"\r\n", pos)
            return trailers == pos
        total += size
        if total > max_body:
            return True
        if len(data) < pos + size + 2:
            return False
        pos += size + 2


class _Gathering:
    """The bytes of one request received so far, when (monotonic) the worker began reading it, and by when the
    rest must be in."""

    __slots__ = ("data", "deadline", "started")

    def __init__(self, started: float, deadline: float) -> None:
        self.data = bytearray()
        self.started = started
        self.deadline = deadline


class WholeRequestWorker(gthread.ThreadWorker):  # type: ignore[misc]
    """gunicorn's gthread worker, with the reading described in the module docstring.

    ``read_timeout`` (seconds) and ``max_request_bytes`` (the body limit) are set in the master before the
    workers fork (:func:`webhook.serving.workers.gunicorn_options`).
    """

    read_timeout: ClassVar[float] = 5.0
    max_request_bytes: ClassVar[int] = 3 * 1024 * 1024

    def handle(self, conn: Any) -> Any:
        """Runs in a pool thread: gather what has arrived; serve the request once it is whole."""
        try:
            state = self._gather(conn)
        except (OSError, ssl.SSLError, ValueError) as exc:
            log.debug("connection from %s closed while reading its request: %s", conn.client, exc)
            return False
        if state is _WAIT and not self.alive:
            # A stopping worker parks nothing (gunicorn would take the marker for keep-alive): the rest of this
            # request is read with blocking reads, within the request deadline of DeadlineSSLSocket.
            try:
                self._finish_blocking(conn)
            except (OSError, ssl.SSLError, ValueError) as exc:
                log.debug("connection from %s closed while stopping: %s", conn.client, exc)
                return False
            state = True
        if state is _WAIT or state is False:
            return state
        return super().handle(conn)

    def handle_exit(self, sig: int, frame: Any) -> None:
        """SIGTERM: stop as gunicorn does (answer what is on the connections, then exit), and end this worker's
        writes to the cluster now (:mod:`webhook.serving.stopping`)."""
        super().handle_exit(sig, frame)
        from webhook.serving import stopping  # noqa: PLC0415

        stopping.begin_stop()

    def enqueue_req(self, conn: Any) -> None:
        """gunicorn's, remembering when a connection with a new request was handed to the thread pool: a request
        that waits there for a free thread (all busy judging) is already waiting for its answer, and its
        lateness counts from here (:mod:`webhook.serving.lateness`)."""
        if getattr(conn, "csinode_guard_gathering", None) is None and getattr(conn, _QUEUED, None) is None:
            setattr(conn, _QUEUED, time.monotonic())
        super().enqueue_req(conn)

    def finish_request(self, conn: Any, fs: Any) -> None:
        """gunicorn's, except that a connection parked by a worker that has begun to stop meanwhile goes back to
        a thread (which then finishes it with blocking reads) instead of being taken for a kept-alive one."""
        if not self.alive and not fs.cancelled() and fs.exception() is None and fs.result() is _WAIT:
            self.enqueue_req(conn)
            return
        super().finish_request(conn, fs)

    def _finish_blocking(self, conn: Any) -> None:
        gathering: _Gathering | None = getattr(conn, "csinode_guard_gathering", None)
        if self.cfg.is_ssl and not conn.initialized and not isinstance(conn.sock, ssl.SSLSocket):
            conn.sock.setblocking(True)
            conn.sock = gsock.ssl_context(self.cfg).wrap_socket(
                conn.sock, server_side=True, suppress_ragged_eofs=self.cfg.suppress_ragged_eofs,
                do_handshake_on_connect=False,
            )
        conn.sock.setblocking(True)
        if not conn.initialized:
            if self.cfg.is_ssl:
                conn.sock.do_handshake()
            conn.parser = get_parser(self.cfg, conn.sock, conn.client)
            conn.initialized = True
        if gathering is not None and gathering.data:
            conn.parser.unreader.unread(bytes(gathering.data))
        mark_request_started(conn.sock, gathering.started if gathering is not None else time.monotonic())
        conn.csinode_guard_gathering = None
        conn.data_ready = True

    def _gather(self, conn: Any) -> Any:
        now = time.monotonic()
        gathering: _Gathering | None = getattr(conn, "csinode_guard_gathering", None)
        if gathering is None:
            # A new connection's first bytes are waited for as gthread does (``FIRST_BYTES_WAIT``); one that has
            # sent nothing by then waits in the poller, with no deadline (the keep-alive timeout).
            if not conn.initialized and not conn.data_ready and not conn.wait_for_data(
                    gthread.DEFAULT_WORKER_DATA_TIMEOUT):
                setattr(conn, _QUEUED, None)  # nothing sent yet: its request starts with its first byte
                return _WAIT
            queued = getattr(conn, _QUEUED, None)
            setattr(conn, _QUEUED, None)
            started = min(now, queued) if queued is not None else now
            gathering = conn.csinode_guard_gathering = _Gathering(started, now + self.read_timeout)
        if now > gathering.deadline:
            return self._too_slow(conn, self._awaited(conn))
        if not conn.initialized:
            if not self._handshake(conn):
                return _WAIT
            conn.parser = get_parser(self.cfg, conn.sock, conn.client)
            conn.initialized = True
        leftover = conn.parser.unreader.take_buffered()  # read ahead by the previous request
        if leftover:
            gathering.data += leftover
        sock = conn.sock
        sock.setblocking(False)
        data = gathering.data
        ended = False
        while len(data) <= self.max_request_bytes + MAX_HEADER_BYTES:
            try:
                chunk = sock.recv(256 * 1024)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
                break
            if not chunk:  # end of file: a closed keep-alive connection, or a request cut short
                ended = True
                break
            data += chunk
        if ended and not data:
            return False
        if not ended and not request_complete(data, self.max_request_bytes):
            if time.monotonic() > gathering.deadline:
                return self._too_slow(conn, "request")
            return _WAIT
        conn.parser.unreader.unread(bytes(gathering.data))
        mark_request_started(conn.sock, gathering.started)  # for the answer's lateness (webhook.serving.lateness)
        conn.csinode_guard_gathering = None  # the next request starts its own deadline with its first byte
        conn.data_ready = True
        return True

    def _handshake(self, conn: Any) -> bool:
        """Advance the TLS handshake without blocking; True once it is done (plain HTTP: at once)."""
        if not self.cfg.is_ssl:
            return True
        if not isinstance(conn.sock, ssl.SSLSocket):
            conn.sock.setblocking(False)
            conn.sock = gsock.ssl_context(self.cfg).wrap_socket(
                conn.sock, server_side=True, suppress_ragged_eofs=self.cfg.suppress_ragged_eofs,
                do_handshake_on_connect=False,
            )
        conn.sock.setblocking(False)
        try:
            ssl.SSLSocket.do_handshake(conn.sock)  # the plain, non-blocking handshake step
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return False
        return True

    def _awaited(self, conn: Any) -> str:
        """What a connection past its deadline still owes: its TLS handshake, or (once that is done, or without
        TLS) its request. The log line and the client's view agree: a client cut off mid-handshake sees a reset
        of the handshake, not of a request."""
        return "TLS handshake" if self.cfg.is_ssl and not conn.initialized else "request"

    def _too_slow(self, conn: Any, what: str) -> bool:
        give_up = getattr(conn.sock, "give_up", None)
        if callable(give_up):
            give_up(what)  # logs it; the graceful close then drains nothing
        else:
            log.warning("closing a connection from %s: client sent no complete %s within %gs", conn.client, what,
                        self.read_timeout)
        from webhook.serving import metrics  # noqa: PLC0415 - worker processes only

        metrics.count_client_fault("too_slow")
        conn.csinode_guard_gathering = None
        return False

    def murder_pending(self) -> None:
        """Close parked connections whose request deadline or keep-alive wait has passed (in any order)."""
        now = time.monotonic()
        keep: deque[Any] = deque()
        while self.pending_conns:
            conn = self.pending_conns.popleft()
            gathering: _Gathering | None = getattr(conn, "csinode_guard_gathering", None)
            late = gathering is not None and now > gathering.deadline
            if not late and conn.timeout > now:
                keep.append(conn)
                continue
            with contextlib.suppress(OSError, KeyError, ValueError):
                self.poller.unregister(conn.sock)
            self.nr_conns -= 1
            if late:
                try:
                    self._too_slow(conn, self._awaited(conn))
                except Exception:  # closing must go on
                    log.debug("counting a slow client failed", exc_info=True)
            conn.close()
        self.pending_conns.extend(keep)

    def wait_for_and_dispatch_events(self, timeout: float) -> None:
        """gunicorn's event wait, waking at least every quarter second so that request deadlines hold."""
        try:
            events = self.poller.select(min(timeout, 0.25))
            for key, _ in events:
                key.data(key.fileobj)
        except OSError as e:
            if e.errno != errno.EINTR:
                raise


