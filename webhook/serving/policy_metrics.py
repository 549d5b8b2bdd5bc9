"""The policy metrics of one replica, collected in gunicorn's master at scrape time.

Why in the master: every worker reloads the policy on its own, so counting reloads in the workers counted each
reload once per worker; and a multiprocess gauge keeps every label set it was ever given (its samples live in
the workers' metric files), so ``policy_info`` kept a 0-valued series for every earlier policy hash. The master
watches the same file with its own :class:`webhook.serving.live_policy.PolicyStore` (same generation ledger, so the same
generation numbers as the workers) and reports, per replica:

- ``csinode_guard_policy_info{hash,name}`` 1: one series, the policy in force;
- ``csinode_guard_policy_generation``: its generation;
- ``csinode_guard_policy_reloads_total{result}``: reload attempts, success|invalid, once per replica;
- ``csinode_guard_policy_file_invalid``: 1 while the file on disk is refused or missing (the last good policy
  serves, and the next start would refuse the file), else 0.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

from webhook.serving.live_policy import PolicySnapshot, PolicyStore

RELOAD_RESULTS = ("success", "invalid")


class PolicyCollector:
    """A prometheus_client collector over ``store`` (see the module docstring); call :meth:`on_reload` from the
    store's ``on_reload`` hook."""

    def __init__(self) -> None:
        self.store: PolicyStore | None = None
        self._reloads = dict.fromkeys(RELOAD_RESULTS, 0)
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _locked(self) -> threading.Lock:
        """The thread lock, made anew in a forked process (the parent's may have been held at the fork)."""
        if os.getpid() != self._pid:
            self._lock = threading.Lock()
            self._pid = os.getpid()
        return self._lock

    def on_reload(self, result: str, _snapshot: PolicySnapshot) -> None:
        """Count one reload attempt with ``result`` (success|invalid)."""
        with self._locked():
            self._reloads[result] = self._reloads.get(result, 0) + 1

    def collect(self) -> Iterator[Any]:
        """The four families of the module docstring (nothing before a store is attached)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # noqa: PLC0415

        store = self.store
        if store is None:
            return
        snapshot = store.current()
        info = GaugeMetricFamily("csinode_guard_policy_info", "The policy in force (one series, value 1).",
                                 labels=["hash", "name"])
        info.add_metric([snapshot.policy.hash, snapshot.policy.name], 1)
        yield info
        yield GaugeMetricFamily("csinode_guard_policy_generation",
                                "Generation of the policy in force (1 at start, +1 per successful reload).",
                                value=snapshot.generation)
        reloads = CounterMetricFamily("csinode_guard_policy_reloads",
                                      "Policy reload attempts of this replica by result (success|invalid).",
                                      labels=["result"])
        with self._locked():
            for result, count in self._reloads.items():
                reloads.add_metric([result], count)
        yield reloads
        yield GaugeMetricFamily("csinode_guard_policy_file_invalid",
                                "1 while the policy file is refused or missing (the last good policy serves; a "
                                "restart would refuse the file), else 0.",
                                value=1 if store.problem() is not None else 0)
