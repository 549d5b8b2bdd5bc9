"""Prometheus metrics of the registration mode the in-cluster caBundle keeper chose (one call or two).

Set by the serving master process (:mod:`webhook.serving.cluster_certs`), every replica alike: each checks the
other mutators on its own pass, so ``max`` over the replicas reads the cluster's mode.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from webhook.kube.one_call import VALIDATION_MODES
from webhook.kube.watch.metrics import fork_safe

VALIDATION_MODE = Gauge(
    "csinode_guard_validation_mode",
    "1 for the validation mode the guard's ValidatingWebhookConfiguration is kept in (cel: one call per "
    "kubelet write; webhook: two calls), else 0.",
    ["mode"],
    multiprocess_mode="livemax",
)
VALIDATION_MODE_SWITCHES = Counter(
    "csinode_guard_validation_mode_switches",
    "Times this replica switched the ValidatingWebhookConfiguration between one call (cel) and two (webhook), "
    "by the mode switched to.",
    ["mode"],
)


def record_mode(mode: str, switched: bool) -> None:
    """Set :data:`VALIDATION_MODE` to ``mode`` (``webhook`` or ``cel``); count a switch when ``switched``."""
    with fork_safe():  # set in the gunicorn master's caBundle keeper thread
        for known in VALIDATION_MODES:
            VALIDATION_MODE.labels(mode=known).set(1 if known == mode else 0)
        if switched:
            VALIDATION_MODE_SWITCHES.labels(mode=mode).inc()
