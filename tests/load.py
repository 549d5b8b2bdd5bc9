"""Bounded background load for tests against a running server: keep-alive clients, one unique uid per request."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import urllib3

from tests.conftest import RunningServer

DATA = Path(__file__).parent / "data"
TEMPLATE_UID = b"0d4c3b2a-656e692d-4e5f-8a9b-1c2d3e4f5a6b"
TEMPLATE = (DATA / "review-eni-25-to-23.json").read_bytes()
assert TEMPLATE.count(TEMPLATE_UID) == 1


def review_with_uid(uid: str) -> bytes:
    """The kubelet review 25 -> 23 of tests/data with request uid ``uid`` (36 characters or fewer)."""
    return TEMPLATE.replace(TEMPLATE_UID, uid.encode())


@dataclass
class Outcome:
    """One request: its uid, when it was sent (monotonic), HTTP status (None: no answer) and the error."""

    uid: str
    sent: float
    status: int | None
    error: str = ""


@dataclass
class Load:
    """``clients`` threads, each with its own keep-alive connection, POSTing /mutate until stopped.

    Bounded: every thread stops after ``max_seconds`` or ``max_requests`` requests, whichever comes first.
    """

    server: RunningServer
    clients: int = 2
    max_seconds: float = 60.0
    max_requests: int = 20_000
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _run(self, index: int) -> None:
        pool = self.server.client()
        deadline = time.monotonic() + self.max_seconds
        n = 0
        while not self._stop.is_set() and time.monotonic() < deadline and n < self.max_requests:
            uid = f"load-{index}-{n:08d}"
            n += 1
            sent = time.monotonic()
            try:
                answer = pool.request("POST", "/mutate?timeout=10s", body=review_with_uid(uid),
                                      headers={"Content-Type": "application/json"})
                outcome = Outcome(uid, sent, answer.status)
            except urllib3.exceptions.HTTPError as exc:
                outcome = Outcome(uid, sent, None, f"{type(exc).__name__}: {exc}")
                pool = self.server.client()
            with self._lock:
                self.outcomes.append(outcome)
        pool.close()

    def start(self) -> Load:
        for i in range(self.clients):
            thread = threading.Thread(target=self._run, args=(i,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)
        return list(self.outcomes)

    def answered(self) -> int:
        with self._lock:
            return sum(1 for o in self.outcomes if o.status == 200)

    def wait_for_answers(self, count: int, timeout: float = 20.0) -> None:
        """Block until ``count`` more requests were answered with 200 (or ``timeout``)."""
        target = self.answered() + count
        deadline = time.monotonic() + timeout
        while self.answered() < target and time.monotonic() < deadline:
            time.sleep(0.05)
