"""The reconciler's write: lower a standing count through the apiserver, as the guard's own identity.

A repair is what kubelet does, as another writer: GET the CSINode, PUT it back whole with the lowered counts and
the ``resourceVersion`` it read (optimistic concurrency: a newer write makes the PUT fail with 409 Conflict, it
is never overwritten). On a conflict the object is read and judged again (``judge``), up to ``attempts`` times:
a newer write that lowered the count already needs nothing more; one that raised it again is judged like any
other. The PUT goes through every admission webhook, the guard's own among them, and is judged like any write
(the guard's ServiceAccount must be a writer the policy lists). A count is never raised
(:func:`webhook.admission.standing.lowered_object`). ``dry_run`` sends the same PUT with ``dryRun=All``: the
apiserver and every webhook judge it, nothing is stored. Writes are paced by a client-side token bucket. The
outcome carries the counts of the update's answer (what etcd holds after it), which the audit reports rather
than the target.

RBAC: ``get`` and ``update`` on ``storage.k8s.io`` ``csinodes`` (cluster-wide: CSINodes are cluster-scoped).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from webhook.admission.budget import IncreaseBudget
from webhook.admission.standing import lowered_object
from webhook.kube.kubeapi import CSINODES, ApiUnreachableError, KubeApiError, KubeClient

log = logging.getLogger("csinode_guard.repair")

FIELD_MANAGER = "csinode-guard-reconciler"
"""``fieldManager`` of the repairs (shows in the CSINode's managedFields)."""


class RepairResult(enum.StrEnum):
    """The outcome of one repair (the ``result`` label of ``csinode_guard_reconcile_repairs_total``)."""

    REPAIRED = "repaired"
    CONFLICT = "conflict"  # still conflicting after every attempt
    REFUSED = "refused"  # the apiserver or a webhook refused the write (403, 400, 422)
    ERROR = "error"  # no answer, or another error
    DRY_RUN = "dry-run"  # judged by the apiserver and the webhooks, not stored


@dataclass(frozen=True)
class RepairOutcome:
    """What one repair of the CSINode ``node`` did: ``lowered`` maps a driver to the count the PUT carried (empty
    when nothing was left to lower), ``stored`` each of those drivers to the count in the update's answer -- what
    etcd holds after a repair (or would, for a dry run), which admission may have lowered further (None:
    unbounded, or the entry is gone; empty unless the write was accepted) -- ``attempts`` PUTs sent, ``message``
    the apiserver's for a refusal or error."""

    node: str
    result: RepairResult | None
    lowered: Mapping[str, int]
    attempts: int
    message: str = ""
    stored: Mapping[str, int | None] = field(default_factory=dict)


def stored_counts(obj: Mapping[str, Any], drivers: Iterable[str]) -> dict[str, int | None]:
    """The ``allocatable.count`` of each of ``drivers`` in the CSINode JSON ``obj`` (matched by name; None when
    unbounded or absent)."""
    wanted = set(drivers)
    found: dict[str, int | None] = dict.fromkeys(wanted)
    for entry in ((obj.get("spec") or {}).get("drivers")) or []:
        if not isinstance(entry, Mapping) or entry.get("name") not in wanted:
            continue
        allocatable = entry.get("allocatable")
        count = allocatable.get("count") if isinstance(allocatable, Mapping) else None
        found[str(entry["name"])] = count if isinstance(count, int) and not isinstance(count, bool) else None
    return found


class RepairRateLimiter:
    """Client-side pacing of the repair writes: ``rate`` writes per second, ``burst`` at once (a token bucket).
    :meth:`wait` blocks until a write may be sent (or ``stop`` says to give up)."""

    def __init__(self, rate: float, burst: int) -> None:
        self._bucket = IncreaseBudget(rate, burst)

    def wait(self, stop: Callable[[], bool] = lambda: False) -> bool:
        """Take one token, sleeping as needed; False when ``stop()`` became true first."""
        while not stop():
            if self._bucket.take(1, time.monotonic()):
                return True
            time.sleep(min(0.05, 1.0 / self._bucket.rate))
        return False


def repair_csinode(
    client: KubeClient,
    node: str,
    judge: Callable[[Mapping[str, Any]], Mapping[str, int]],
    *,
    dry_run: bool = False,
    attempts: int = 3,
    limiter: RepairRateLimiter | None = None,
    stop: Callable[[], bool] = lambda: False,
) -> RepairOutcome:
    """Lower the counts of CSINode ``node`` that ``judge(obj)`` (the object read, its JSON) says to lower
    (driver -> count); GET + PUT with the object's resourceVersion, judged again after each 409 Conflict.

    Returns a :class:`RepairOutcome` whose ``result`` is None when nothing needed lowering (any more). Never
    raises for API errors: they are results.
    """
    sent = 0
    for _ in range(max(1, attempts)):
        try:
            obj = client.get(CSINODES, node)
        except KubeApiError as exc:
            if exc.not_found:
                return RepairOutcome(node, None, {}, sent)
            return RepairOutcome(node, RepairResult.ERROR, {}, sent, exc.message)
        except ApiUnreachableError as exc:
            return RepairOutcome(node, RepairResult.ERROR, {}, sent, str(exc))
        lowered_obj, lowered = lowered_object(obj, judge(obj))
        if not lowered:
            return RepairOutcome(node, None, {}, sent)
        if limiter is not None and not limiter.wait(stop):
            return RepairOutcome(node, None, {}, sent)
        sent += 1
        try:
            answer = client.replace(CSINODES, lowered_obj, dry_run=dry_run, field_manager=FIELD_MANAGER)
        except KubeApiError as exc:
            if exc.conflict:
                log.info("repair of %s: conflict (a newer write); reading it again", node)
                continue
            result = RepairResult.REFUSED if exc.code in (400, 403, 422) else RepairResult.ERROR
            return RepairOutcome(node, result, lowered, sent, exc.message)
        except ApiUnreachableError as exc:
            return RepairOutcome(node, RepairResult.ERROR, lowered, sent, str(exc))
        stored = stored_counts(answer if isinstance(answer, Mapping) else {}, lowered)
        return RepairOutcome(node, RepairResult.DRY_RUN if dry_run else RepairResult.REPAIRED, lowered, sent,
                             stored=stored)
    return RepairOutcome(node, RepairResult.CONFLICT, {}, sent, f"still conflicting after {sent} attempts")
