"""The policy in force, with hot reload: a valid new file takes effect, an invalid one is refused.

A ConfigMap volume updates its files by swapping the ``..data`` symlink, so the store compares the resolved
path, inode, size and modification time of the policy file every ``interval`` seconds (a daemon thread per
process). A valid new policy becomes current with the next generation number; an invalid one is logged with
file, path and constraint, reported to ``on_reload("invalid")``, and the last good policy keeps serving.
Swapping is one reference assignment: a request in flight keeps the policy it started with.

Generation numbers are shared by the processes of one server. Every gunicorn worker has its own store and
reloads on its own; a worker that starts (or is restarted) after a reload loads the new policy first. With a
per-process counter that worker would call the new policy generation 1 while its siblings call it 2, so audit
records and /readyz of one server would disagree. A :class:`GenerationLedger` (a small file of hash ->
generation, appended under a POSIX record lock) gives every process the same number for the same policy version: the
first store of a server creates it in a fresh temporary directory and exports its location in
``CSINODE_GUARD_POLICY_LEDGER_DIR``, so the workers forked after it (gunicorn's master builds a store before it
forks) share it. When no file can be created, each process counts on its own (and says so in the log).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from webhook.admission.policy import Policy, PolicyError, bundled_policy_path, load_policy

log = logging.getLogger("csinode_guard.policy")


@dataclass(frozen=True)
class PolicyFileProblem:
    """The policy file as it is now is refused: ``since`` is the file's modification time (Unix seconds, the
    same in every process of a server), ``error`` the refusal (file, path, constraint); ``generation`` is the
    last good policy's, which keeps serving."""

    path: Path
    since: float
    error: str
    generation: int
    missing: bool = False

    def describe(self) -> str:
        """One line for /readyz: "policy file P invalid since T, serving generation N: error", or for a file
        that is gone (``missing``; ``since`` is when this process first found it gone) "policy file P missing
        since T, serving generation N"."""
        stamp = datetime.fromtimestamp(self.since, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        if self.missing:
            return f"policy file {self.path} missing since {stamp}, serving generation {self.generation}"
        return f"policy file {self.path} invalid since {stamp}, serving generation {self.generation}: {self.error}"


@dataclass(frozen=True)
class PolicySnapshot:
    """The policy in force and its generation (1 for the first load, +1 per successful reload)."""

    policy: Policy
    generation: int


LEDGER_ENV = "CSINODE_GUARD_POLICY_LEDGER_DIR"


class GenerationLedger:
    """Policy generations shared by processes: an append-only file of ``{"generation": n, "hash": h}`` lines.

    ``path`` None keeps the ledger in memory (one process). :meth:`generation_for` returns the generation of a
    policy version: the last entry's when its hash is the same, else a new entry (last + 1).
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._entries: list[tuple[int, str]] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _locked(self) -> threading.Lock:
        """The ledger's thread lock, made anew in a forked process: the parent's may have been held, at the fork,
        by one of its threads (the master reloads the policy while gunicorn forks workers), and no thread of the
        child would ever release it."""
        if os.getpid() != self._pid:
            self._lock = threading.Lock()
            self._pid = os.getpid()
        return self._lock

    @classmethod
    def for_policy(cls, policy_path: Path | None) -> GenerationLedger:
        """The ledger of ``policy_path`` shared with this server's other processes (see the module docstring)."""
        if policy_path is None:
            return cls(None)
        directory = os.environ.get(LEDGER_ENV)
        if not directory or not os.path.isdir(directory):
            try:
                directory = tempfile.mkdtemp(prefix="csinode-guard-policy-")
            except OSError as exc:
                log.warning("policy generations are counted per process (no ledger directory: %s)", exc)
                return cls(None)
            os.environ[LEDGER_ENV] = directory
            creator = os.getpid()

            def remove() -> None:
                if os.getpid() == creator:
                    shutil.rmtree(str(directory), ignore_errors=True)

            atexit.register(remove)
        key = hashlib.sha256(os.path.abspath(policy_path).encode()).hexdigest()[:16]
        return cls(Path(directory) / f"generations-{key}.jsonl")

    def generation_for(self, policy_hash: str) -> int:
        """The generation of the policy with ``policy_hash``, recording a new one when it is not the latest."""
        with self._locked():
            if self.path is None:
                return self._next(self._entries, policy_hash)
            try:
                with self.path.open("a+", encoding="utf-8") as f:
                    # A POSIX record lock, not flock: a worker forked while the master holds it does not inherit it.
                    fcntl.lockf(f, fcntl.LOCK_EX)
                    f.seek(0)
                    entries = []
                    for line in f:
                        with contextlib.suppress(ValueError, KeyError, TypeError):
                            doc = json.loads(line)
                            entries.append((int(doc["generation"]), str(doc["hash"])))
                    before = len(entries)
                    generation = self._next(entries, policy_hash)
                    if len(entries) != before:
                        f.write(json.dumps({"generation": generation, "hash": policy_hash}) + "\n")
                        f.flush()
                    return generation
            except OSError as exc:
                log.warning("policy generation ledger %s unusable (%s); counting in this process", self.path, exc)
                self.path = None
                return self._next(self._entries, policy_hash)

    @staticmethod
    def _next(entries: list[tuple[int, str]], policy_hash: str) -> int:
        if entries and entries[-1][1] == policy_hash:
            return entries[-1][0]
        generation = (entries[-1][0] + 1) if entries else 1
        entries.append((generation, policy_hash))
        return generation


def _fingerprint(path: Path) -> tuple[str, int, int, int] | None:
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None
    return (real, st.st_ino, st.st_size, st.st_mtime_ns)


class PolicyStore:
    """Holds the current :class:`PolicySnapshot`; ``path`` None means the bundled default (never reloaded).

    Raises :class:`PolicyError` at construction when the initial policy is invalid (the server must not start
    on a broken policy). A file that is gone for ``missing_grace`` seconds (default two reload intervals: a
    ConfigMap's ``..data`` swap leaves the path dangling only for a moment) is a problem too, like a refused
    file: the last good policy serves, but a restart would refuse to start. ``on_reload(result, snapshot)`` is
    called after every reload attempt. ``ledger`` numbers the generations (default: shared with this server's
    other processes, see the module docstring).

    ``fallback`` is for a worker (re)started while the server runs: the snapshot the server's master serves. A
    worker that then cannot load the file (a ConfigMap's ``..data`` swap caught halfway, a refused edit) serves
    that snapshot and reports the file as a running worker does, instead of failing to boot, which makes
    gunicorn stop the whole server.
    """

    def __init__(
        self,
        path: Path | None,
        interval: float = 5.0,
        on_reload: Callable[[str, PolicySnapshot], None] | None = None,
        ledger: GenerationLedger | None = None,
        missing_grace: float | None = None,
        fallback: PolicySnapshot | None = None,
    ) -> None:
        self.path = path
        self.interval = interval
        self.missing_grace = 2 * interval if missing_grace is None else missing_grace
        self._on_reload = on_reload
        self._ledger = ledger if ledger is not None else GenerationLedger.for_policy(path)
        self._fingerprint = _fingerprint(path or bundled_policy_path())
        self._stop = threading.Event()
        self._missing_since: tuple[float, float] | None = None  # (wall clock, monotonic) when first found gone
        self._problem: PolicyFileProblem | None = None
        self._thread: threading.Thread | None = None
        try:
            policy = load_policy(path)
        except PolicyError as exc:
            if fallback is None or path is None:
                raise
            self._snapshot = fallback
            self._refused_at_start(path, exc)
        else:
            self._snapshot = PolicySnapshot(policy, self._ledger.generation_for(policy.hash))

    def _refused_at_start(self, path: Path, exc: PolicyError) -> None:
        """The file could not be loaded as this process started with a ``fallback``: judged as a reload would be
        (a missing file after ``missing_grace``, a refused one at once)."""
        log.warning("policy file %s not loaded as this worker started (%s); serving the policy the server runs "
                    "(generation %d, hash %s)", path, exc, self._snapshot.generation, self._snapshot.policy.hash)
        if self._fingerprint is None:
            self._note_missing()
            return
        self._problem = PolicyFileProblem(path, self._fingerprint[3] / 1e9, str(exc), self._snapshot.generation)

    def current(self) -> PolicySnapshot:
        """The snapshot in force (cheap; safe from any thread)."""
        return self._snapshot

    def problem(self) -> PolicyFileProblem | None:
        """Why the policy file on disk is not the policy in force, or None while it is (a reload is refused,
        the last good policy serves, and the next start would refuse the file: operators must see it)."""
        return self._problem

    def check(self) -> str | None:
        """Reload when the file changed: returns "success", "invalid", or None when nothing changed."""
        if self.path is None:
            return None
        fingerprint = _fingerprint(self.path)
        if fingerprint is None:
            self._note_missing()
            return None
        self._missing_since = None
        if fingerprint == self._fingerprint:
            return None
        self._fingerprint = fingerprint
        try:
            policy = load_policy(self.path)
        except PolicyError as exc:
            self._problem = PolicyFileProblem(self.path, fingerprint[3] / 1e9, str(exc), self._snapshot.generation)
            log.error(
                "policy reload refused; the last good policy (generation %d, hash %s) keeps serving: %s",
                self._snapshot.generation, self._snapshot.policy.hash, exc,
                extra={"file": exc.source, "path": exc.path, "constraint": exc.constraint},
            )
            if self._on_reload:
                self._on_reload("invalid", self._snapshot)
            return "invalid"
        generation = self._ledger.generation_for(policy.hash)
        self._problem = None  # the file is valid again (a fix, or a rollback to the policy in force)
        if policy.hash == self._snapshot.policy.hash and generation == self._snapshot.generation:
            return None
        self._snapshot = PolicySnapshot(policy, generation)
        log.info("policy reloaded: generation %d, hash %s", self._snapshot.generation, policy.hash)
        if self._on_reload:
            self._on_reload("success", self._snapshot)
        return "success"

    def _note_missing(self) -> None:
        """The file is gone: after ``missing_grace`` seconds it is a problem (logged once), not before."""
        if self._missing_since is None:
            self._missing_since = (time.time(), time.monotonic())
        if self._problem is not None and self._problem.missing:
            return
        since, first_seen = self._missing_since
        if time.monotonic() - first_seen < self.missing_grace:
            return
        assert self.path is not None
        self._problem = PolicyFileProblem(self.path, since, "file missing", self._snapshot.generation, missing=True)
        self._fingerprint = None  # whatever appears next is loaded and judged, even the same content
        log.error(
            "policy file %s missing since %s; the last good policy (generation %d, hash %s) keeps serving, "
            "but a restart would refuse to start",
            self.path, datetime.fromtimestamp(since, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            self._snapshot.generation, self._snapshot.policy.hash,
            extra={"file": str(self.path)},
        )

    def start(self) -> None:
        """Start the watching thread (no-op for the bundled policy or interval 0)."""
        if self.path is None or self.interval <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="policy-reload", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception:  # pragma: no cover - never let the watcher die
                log.exception("policy watcher failed; retrying")

    def stop(self) -> None:
        """Stop the watching thread."""
        self._stop.set()
