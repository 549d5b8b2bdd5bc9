"""Reading the replay's input: apiserver audit log files, plain or gzip, line by line, merged in time order.

:func:`order_files` sorts the files by their first event (rotated files come in any order);
:func:`scan_lines` reads one file's audit event lines as :class:`ScannedLine` values that ``heapq.merge``
interleaves by ``requestReceivedTimestamp``. Only lines about a resource of interest (:data:`INTERESTING`) are
parsed as JSON; the others are merged and recognised as duplicates from their bytes. A broken line or gzip stream
is a :class:`~webhook.simulation.replay_results.Problem`, never an exception. :func:`open_stream` also reads the guard's
own audit log (:mod:`webhook.simulation.audit_queries`). Pure apart from reading files.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, NamedTuple

from webhook.simulation.replay_results import Problem, Summary

INTERESTING = (b"csinodes", b'"nodes"', b"volumeattachments", b"csidrivers")
"""Byte strings a line must contain to be parsed as JSON (every other line is skipped unparsed)."""
PROGRESS_EVERY_LINES = 2000
"""Lines between two progress reports."""


class Progress:
    """Progress sink: ``advance(n_bytes)`` as input is consumed. The default does nothing."""

    def advance(self, n: int) -> None:
        """Count ``n`` more bytes of input read."""

    def close(self) -> None:
        """Finish."""


def open_stream(path: Path) -> tuple[IO[bytes], IO[bytes]]:
    """(raw file, byte stream) of ``path``: gzip is recognised by its magic number, not by the file name."""
    raw = path.open("rb")
    magic = raw.read(2)
    raw.seek(0)
    if magic == b"\x1f\x8b":
        return raw, gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    return raw, raw


def iter_lines(path: Path, summary: Summary, progress: Progress, on_problem: Callable[[Problem], None]) -> Iterator[
    tuple[int, bytes]
]:
    """Yield (line number, line) of a plain or gzip file; a broken stream ends the file with a problem."""
    try:
        raw, stream = open_stream(path)
    except OSError as exc:
        on_problem(Problem(str(path), 0, f"cannot open: {exc.strerror or exc}"))
        return
    lineno = 0
    reported = 0
    try:
        with raw, stream:
            while True:
                try:
                    line = stream.readline()
                except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as exc:
                    on_problem(Problem(str(path), lineno + 1, f"compressed stream broken after line {lineno} "
                                       f"({type(exc).__name__}: {exc}); rest of the file skipped"))
                    return
                if not line:
                    break
                lineno += 1
                summary.lines += 1
                yield lineno, line
                if lineno % PROGRESS_EVERY_LINES == 0:
                    pos = raw.tell()
                    progress.advance(pos - reported)
                    reported = pos
    finally:
        try:
            size = path.stat().st_size
        except OSError:
            size = reported
        progress.advance(max(0, size - reported))


def _first_time(path: Path) -> str:
    """requestReceivedTimestamp of the first audit event in ``path`` ("" when none in its first lines)."""
    try:
        raw, stream = open_stream(path)
        with raw, stream:
            for _ in range(100):
                line = stream.readline()
                if not line:
                    break
                try:
                    doc = json.loads(line)
                except ValueError:
                    continue
                if isinstance(doc, dict) and isinstance(doc.get("requestReceivedTimestamp"), str):
                    return str(doc["requestReceivedTimestamp"])
    except (OSError, EOFError, zlib.error):
        pass
    return ""


def order_files(paths: Sequence[Path]) -> list[Path]:
    """Files sorted by the time of their first event (rotated logs may be given in any order)."""
    keyed = [(_first_time(p), i, p) for i, p in enumerate(paths)]
    return [p for _, _, p in sorted(keyed, key=lambda t: (t[0] == "", t[0], t[1]))]


def _interesting(line: bytes) -> bool:
    return any(token in line for token in INTERESTING)


_AUDIT_ID = re.compile(rb'"auditID"\s*:\s*"([^"\\]*)"')
_STAGE = re.compile(rb'"stage"\s*:\s*"([^"\\]*)"')
_RECEIVED = re.compile(rb'"requestReceivedTimestamp"\s*:\s*"([^"\\]*)"')


def _found(pattern: re.Pattern[bytes], line: bytes) -> bytes | None:
    match = pattern.search(line)
    return match.group(1) if match else None


class ScannedLine(NamedTuple):
    """One audit event line of one file, in the order :func:`heapq.merge` puts the files' lines together.

    ``time``: requestReceivedTimestamp as written ("" when absent); ``key``: a hash of (auditID, stage), None
    without an auditID; ``event``: the parsed event, or None for a line about a resource of no interest.
    """

    time: str
    file: int
    line: int
    key: int | None = None
    source: str = ""
    event: dict[str, Any] | None = None

    def __lt__(self, other: object) -> bool:  # merge order: time, then file and line
        if not isinstance(other, ScannedLine):
            return NotImplemented
        return (self.time, self.file, self.line) < (other.time, other.file, other.line)


def scan_lines(path: Path, index: int, summary: Summary, progress: Progress,
               problem: Callable[[Problem], None]) -> Iterator[ScannedLine]:
    """The audit event lines of ``path`` (file ``index`` in merge order); other lines are counted or reported.

    A line that mentions no resource of interest is not parsed: its auditID, stage and time are read from the
    bytes, enough to merge it and to recognise a duplicate.
    """
    source = str(path)
    for lineno, line in iter_lines(path, summary, progress, problem):
        stripped = line.strip()
        if not stripped:
            continue
        if not _interesting(stripped):
            if stripped[:1] != b"{" or stripped[-1:] != b"}":
                problem(Problem(source, lineno, "not a JSON object (truncated or corrupt line)"))
                continue
            audit_id, stage = _found(_AUDIT_ID, stripped), _found(_STAGE, stripped)
            received = _found(_RECEIVED, stripped)
            if audit_id:
                summary.audit_ids += 1
            key = hash((audit_id, stage)) if audit_id else None
            yield ScannedLine(received.decode("ascii", "replace") if received else "", index, lineno, key, source)
            continue
        try:
            event = json.loads(stripped)
        except (ValueError, RecursionError) as exc:
            problem(Problem(source, lineno, f"not JSON ({exc})"))
            continue
        if not isinstance(event, dict) or event.get("kind") != "Event":
            summary.not_audit_events += 1
            continue
        audit_id = event.get("auditID")
        if audit_id:
            summary.audit_ids += 1
        key = hash((str(audit_id).encode(), str(event.get("stage")).encode())) if audit_id else None
        received = event.get("requestReceivedTimestamp")
        yield ScannedLine(received if isinstance(received, str) else "", index, lineno, key, source, event)


def describe_input(paths: Iterable[Path]) -> int:
    """Total bytes of ``paths`` on disk (the progress bar's total)."""
    total = 0
    for p in paths:
        with contextlib.suppress(OSError):
            total += os.path.getsize(p)
    return total
