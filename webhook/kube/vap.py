"""A ValidatingAdmissionPolicy floor: the history-free part of a GuardPolicy, in CEL inside the apiserver.

:func:`build_vap_objects` turns a loaded :class:`~webhook.admission.policy.Policy` into an
``admissionregistration.k8s.io/v1`` ValidatingAdmissionPolicy and its ValidatingAdmissionPolicyBinding (GA since
Kubernetes 1.30). The apiserver evaluates them itself, so they keep holding when the guard is down, unreachable
or removed with ``csinode-guard unregister``. They enforce, per driver and only where the policy's enforcement
action for the rule is ``deny`` or ``clamp``:

- ``count-ceiling``: no bounded -> unbounded change (``allocatable`` or its ``count`` dropped), no increase to
  2147483647 (kubelet's int32 cut-off), no increase above the driver's *highest possible* ceiling (the largest
  value :meth:`~webhook.admission.policy.Ceiling.resolve` can return for any node), no increase larger than
  ``maxStepUp`` (``oldObject`` holds the old count);
- ``writer-identity``: counts change only by the node's own kubelet (``system:node:<CSINode name>`` in group
  ``system:nodes``) or the policy's ``writers``.

The boundary is the webhooks' (:mod:`webhook.kube.registration`): only UPDATE, and only when a driver present in both
objects changes its count -- present in both means the same registration: same ``name``, ``nodeID`` and
``topologyKeys`` (:func:`webhook.kube.registration.same_entry`). CREATE, DELETE, a driver registration (a name only in
``object``, or an entry rewritten with another ``nodeID``/``topologyKeys``) and a removal (a name only in
``oldObject``) never match, so the floor can never keep a kubelet from registering a driver. The
guard may *clamp* a registration's count; a ValidatingAdmissionPolicy cannot patch, so it lets registrations
pass.

Justifications: a driver's new count passes the writer check and ``maxStepUp`` only when an entry of the
``csinode-guard.io/justification`` annotation names that driver, covers the count (``minCount`` <= count <=
``maxCount``) and expires after the request (CEL ``timestamp()``; the request's time is the latest ``time`` of the
object's managedFields, which the apiserver sets for the writer before admission). Nothing else lifts a check: not
an expired or non-covering entry, not an approval recorded in the guard's state (which ``restore`` leaves behind and
which CEL cannot verify). Who set the annotation is checked when it is set: a write that adds or changes it (with
or without a count change) is refused unless a justifier the policy lists makes it, as the guard refuses it.

The floor must never refuse what the guard admits (it runs after the guard's mutating webhook, on the clamped
object). Hence: a decrease, and unbounded -> bounded, are never judged by the count checks (the guard softens
them); the policy's ``exemptions`` skip the floor; a policy with ``enforcementScope`` (a canary on Node labels,
which CEL cannot read) gets a binding that only warns and audits. The cases where it is stricter: a justification
entry it cannot read (a key given twice, a time outside the RFC 3339 forms of :data:`RFC3339_RE`, 29 February)
or an annotation over :data:`MAX_JUSTIFICATION_BYTES` lifts nothing. Drivers are matched by name, never by index
(kubelet re-appends the driver it updates).

Every expression is written never to fail on an object the apiserver can produce: ``spec.drivers`` is ``null``
on a CSINode without drivers, ``allocatable`` and ``allocatable.count`` are absent when unbounded, and
``metadata.annotations`` is absent when empty. With ``failurePolicy: Fail`` an error would refuse the write.

This module is pure: no I/O, no kubernetes import.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import yaml

from webhook.admission.csinode import INT32_MAX
from webhook.admission.justification import JUSTIFICATION_ANNOTATION
from webhook.admission.policy import Ceiling, DriverPolicy, EnforcementAction, Policy, Principals
from webhook.kube.registration import UPDATE_ONLY_CONDITION_NAME, UPDATE_ONLY_EXPRESSION, same_entry

VAP_NAME: Final = "csinode-guard-floor"
"""``metadata.name`` of the ValidatingAdmissionPolicy and of its binding."""

LABELS: Final[Mapping[str, str]] = {
    "app.kubernetes.io/name": "csinode-guard",
    "app.kubernetes.io/component": "admission-policy",
}
"""Labels on both objects: not the webhook configurations' component (the install applies those last)."""

ENFORCING: Final = frozenset({EnforcementAction.DENY, EnforcementAction.CLAMP})
"""Enforcement actions under which the guard never admits a violating count unchanged."""

NOT_EXPRESSED: Final = (
    "writer-version: needs the driver's version on the node (a cluster lookup) and the version of the last "
    "accepted change (history)",
    "count-rollback: needs the last correction and freeze from the guard's signed state (history)",
    "change-rate: needs the time of the last accepted change (history) and a cluster-wide budget",
    "state-integrity: needs the HMAC state key, which must not be in the apiserver's configuration",
    "count-ceiling per node label (instance type, profiles): needs the Node's labels (a cluster lookup); the "
    "floor uses each driver's highest possible ceiling instead",
    "justifications: the floor reads csinode-guard.io/justification itself (an unexpired entry covering the new "
    "count lifts writer-identity and maxStepUp; setting it needs a justifier); it cannot verify the signed state, "
    "so an approval recorded there lifts nothing",
    "registrations (a driver that appears): the guard may clamp their count; a ValidatingAdmissionPolicy cannot "
    "patch, and must never refuse one",
    "enforcementScope (canary on Node labels): CEL cannot read the Node; a scoped policy's binding only warns "
    "and audits",
    "unbounded -> bounded (even to 2147483647) and decreases: the safe direction; the guard clamps or warns, the "
    "floor lets them pass",
    "exemptions (break glass): the floor skips the policy's exempt principals, as the guard never blocks them",
)
"""The policy's parts the floor leaves to the guard, and why (printed as a comment above the objects)."""


def cel_string(value: str) -> str:
    """A CEL string literal for ``value`` (double-quoted; JSON escapes are valid CEL escapes)."""
    return json.dumps(value)


def _cel_list(values: Iterable[str]) -> str:
    return "[" + ", ".join(cel_string(v) for v in sorted(values)) + "]"


def highest_ceiling(ceiling: Ceiling) -> int | None:
    """The largest count :meth:`Ceiling.resolve` can return for any node, or None when some node has none.

    Without a node label only ``max`` applies. With one, every listed value, pattern, profile entry and the
    fallback (``unknown``, else the profile's default) are candidates, each capped at ``max``; a node whose label
    value is unlisted gets no ceiling unless a fallback or ``max`` exists.
    """
    label = ceiling.node_label or (ceiling.profile.node_label if ceiling.profile else None)
    candidates: list[int | None] = []
    if label:
        candidates.extend(ceiling.values.values())
        candidates.extend(p.ceiling for p in ceiling.patterns)
        if ceiling.profile is not None:
            candidates.extend(ceiling.profile.ceilings.values())
            candidates.extend(p.ceiling for p in ceiling.profile.patterns)
        fallback = ceiling.unknown
        if fallback is None and ceiling.profile is not None:
            fallback = ceiling.profile.default
        candidates.append(fallback)
    else:
        candidates.append(None)
    if ceiling.max is not None:
        return max(ceiling.max if c is None else min(c, ceiling.max) for c in candidates)
    if any(c is None for c in candidates):
        return None
    return max(c for c in candidates if c is not None)


@dataclass(frozen=True)
class DriverFloor:
    """What the floor enforces for one driver (``*`` for drivers the policy does not name).

    ``ceiling``/``max_step_up`` are None when not enforced; ``count_checks`` covers the bounded -> unbounded and
    int32-max checks (count-ceiling's action); ``writer_identity`` is writer-identity's.
    """

    driver: str
    count_checks: bool
    ceiling: int | None
    max_step_up: int | None
    writer_identity: bool


def driver_floor(driver_policy: DriverPolicy) -> DriverFloor:
    """The :class:`DriverFloor` of one driver's effective policy."""
    rules = driver_policy.rules
    counts = rules.ceiling_action in ENFORCING
    return DriverFloor(
        driver=driver_policy.driver,
        count_checks=counts,
        ceiling=highest_ceiling(driver_policy.ceiling) if counts else None,
        max_step_up=driver_policy.max_step_up if counts else None,
        writer_identity=rules.identity_action in ENFORCING,
    )


def driver_floors(policy: Policy) -> tuple[list[DriverFloor], DriverFloor]:
    """The floors of the drivers the policy names (sorted by name) and the default one."""
    named = [driver_floor(policy.drivers[name]) for name in sorted(policy.drivers)]
    return named, driver_floor(policy.default_driver)


# --- CEL building blocks -------------------------------------------------------------------------------------


def _drivers(obj: str) -> str:
    # spec.drivers is null (not []) on a CSINode without drivers: test the type too, never call exists() on null.
    return (
        f"has({obj}.spec) && has({obj}.spec.drivers) && type({obj}.spec.drivers) == list "
        f"? {obj}.spec.drivers : []"
    )


_SAME: Final = same_entry("o", "d")
"""Old entry ``o`` and new entry ``d`` are one registration (name, nodeID, topologyKeys), as the webhooks pair them."""


def _count(d: str) -> str:
    """``[count]`` when bounded, ``[]`` when unbounded (no allocatable or no count)."""
    return f"(has({d}.allocatable) && has({d}.allocatable.count) ? [{d}.allocatable.count] : [])"


def _principal_test(principals: Principals) -> str:
    parts: list[str] = []
    users = set(principals.users) | {
        "system:serviceaccount:" + sa.replace("/", ":", 1) for sa in principals.service_accounts
    }
    if users:
        parts.append(f"request.userInfo.username in {_cel_list(users)}")
    if principals.groups:
        parts.append(f"request.userInfo.groups.exists(g, g in {_cel_list(principals.groups)})")
    return " || ".join(parts) if parts else "false"


def _int_map(floors: Sequence[DriverFloor], attribute: str) -> str:
    """A CEL map literal driver -> int attribute of the named drivers' floors (-1 where it is off)."""
    items = [f"{cel_string(f.driver)}: {-1 if getattr(f, attribute) is None else getattr(f, attribute)}"
             for f in floors]
    return "{" + ", ".join(items) + "}"


def _int_check(attribute: str, default: DriverFloor, variable: str, holds: str) -> str:
    """``holds`` (with ``LIMIT`` for the driver's value) for ``d``: named drivers from ``variables.<variable>``
    (-1 = off), the others with the default's value (``true`` when the default is off)."""
    fallback = getattr(default, attribute)
    limit = f"variables.{variable}[d.name]"
    named = f"({limit} < 0 || {holds.replace('LIMIT', limit)})"
    other = "true" if fallback is None else holds.replace("LIMIT", str(fallback))
    return f"(d.name in variables.{variable} ? {named} : {other})"


def _bool_param(floors: Sequence[DriverFloor], default: DriverFloor, attribute: str) -> str:
    """``d.name in [on...]`` or ``!(d.name in [off...])`` for a bool attribute of the floors."""
    if getattr(default, attribute):
        off = [f.driver for f in floors if not getattr(f, attribute)]
        return f"!(d.name in {_cel_list(off)})" if off else "true"
    on = [f.driver for f in floors if getattr(f, attribute)]
    return f"d.name in {_cel_list(on)}" if on else "false"


def _guarded(condition: str, check: str) -> str:
    """``check`` where ``condition`` (per driver) holds; the condition left out when it is always true."""
    return check if condition == "true" else f"!({condition}) || {check}"


# --- justifications, read in CEL ----------------------------------------------------------------------------
# The apiserver's CEL has no JSON decoder: the annotation's entries are read with RE2 (Kubernetes' regex library
# ``find``/``findAll`` and the strings extension's ``split``). A key must appear exactly once in an entry and its
# value must have the shape below, else the entry lifts nothing (the floor is then stricter than the guard, never
# more lenient). The time pattern admits only times CEL's ``timestamp()`` parses (Go's RFC 3339 parser checks the
# day of the month; 29 February is left out, so no leap-year check is needed) so that no expression can fail.

BOUNDED_D: Final = "(has(d.allocatable) && has(d.allocatable.count))"
MAX_JUSTIFICATION_BYTES: Final = 16384
"""A longer justification annotation lifts nothing in the floor: reading it would exceed the apiserver's CEL cost
limit per expression (measured on v1.36.2: about 15 KB and 100 entries pass, 45 KB exceed it), and an error would
refuse the write anyway. ``size()`` counts code points; the limit is meant in bytes for ASCII JSON."""
_WS: Final = r"[ \t\n\r]*"
ENTRY_RE: Final = r'\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}'
"""One JSON object of the annotation's list (strings may hold braces and escaped quotes)."""
RFC3339_RE: Final = (
    r"[12][0-9]{3}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    r"|02-(?:0[1-9]|1[0-9]|2[0-8]))T(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,9})?"
    r"(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
)
"""The RFC 3339 times the floor reads in ``expires`` (years 1000-2999)."""


def _key(name: str) -> str:
    return f'"{name}"{_WS}:'


_DRIVER_RE: Final = _key("driver") + _WS + r'"[^"\\]+"'
_EXPIRES_RE: Final = _key("expires") + _WS + '"' + RFC3339_RE + '"'


def _count_re(name: str) -> str:
    return _key(name) + _WS + "[0-9]{1,10}" + _WS + "[,}]"


def _well_formed(e: str) -> str:
    parts = []
    for name, value in (("driver", _DRIVER_RE), ("minCount", _count_re("minCount")),
                        ("maxCount", _count_re("maxCount")), ("expires", _EXPIRES_RE)):
        parts.append(f"{e}.findAll({cel_string(_key(name))}).size() == 1 && {e}.find({cel_string(value)}) != ''")
    return " && ".join(parts)


def _string_value(e: str, pattern: str) -> str:
    return f"{e}.find({cel_string(pattern)}).split('\"')[3]"


def _int_value(e: str, name: str) -> str:
    return f"int({e}.find({cel_string(_count_re(name))}).find('[0-9]{{1,10}}'))"


REQUEST_TIMES: Final = (
    "has(object.metadata.managedFields) ? object.metadata.managedFields.filter(f, has(f.time))"
    ".map(f, timestamp(string(f.time))) : []"
)
"""The request's time, as the apiserver records it: it sets the ``time`` of the managedFields entry of the manager
whose fields a write changes to the current time (to the second) before admission, so the latest entry is no
earlier than the request. A writer can add entries, but only later ones, which expire more."""

APPROVALS: Final = (
    f"variables.justifications.filter(e, {_well_formed('e')} && variables.requestTimes.size() > 0 && "
    f"variables.requestTimes.all(t, t < timestamp({_string_value('e', _EXPIRES_RE)})))"
)
"""The annotation's entries that are well formed and expire after the request."""

JUSTIFIED: Final = (
    f"({BOUNDED_D} && variables.approvals.exists(e, {_string_value('e', _DRIVER_RE)} == d.name && "
    f"{_int_value('e', 'minCount')} <= d.allocatable.count && d.allocatable.count <= {_int_value('e', 'maxCount')}))"
)
"""Driver entry ``d``'s new count is covered by an unexpired justification for its driver."""


def _validations(floors: Sequence[DriverFloor], default: DriverFloor) -> list[dict[str, Any]]:
    validations: list[dict[str, Any]] = []
    counts = _bool_param(floors, default, "count_checks")
    if counts != "false":
        validations.append({
            # A changed entry that is unbounded now was bounded before (both unbounded would be no change).
            "expression": f"variables.changed.all(d, {_guarded(counts, BOUNDED.format(d='d'))})",
            "message": "csinode-guard floor [count-ceiling]: a driver's count was removed (unbounded) after being "
            "bounded; fix the driver's NodeGetInfo max_volumes_per_node",
            "reason": "Forbidden",
        })
        validations.append({
            "expression": f"variables.increases.all(d, {_guarded(counts, f'd.allocatable.count != {INT32_MAX}')})",
            "message": f"csinode-guard floor [count-ceiling]: {INT32_MAX} is kubelet's cut-off for an overflowing "
            "NodeGetInfo value, not a volume limit",
            "reason": "Forbidden",
        })
    if any(f.ceiling is not None for f in [*floors, default]):
        check = _int_check("ceiling", default, "ceilings", "d.allocatable.count <= LIMIT")
        validations.append({
            "expression": f"variables.increases.all(d, {check})",
            "message": "csinode-guard floor [count-ceiling]: an increase above the driver's highest possible "
            "ceiling; fix the driver's volume limit or raise the ceiling in the policy",
            "reason": "Forbidden",
        })
    if any(f.max_step_up is not None for f in [*floors, default]):
        check = _int_check("max_step_up", default, "maxStepUp", "d.allocatable.count - o.allocatable.count <= LIMIT")
        validations.append({
            "expression": "variables.increases.all(d, "
            f"variables.oldDrivers.all(o, !({_SAME}) || {check}) || {JUSTIFIED})",
            "message": "csinode-guard floor [count-ceiling]: an increase larger than the driver's maxStepUp; let "
            "the count rise in smaller steps, or have an approver justify the jump",
            "reason": "Forbidden",
        })
    identity = _bool_param(floors, default, "writer_identity")
    if identity != "false":
        validations.append({
            "expression": f"variables.trustedWriter || variables.changed.all(d, {_guarded(identity, JUSTIFIED)})",
            "message": "csinode-guard floor [writer-identity]: counts change only by the node's own kubelet, a "
            "writer the policy lists, or within an unexpired justification that covers the new count",
            "reason": "Forbidden",
        })
    validations.append({
        "expression": "!variables.justificationSet || variables.justifier",
        "message": f"csinode-guard floor [writer-identity]: only a justifier the policy lists sets "
        f"{JUSTIFICATION_ANNOTATION}",
        "reason": "Forbidden",
    })
    return validations


BOUNDED: Final = "(has({d}.allocatable) && has({d}.allocatable.count))"


COUNT_CHANGED_CONDITION_NAME: Final = "count-or-justification-changed"
EXEMPT_CONDITION_NAME: Final = "not-exempt"


def build_validating_admission_policy(policy: Policy, *, name: str = VAP_NAME) -> dict[str, Any]:
    """The ValidatingAdmissionPolicy for ``policy`` (a JSON-shaped dict, admissionregistration.k8s.io/v1)."""
    floors, default = driver_floors(policy)
    kubelet = (
        "request.userInfo.username == 'system:node:' + object.metadata.name"
        " && request.userInfo.groups.exists(g, g == 'system:nodes')"
    )
    writers = _principal_test(policy.writers)
    annotations = "has(object.metadata.annotations) ? object.metadata.annotations : {}"
    justification = cel_string(JUSTIFICATION_ANNOTATION)
    old_annotations = "has(oldObject.metadata.annotations) ? oldObject.metadata.annotations : {}"
    justification_set = (
        f"{justification} in ({annotations}) && !({justification} in ({old_annotations}) && "
        f"({old_annotations})[{justification}] == ({annotations})[{justification}])"
    )
    conditions = [
        {"name": UPDATE_ONLY_CONDITION_NAME, "expression": UPDATE_ONLY_EXPRESSION},
        {
            "name": COUNT_CHANGED_CONDITION_NAME,
            "expression": f"({_drivers('object')}).exists(d, ({_drivers('oldObject')}).exists(o, "
            f"{_SAME} && {_count('o')} != {_count('d')})) || ({justification_set})",
        },
    ]
    exempt = _principal_test(policy.exemptions)
    if exempt != "false":
        conditions.append({"name": EXEMPT_CONDITION_NAME, "expression": f"!({exempt})"})
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name, "labels": dict(LABELS)},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": ["storage.k8s.io"],
                        "apiVersions": ["v1"],
                        "operations": ["UPDATE"],
                        "resources": ["csinodes"],
                    }
                ]
            },
            "matchConditions": conditions,
            "variables": [
                {"name": "newDrivers", "expression": _drivers("object")},
                {"name": "oldDrivers", "expression": _drivers("oldObject")},
                {
                    "name": "changed",
                    "expression": "variables.newDrivers.filter(d, variables.oldDrivers.exists(o, "
                    f"{_SAME} && {_count('o')} != {_count('d')}))",
                },
                {
                    "name": "increases",
                    "expression": f"variables.changed.filter(d, variables.oldDrivers.exists(o, {_SAME} && "
                    f"{BOUNDED.format(d='o')} && {BOUNDED.format(d='d')} && "
                    "d.allocatable.count > o.allocatable.count))",
                },
                {"name": "ceilings", "expression": _int_map(floors, "ceiling")},
                {"name": "maxStepUp", "expression": _int_map(floors, "max_step_up")},
                {"name": "annotations", "expression": annotations},
                {"name": "justificationSet", "expression": justification_set},
                {"name": "justifier", "expression": _principal_test(policy.justifiers)},
                {"name": "requestTimes", "expression": REQUEST_TIMES},
                {
                    "name": "justifications",
                    "expression": f"{justification} in variables.annotations && "
                    f"variables.annotations[{justification}].size() <= {MAX_JUSTIFICATION_BYTES} ? "
                    f"variables.annotations[{justification}].findAll({cel_string(ENTRY_RE)}) : []",
                },
                {"name": "approvals", "expression": APPROVALS},
                {"name": "trustedWriter", "expression": kubelet if writers == "false" else f"({kubelet}) || {writers}"},
            ],
            "validations": _validations(floors, default),
        },
    }


def build_binding(policy: Policy, *, name: str = VAP_NAME) -> dict[str, Any]:
    """The ValidatingAdmissionPolicyBinding: ``Deny``, or ``Warn`` + ``Audit`` for a policy with a scope."""
    actions = ["Deny"] if policy.scope_match_labels is None else ["Warn", "Audit"]
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name, "labels": dict(LABELS)},
        "spec": {"policyName": name, "validationActions": actions},
    }


def build_vap_objects(policy: Policy, *, name: str = VAP_NAME) -> list[dict[str, Any]]:
    """The policy and its binding, in the order to apply them."""
    return [build_validating_admission_policy(policy, name=name), build_binding(policy, name=name)]


class _LiteralDumper(yaml.SafeDumper):
    """Multi-line strings as ``|`` blocks."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_LiteralDumper.add_representer(str, _represent_str)


def describe_floors(policy: Policy) -> list[str]:
    """One line per driver saying what the floor enforces for it (for the comment above the objects)."""
    floors, default = driver_floors(policy)
    lines = []
    for f in [*floors, default]:
        parts = []
        if f.count_checks:
            parts.append("no bounded->unbounded, no increase to 2147483647")
        if f.ceiling is not None:
            parts.append(f"increases to at most {f.ceiling}")
        if f.max_step_up is not None:
            parts.append(f"steps of at most {f.max_step_up}")
        if f.writer_identity:
            parts.append("writer identity")
        who = "every other driver" if f.driver == "*" else f.driver
        lines.append(f"{who}: {', '.join(parts) if parts else 'nothing (the policy does not enforce these rules)'}")
    return lines


def export_vap(policy: Policy, *, name: str = VAP_NAME) -> str:
    """A YAML stream of :func:`build_vap_objects` with a comment: what it enforces and what it cannot express."""
    head = [
        f"# ValidatingAdmissionPolicy floor generated by csinode-guard from policy {policy.name!r} "
        f"(hash {policy.hash}).",
        "# It holds in the apiserver when the guard is down, unreachable or unregistered. Per driver:",
        *(f"#   {line}" for line in describe_floors(policy)),
        "# Left to the guard (cannot be expressed without history or cluster lookups):",
        *(f"#   - {line}" for line in NOT_EXPRESSED),
    ]
    if policy.scope_match_labels is not None:
        head.append("# This policy has an enforcementScope: the binding only warns and audits (validationActions).")
    body = yaml.dump_all(build_vap_objects(policy, name=name), Dumper=_LiteralDumper, sort_keys=False, width=120)
    return "\n".join(head) + "\n" + body

