"""What each replica serves, and the GuardPolicy status made of it (Gatekeeper's ``byPod`` is the model).

Every replica reports in a Lease of its own (``coordination.k8s.io/v1``, in the guard's namespace, labelled
``csinode-guard.io/policy-report: <GuardPolicy name>``): its identity in ``spec.holderIdentity``, renewed in
``spec.renewTime``, and in annotations the generation it serves, that policy's hash, where its policy comes from
and why it refused the newest generation, if it did. A replica writes its Lease when that report changes and
renews it every :data:`REPORT_RENEW` seconds: a handful of writes per replica per minute, none per admission
request. The replica holding the policy-status Lease reads the reports (one list) and writes the GuardPolicy's
``status`` when it differs from what is stored (:func:`guardpolicy_status`); a report not renewed for
:data:`REPORT_EXPIRY` seconds (a replica gone) is left out.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from webhook.admission.policy import Policy, PolicyError

REPORT_LABEL = "csinode-guard.io/policy-report"
GENERATION_ANNOTATION = "csinode-guard.io/served-generation"
HASH_ANNOTATION = "csinode-guard.io/served-policy-hash"
SOURCE_ANNOTATION = "csinode-guard.io/policy-source"
ERROR_ANNOTATION = "csinode-guard.io/policy-error"
REPORTED_AT_ANNOTATION = "csinode-guard.io/reported-at"
REPORT_RENEW = 30.0
"""Seconds between renewals of a replica's report Lease when nothing changed."""
REPORT_EXPIRY = 90.0
"""Seconds after its last renewal that a replica's report no longer counts (its ``leaseDurationSeconds``)."""


@dataclass(frozen=True)
class ReplicaReport:
    """What one replica serves: ``generation`` (0: none of this GuardPolicy's), ``policy_hash``, ``source``
    (``guardpolicy/NAME generation G`` or the bundled default), ``error`` (why it refused a newer generation)."""

    replica: str
    generation: int
    policy_hash: str
    source: str
    error: str = ""
    reported_at: str = ""


def report_lease_name(replica: str) -> str:
    """The report Lease's name for ``replica``: ``csinode-guard-policy-<replica>`` made a DNS subdomain."""
    cleaned = re.sub(r"[^a-z0-9.-]+", "-", replica.lower()).strip("-.") or "replica"
    return f"csinode-guard-policy-{cleaned}"[:253].rstrip("-.")


def _micro_time(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def report_lease(namespace: str, guardpolicy: str, report: ReplicaReport, now: datetime,
                 base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The report Lease of ``report`` at ``now`` (``base``: the Lease read, whose metadata it keeps)."""
    metadata = dict((base or {}).get("metadata") or {})
    metadata.update({"name": report_lease_name(report.replica), "namespace": namespace})
    metadata["labels"] = {**(metadata.get("labels") or {}), REPORT_LABEL: guardpolicy,
                          "app.kubernetes.io/name": "csinode-guard"}
    metadata["annotations"] = {
        **(metadata.get("annotations") or {}),
        GENERATION_ANNOTATION: str(report.generation),
        HASH_ANNOTATION: report.policy_hash,
        SOURCE_ANNOTATION: report.source,
        ERROR_ANNOTATION: report.error[:1024],
        REPORTED_AT_ANNOTATION: report.reported_at,
    }
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": metadata,
        "spec": {
            "holderIdentity": report.replica,
            "leaseDurationSeconds": int(REPORT_EXPIRY),
            "renewTime": _micro_time(now),
        },
    }


def _parse_time(text: str) -> datetime | None:
    for fmt in ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return datetime.strptime(text, fmt).replace(tzinfo=UTC)
        except ValueError:
            continue
    return None


def live_reports(leases: Sequence[Mapping[str, Any]], now: datetime) -> list[ReplicaReport]:
    """The reports of the Leases renewed within their ``leaseDurationSeconds`` of ``now``, by replica name."""
    out = []
    for lease in leases:
        spec = lease.get("spec") or {}
        renewed = _parse_time(str(spec.get("renewTime") or ""))
        duration = float(spec.get("leaseDurationSeconds") or REPORT_EXPIRY)
        if renewed is None or (now - renewed).total_seconds() > duration:
            continue
        notes = (lease.get("metadata") or {}).get("annotations") or {}
        try:
            generation = int(notes.get(GENERATION_ANNOTATION) or 0)
        except ValueError:
            generation = 0
        out.append(ReplicaReport(
            replica=str(spec.get("holderIdentity") or ""),
            generation=generation,
            policy_hash=str(notes.get(HASH_ANNOTATION) or ""),
            source=str(notes.get(SOURCE_ANNOTATION) or ""),
            error=str(notes.get(ERROR_ANNOTATION) or ""),
            reported_at=str(notes.get(REPORTED_AT_ANNOTATION) or ""),
        ))
    return sorted(out, key=lambda r: r.replica)


def enforcement_summary(policy: Policy) -> str:
    """The rules' enforcement actions counted, most severe first: ``deny 4, clamp 1, warn 1`` (the rules'
    settings for drivers the policy does not name), ``(scoped)`` appended when ``enforcementScope`` limits
    enforcement to some nodes."""
    rules = policy.default_driver.rules
    actions = [rules.identity_action, rules.version_action, rules.ceiling_action, rules.rollback_action,
               rules.rate_action, rules.integrity_action]
    counts = {a: sum(1 for x in actions if x.value == a) for a in ("deny", "clamp", "warn", "dryrun")}
    text = ", ".join(f"{a} {n}" for a, n in counts.items() if n)
    return text + (" (scoped)" if policy.scope_match_labels is not None else "")


def _condition(kind: str, status: str, reason: str, message: str, generation: int, now: datetime,
               previous: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    before = previous.get(kind) or {}
    same = before.get("status") == status
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": str(before.get("lastTransitionTime")) if same and before.get("lastTransitionTime")
        else now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def guardpolicy_status(obj: Mapping[str, Any], judged: Policy | PolicyError, reports: Sequence[ReplicaReport],
                       now: datetime) -> dict[str, Any]:
    """The ``status`` of GuardPolicy ``obj``: ``judged`` is its policy, or why the guard refuses it; ``reports``
    the replicas' live reports. Conditions keep their ``lastTransitionTime`` while their status stays."""
    generation = int((obj.get("metadata") or {}).get("generation") or 0)
    old = obj.get("status") or {}
    previous = {str(c.get("type")): c for c in old.get("conditions") or [] if isinstance(c, Mapping)}
    serving = [r for r in reports if r.generation == generation]
    status: dict[str, Any] = {"observedGeneration": generation}
    if isinstance(judged, PolicyError):
        accepted = _condition("Accepted", "False", "Invalid", f"at {judged.path or '(document)'}: "
                              f"{judged.constraint}", generation, now, previous)
        status["policyHash"] = ""
        status["enforcement"] = str(old.get("enforcement") or "")
    else:
        accepted = _condition("Accepted", "True", "Valid", f"policy hash {judged.hash}", generation, now, previous)
        status["policyHash"] = judged.hash
        status["enforcement"] = enforcement_summary(judged)
    if not reports:
        enforced = _condition("Enforced", "Unknown", "NoReports", "no replica has reported what it serves",
                              generation, now, previous)
    elif isinstance(judged, PolicyError):
        others = sorted({r.generation for r in reports})
        enforced = _condition("Enforced", "False", "Refused", "replicas keep serving the last good policy "
                              f"(generation {', '.join(map(str, others))})", generation, now, previous)
    elif len(serving) == len(reports):
        enforced = _condition("Enforced", "True", "AllReplicas", f"{len(reports)} of {len(reports)} replicas "
                              f"serve generation {generation}", generation, now, previous)
    else:
        behind = ", ".join(f"{r.replica} serves {r.generation or 'another policy'}" for r in reports
                           if r.generation != generation)
        enforced = _condition("Enforced", "False", "Pending", f"{len(serving)} of {len(reports)} replicas serve "
                              f"generation {generation}; {behind}", generation, now, previous)
    status["replicas"] = f"{len(serving)}/{len(reports)}"
    status["conditions"] = [accepted, enforced]
    status["byPod"] = [
        {k: v for k, v in {
            "id": r.replica, "observedGeneration": r.generation, "policyHash": r.policy_hash, "source": r.source,
            "error": r.error, "reportedAt": r.reported_at,
        }.items() if v != ""}
        for r in reports
    ]
    return status
