"""``csinode-guard preflight``: will mutable allocatable counts work in this cluster, component by component? Pure.

:func:`run_checks` judges :class:`~webhook.kube.preflight_facts.ClusterFacts` (gathered by
:mod:`webhook.kube.preflight_gather`, one request or LIST per kind) against the version matrix of docs/operations.md
(feature gate ``MutableCSINodeAllocatableCount``, KEP-4876: alpha 1.33, beta and off by default 1.34, on by default
1.35, GA 1.36), here, and the guard's own installation against what :mod:`webhook.kube.registration` registers, in
:mod:`webhook.kube.preflight_guard`. Each :class:`Check` is OK, WARN or FAIL with what to do; the exit code
is 0, 1 or 2 for the worst of them (:func:`exit_code`), so preflight can gate a rollout in CI.

Kubernetes facts used:

- The apiserver refuses an update of ``allocatable.count`` (``field is immutable``) when the gate is off; a
  server-side dry run (``dryRun=All``) of one CSINode's count tells whether it accepts them, whatever the version
  says (the gate can be turned off on 1.35, or on on 1.33). Admission webhooks run in a dry run too: a denial by
  a *mutating* webhook comes before the apiserver's validation and proves nothing.
- Version skew policy: a kubelet may be up to three minors older than the apiserver, never newer.
- kubelet writes a driver's count only when its CSIDriver sets ``nodeAllocatableUpdatePeriodSeconds``;
  kube-scheduler re-queues pods on a CSINode count change only with the feature.
"""

from __future__ import annotations

import textwrap
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from webhook.admission.policy import Policy
from webhook.admission.versions import VersionError, compare_versions, parse_version
from webhook.kube.preflight_facts import SEVERITY, Check, ClusterFacts, ProbeOutcome, Status
from webhook.kube.preflight_guard import check_guard

ALPHA_MINOR = 33
BETA_MINOR = 34
DEFAULT_ON_MINOR = 35
GA_MINOR = 36
KUBELET_MAX_SKEW = 3
"""Minors a kubelet may lag behind kube-apiserver (Kubernetes version skew policy since 1.28)."""
GATE = "MutableCSINodeAllocatableCount"


def minor_of(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a Kubernetes version (``v1.36.2``, ``v1.35.1-eks-1a2b3c``), None when unparsable."""
    try:
        parsed = parse_version(version)
    except VersionError:
        return None
    return parsed.major, parsed.minor


def _gate_status(minor: int) -> tuple[Status, str]:
    if minor < ALPHA_MINOR:
        return Status.FAIL, f"{GATE} does not exist before 1.33: counts are immutable"
    if minor == ALPHA_MINOR:
        return Status.WARN, f"{GATE} is alpha and off by default"
    if minor == BETA_MINOR:
        return Status.WARN, f"{GATE} is beta and off by default"
    if minor == DEFAULT_ON_MINOR:
        return Status.OK, f"{GATE} is beta and on by default"
    return Status.OK, f"{GATE} is GA"


def check_apiserver(facts: ClusterFacts) -> list[Check]:
    """The apiserver's version against the matrix, then the dry-run probe, which decides when it is conclusive."""
    checks: list[Check] = []
    if facts.server_version is None:
        checks.append(Check("kube-apiserver", f"/version: {facts.server_version_error or 'unreadable'}",
                            Status.FAIL, "check access to /version (any authenticated user may read it)"))
    else:
        parsed = minor_of(facts.server_version)
        if parsed is None:
            checks.append(Check("kube-apiserver", f"version {facts.server_version} is not a version", Status.WARN,
                                "compare it with the matrix in docs/operations.md by hand"))
        else:
            status, why = _gate_status(parsed[1])
            action = ""
            if status is Status.FAIL:
                action = "upgrade the control plane to 1.35 or later (1.33/1.34 with the gate enabled)"
            elif status is Status.WARN:
                action = f"enable --feature-gates={GATE}=true on kube-apiserver, kube-scheduler and kubelets"
            checks.append(Check("kube-apiserver", f"version {facts.server_version}: {why}", status, action))
    probe = facts.probe
    where = f" of {probe.target}" if probe.target else ""
    if probe.outcome is ProbeOutcome.ACCEPTED:
        checks.append(Check("kube-apiserver", f"dry-run count update{where}: accepted (dryRun=All)", Status.OK))
    elif probe.outcome is ProbeOutcome.REFUSED_AFTER_VALIDATION:
        checks.append(Check("kube-apiserver", f"dry-run count update{where}: passed validation (then refused "
                            f"by validating admission: {probe.detail})", Status.OK))
    elif probe.outcome is ProbeOutcome.IMMUTABLE:
        checks.append(Check("kube-apiserver", f"dry-run count update{where}: refused, counts are immutable: "
                            f"{probe.detail}", Status.FAIL,
                            f"turn {GATE} on for kube-apiserver (and kube-scheduler and the kubelets)"))
    elif probe.outcome is ProbeOutcome.REFUSED_BY_ADMISSION:
        checks.append(Check("kube-apiserver", f"dry-run count update{where}: inconclusive, a mutating webhook "
                            f"refused it before validation: {probe.detail}", Status.WARN,
                            "run preflight as a principal the guard's policy lists as a writer or exemption"))
    elif probe.outcome is ProbeOutcome.NO_CANDIDATE:
        checks.append(Check("kube-apiserver", "dry-run count update: no CSINode with a driver to probe",
                            Status.WARN, "rerun once a node has registered a CSI driver"))
    else:
        checks.append(Check("kube-apiserver", f"dry-run count update{where}: {probe.detail}", Status.WARN,
                            "grant update on csinodes to run the probe, or check the error"))
    return checks


def _server_minor(facts: ClusterFacts) -> tuple[int, int] | None:
    return minor_of(facts.server_version) if facts.server_version else None


def kubelet_versions(nodes: Sequence[Mapping[str, Any]]) -> Counter[str]:
    """Nodes per ``status.nodeInfo.kubeletVersion`` (``unknown`` when absent)."""
    found: Counter[str] = Counter()
    for node in nodes:
        info = ((node.get("status") or {}).get("nodeInfo") or {}) if isinstance(node, Mapping) else {}
        found[str(info.get("kubeletVersion") or "unknown")] += 1
    return found


def check_kubelets(facts: ClusterFacts) -> list[Check]:
    """Nodes per kubelet version: too old for the feature, or skewed beyond the policy, or needing the gate."""
    versions = kubelet_versions(facts.nodes)
    if not versions:
        return [Check("kubelet", "no Nodes", Status.WARN, "nothing to check until nodes join")]
    server = _server_minor(facts)
    checks = []
    for version, count in sorted(versions.items(), key=lambda kv: (minor_of(kv[0]) or (0, 0), kv[0])):
        nodes = f"{count} node{'s' if count != 1 else ''}"
        parsed = minor_of(version)
        if parsed is None:
            checks.append(Check("kubelet", f"{nodes} at {version}", Status.WARN, "check these nodes' kubelets"))
            continue
        status, why = _gate_status(parsed[1])
        action = ""
        if status is Status.FAIL:
            why, action = "too old: never updates counts", "upgrade these nodes (1.35 or later)"
        elif status is Status.WARN:
            action = f"enable --feature-gates={GATE}=true on these kubelets"
        if server is not None:
            if parsed > server:
                status, why = Status.FAIL, f"newer than kube-apiserver {server[0]}.{server[1]} (unsupported skew)"
                action = "upgrade the control plane before the nodes"
            elif server[0] == parsed[0] and server[1] - parsed[1] > KUBELET_MAX_SKEW:
                status = Status.FAIL
                why = f"{server[1] - parsed[1]} minors behind kube-apiserver (at most {KUBELET_MAX_SKEW})"
                action = "upgrade these nodes"
        checks.append(Check("kubelet", f"{nodes} at {version}: {why}", status, action))
    return checks


def check_scheduler(facts: ClusterFacts) -> list[Check]:
    """kube-scheduler's version (its pods, or ``--scheduler-version``): without the feature it never re-queues
    pods on a CSINode count change."""
    if not facts.scheduler_versions:
        return [Check("kube-scheduler", "version not found (no kube-scheduler pods in kube-system)", Status.WARN,
                      "pass --scheduler-version (managed control planes hide the scheduler)")]
    server = _server_minor(facts)
    checks = []
    for version in sorted(set(facts.scheduler_versions)):
        parsed = minor_of(version)
        if parsed is None:
            checks.append(Check("kube-scheduler", f"{version} ({facts.scheduler_source}) is not a version",
                                Status.WARN, "check the scheduler by hand"))
            continue
        status, why = _gate_status(parsed[1])
        action = ""
        if status is Status.FAIL:
            action = "upgrade kube-scheduler: without the feature it never re-queues pods on a count change"
        elif status is Status.WARN:
            action = f"enable --feature-gates={GATE}=true on kube-scheduler"
        if server is not None and parsed > server:
            status, why, action = Status.FAIL, "newer than kube-apiserver", "upgrade kube-apiserver first"
        checks.append(Check("kube-scheduler", f"{version} ({facts.scheduler_source}): {why}", status, action))
    return checks


def check_drivers(facts: ClusterFacts, policy: Policy) -> list[Check]:
    """Per CSIDriver: ``nodeAllocatableUpdatePeriodSeconds`` set, and its node-plugin versions (the policy's
    version source) against the policy's ``minVersion``."""
    if not facts.csidrivers:
        return [Check("CSIDriver", "no CSIDriver objects", Status.WARN,
                      "install the CSI drivers (and their CSIDriver objects) whose counts should move")]
    checks = []
    for obj in sorted(facts.csidrivers, key=lambda o: str((o.get("metadata") or {}).get("name") or "")):
        name = str((obj.get("metadata") or {}).get("name") or "")
        period = (obj.get("spec") or {}).get("nodeAllocatableUpdatePeriodSeconds")
        component = f"CSIDriver {name}"
        if isinstance(period, int) and not isinstance(period, bool):
            checks.append(Check(component, f"nodeAllocatableUpdatePeriodSeconds: {period}", Status.OK))
        else:
            checks.append(Check(component, "nodeAllocatableUpdatePeriodSeconds unset: kubelet never updates this "
                                "driver's count", Status.WARN,
                                f"set spec.nodeAllocatableUpdatePeriodSeconds (>= 10) on CSIDriver {name} once its "
                                "node plugin supports it"))
        checks.extend(_driver_version_checks(facts, policy, name, component))
    return checks


def _driver_version_checks(facts: ClusterFacts, policy: Policy, name: str, component: str) -> list[Check]:
    driver_policy = policy.for_driver(name)
    source = facts.version_sources.get(name, driver_policy.version_source.type)
    versions = facts.driver_versions.get(name) or {}
    minimum = driver_policy.min_version
    if not versions:
        if minimum is None:
            return []
        return [Check(component, f"node-plugin versions: none found ({source})", Status.WARN,
                      f"configure the policy's versionSource so the guard can enforce minVersion {minimum}")]
    listed = ", ".join(f"{v} on {n} node{'s' if n != 1 else ''}" for v, n in sorted(versions.items()))
    if minimum is None:
        return [Check(component, f"node-plugin versions ({source}): {listed}", Status.OK)]
    old = []
    for version, nodes in sorted(versions.items()):
        try:
            if compare_versions(version, minimum) < 0:
                old.append(f"{version} on {nodes}")
        except VersionError:
            old.append(f"{version} (not a version) on {nodes}")
    if old:
        return [Check(component, f"node-plugin versions ({source}): {listed}; below minVersion {minimum}: "
                      f"{', '.join(old)}", Status.WARN,
                      f"upgrade the driver's node plugin to {minimum} or later; the guard refuses counts from "
                      "older ones")]
    return [Check(component, f"node-plugin versions ({source}): {listed}; all >= minVersion {minimum}", Status.OK)]


def run_checks(facts: ClusterFacts, policy: Policy) -> list[Check]:
    """Every check, in the order of the upgrade plan: apiserver, kubelets, scheduler, drivers, the guard.
    ``facts.errors`` (component -> why a read failed) become WARN rows."""
    checks = check_apiserver(facts)
    checks += check_kubelets(facts) if "kubelet" not in facts.errors else []
    checks += check_scheduler(facts)
    checks += check_drivers(facts, policy) if "CSIDriver" not in facts.errors else []
    checks += check_guard(facts)
    checks += [Check(component, f"could not read: {why}", Status.WARN, "grant the missing read permission")
               for component, why in sorted(facts.errors.items())]
    return checks


def exit_code(checks: Sequence[Check]) -> int:
    """0 when every check is OK, 1 when the worst is WARN, 2 when any FAILs."""
    return max((SEVERITY[c.status] for c in checks), default=0)


TABLE_WIDTH = 120
"""Columns of the table when the caller gives no terminal width."""
MIN_TEXT_WIDTH = 16
"""The narrowest the CHECKED and ACTION columns get, however narrow the terminal."""
_GAP = "   "


def format_checks(checks: Sequence[Check], width: int | None = TABLE_WIDTH) -> str:
    """kubectl-like columns COMPONENT, STATUS, CHECKED, ACTION, and a closing count line.

    ``width`` (the terminal's columns): CHECKED and ACTION are wrapped at word boundaries so that every line
    fits (continuation lines leave STATUS empty; COMPONENT wraps too on a narrow terminal); no text is cut.
    ``None`` (``-o wide``): one line per check, however long.
    """
    header = ["COMPONENT", "STATUS", "CHECKED", "ACTION"]
    rows = [[c.component, str(c.status), c.checked, c.action or "-"] for c in checks]
    longest = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    status_width = longest[1]
    if width is None:
        component_width, checked_width, action_width = longest[0], longest[2], longest[3]
    else:
        spare = width - status_width - 3 * len(_GAP) - 2 * MIN_TEXT_WIDTH
        word = max(len(w) for r in rows for w in r[0].split()) if rows else MIN_TEXT_WIDTH
        component_width = min(longest[0], max(word, min(spare, width // 3)))
        room = max(2 * MIN_TEXT_WIDTH, width - component_width - status_width - 3 * len(_GAP))
        action_width = min(longest[3], max(MIN_TEXT_WIDTH, room * 2 // 5))
        checked_width = max(MIN_TEXT_WIDTH, room - action_width)
    widths = (component_width, status_width, checked_width)
    out = [_line(header, widths)]
    for row in rows:
        columns = [_wrap(row[0], component_width if width is not None else None), [row[1]],
                   _wrap(row[2], checked_width if width is not None else None),
                   _wrap(row[3], action_width if width is not None else None)]
        for index in range(max(len(column) for column in columns)):
            out.append(_line([column[index] if index < len(column) else "" for column in columns], widths))
    totals = Counter(c.status for c in checks)
    out.append("")
    out.append(f"{totals[Status.OK]} OK, {totals[Status.WARN]} WARN, {totals[Status.FAIL]} FAIL")
    return "\n".join(out) + "\n"


def _line(cells: Sequence[str], widths: Sequence[int]) -> str:
    return _GAP.join([*(cell.ljust(w) for cell, w in zip(cells[:3], widths, strict=True)), cells[3]]).rstrip()


def _wrap(text: str, width: int | None) -> list[str]:
    """``text`` in lines of at most ``width`` characters, broken at spaces (a longer word, such as a URL, is
    split); one line when ``width`` is None."""
    if width is None:
        return [text]
    return textwrap.wrap(text, width, break_on_hyphens=False) or [""]
