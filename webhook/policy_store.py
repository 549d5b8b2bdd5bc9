"""The policy in force, with hot reload: a valid new file takes effect, an invalid one is refused.

A ConfigMap volume updates its files by swapping the ``..data`` symlink, so the store compares the resolved
path, inode, size and modification time of the policy file every ``interval`` seconds (a daemon thread per
process). A valid new policy becomes current with the next generation number; an invalid one is logged with
file, path and constraint, reported to ``on_reload("invalid")``, and the last good policy keeps serving.
Swapping is one reference assignment: a request in flight keeps the policy it started with.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from webhook.policy import Policy, PolicyError, bundled_policy_path, load_policy

log = logging.getLogger("csinode_guard.policy")


@dataclass(frozen=True)
class PolicySnapshot:
    """The policy in force and its generation (1 for the first load, +1 per successful reload)."""

    policy: Policy
    generation: int


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
    on a broken policy). ``on_reload(result, snapshot)`` is called after every reload attempt.
    """

    def __init__(
        self,
        path: Path | None,
        interval: float = 5.0,
        on_reload: Callable[[str, PolicySnapshot], None] | None = None,
    ) -> None:
        self.path = path
        self.interval = interval
        self._on_reload = on_reload
        self._snapshot = PolicySnapshot(load_policy(path), 1)
        self._fingerprint = _fingerprint(path or bundled_policy_path())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def current(self) -> PolicySnapshot:
        """The snapshot in force (cheap; safe from any thread)."""
        return self._snapshot

    def check(self) -> str | None:
        """Reload when the file changed: returns "success", "invalid", or None when nothing changed."""
        if self.path is None:
            return None
        fingerprint = _fingerprint(self.path)
        if fingerprint is None or fingerprint == self._fingerprint:
            return None
        self._fingerprint = fingerprint
        try:
            policy = load_policy(self.path)
        except PolicyError as exc:
            log.error(
                "policy reload refused; the last good policy (generation %d, hash %s) keeps serving: %s",
                self._snapshot.generation, self._snapshot.policy.hash, exc,
                extra={"file": exc.source, "path": exc.path, "constraint": exc.constraint},
            )
            if self._on_reload:
                self._on_reload("invalid", self._snapshot)
            return "invalid"
        if policy.hash == self._snapshot.policy.hash:
            return None
        self._snapshot = PolicySnapshot(policy, self._snapshot.generation + 1)
        log.info("policy reloaded: generation %d, hash %s", self._snapshot.generation, policy.hash)
        if self._on_reload:
            self._on_reload("success", self._snapshot)
        return "success"

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
