"""One call instead of two: the CEL that lets the apiserver skip /validate where /mutate's answer stands.

The validating webhook re-judges the final object after every mutating webhook, because another mutating
webhook (or a reinvocation) may change what /mutate admitted. /mutate already records what it admitted: on every
change it accepts it writes the signed state (:mod:`webhook.admission.state`) with each entry's accepted
``count``, and when it accepts no change it keeps (or puts back) the stored state. So where the final object's
counts are exactly the counts its state records, nothing changed a count after /mutate: /validate would judge
the same change from the same state and allow it (its ``state-integrity`` check, ``_check_integrity``, compares
exactly these counts). CEL cannot verify the HMAC, but it can read the counts in the state's canonical JSON.

:data:`DECIDED_EXPRESSION` is true when CEL can decide alone, i.e. the second HTTPS call is not needed:

- an UPDATE (a CREATE's object has no UID at mutating admission, so no state; it is always sent to /validate);
- the final object carries ``csinode-guard.io/state``, of at most :data:`MAX_STATE_BYTES`, and has at most
  :data:`MAX_DRIVERS` driver entries (the expression's cost budget);
- neither trust annotation (justification, driver versions) differs from ``oldObject`` (an approval is judged
  by /validate as before: rare, and its recording is what /validate would re-check);
- for **every** driver entry of the final object, the state holds an entry of that name whose ``count`` is the
  entry's count (``null`` for an unbounded entry), found in the state's canonical form
  ``"<name>":{"changedAt":"...","correction":null|{...},"count":<n>,`` (keys sorted, compact:
  :func:`webhook.admission.state.encode_state`). Every other text in the state is inside a JSON string, where
  a quote is escaped, so only a real ``drivers`` entry can match; ``declared`` entries start with ``"at"``.

The validating entries then get one more matchCondition, ``!DECIDED`` (:data:`NOT_DECIDED_CONDITION`): a
``false`` condition skips the webhook. Where the state is absent or malformed, another key sorts in between, a
count differs (a later webhook raised it), an entry has no state entry yet, or a trust annotation changes, the
condition is true and /validate is called as before. A change of the state's format can therefore only cost the
second call again, never skip a judgement. Who can make the condition hold without /mutate is in
docs/threat-model.md (*One call*): any change of the state in a write reaches the mutating ``Fail`` entry
(refused while the guard is down; ``state-integrity`` while it is up), and /mutate always runs before the
validating webhooks.

Never an error on an object the apiserver can produce: every access is guarded by ``has()`` or a type test, a
driver name is only put into a regular expression after it matched ``^[A-Za-z0-9.-]+$`` (the API's CSI driver
name characters; ``.`` is then escaped with ``replace``, of the Kubernetes strings extension), so no pattern can
fail to compile. ``matches`` is RE2's unanchored search (Python's ``re.search`` in :func:`decided`).

Pure: no I/O, no kubernetes or Flask imports.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

from webhook.admission.justification import JUSTIFICATION_ANNOTATION
from webhook.admission.policy import DRIVER_VERSIONS_ANNOTATION
from webhook.admission.state import STATE_ANNOTATION

VALIDATION_WEBHOOK: Final = "webhook"
"""``register --validation webhook``: /validate is called for every write its entries match (two calls)."""
VALIDATION_CEL: Final = "cel"
"""``register --validation cel``: /validate is called only where :data:`DECIDED_EXPRESSION` is false."""
VALIDATION_MODES: Final = (VALIDATION_WEBHOOK, VALIDATION_CEL)

_TRUST: Final = (JUSTIFICATION_ANNOTATION, DRIVER_VERSIONS_ANNOTATION)
_NAME_CHARS: Final = "[A-Za-z0-9.-]+"
_NAME_PATTERN: Final = f"^{_NAME_CHARS}$"
"""A CSI driver name's characters (``ValidateCSIDriverName``: DNS-1123 subdomain letters, digits, ``-``, ``.``;
upper case allowed). Only such a name is put into a pattern; any other makes the condition false."""

_ANNOTATIONS = "object.metadata.annotations"
_STATE = f"{_ANNOTATIONS}['{STATE_ANNOTATION}']"


def _cel_quote(text: str) -> str:
    """A CEL single-quoted string literal for ``text`` (backslash and quote escaped)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


_PREFIX: Final = '":\\{"changedAt":"[^"]*","correction":(null|\\{[^{}]*\\}),"count":'
"""What follows a driver's name in its state entry, up to its count (a regular expression)."""


def count_pattern(name: str, count: int | None) -> str:
    """The regular expression :data:`DECIDED_EXPRESSION` builds for one driver entry (Python's reading):
    its state entry with ``count`` (None: ``null``, unbounded). ``name`` must match ``^[A-Za-z0-9.-]+$``."""
    return '"' + name.replace(".", "\\.") + _PREFIX + ("null" if count is None else str(count)) + ","


_TRUST_UNCHANGED = " && ".join(
    f"""(has(object.metadata.annotations) && {_cel_quote(k)} in object.metadata.annotations
      ? [object.metadata.annotations[{_cel_quote(k)}]] : [])
    == (has(oldObject.metadata.annotations) && {_cel_quote(k)} in oldObject.metadata.annotations
      ? [oldObject.metadata.annotations[{_cel_quote(k)}]] : [])"""
    for k in _TRUST
)

MAX_STATE_BYTES: Final = 8192
MAX_DRIVERS: Final = 8
"""Past these, CEL does not try to decide (/validate is called): they bound the expression's runtime cost.

kube-apiserver gives every matchCondition a runtime cost budget (``PerCallLimit``, 1,000,000) and treats an
exhausted one as an error, which under ``failurePolicy: Fail`` refuses the write. cel-go charges ``matches`` about
(0.1 x the string's length) x (0.25 x the pattern's length): at most 8 entries x 820 x 44 = 290,000 here, for a
pattern of up to a 63-character driver name. A state is a few hundred bytes per driver (8 KiB: dozens of
approvals); the node can make neither larger than the other writers allow, and past either bound it only costs
the second call."""

_DRIVERS = "(has(object.spec.drivers) && type(object.spec.drivers) == list ? object.spec.drivers : [])"

DECIDED_EXPRESSION: Final = f"""request.operation == 'UPDATE'
&& has(object.metadata.annotations) && {_cel_quote(STATE_ANNOTATION)} in object.metadata.annotations
&& size({_STATE}) <= {MAX_STATE_BYTES} && size({_DRIVERS}) <= {MAX_DRIVERS}
&& {_TRUST_UNCHANGED}
&& {_DRIVERS}.all(d,
  has(d.name) && type(d.name) == string && d.name.matches({_cel_quote(_NAME_PATTERN)})
  && {_STATE}.matches('"' + d.name.replace('.', '\\\\.') + {_cel_quote(_PREFIX)}
    + (has(d.allocatable) && has(d.allocatable.count) ? string(d.allocatable.count) : 'null') + ','))"""
"""True where the final object's counts are the ones its state records (see the module docstring)."""

NOT_DECIDED_CONDITION_NAME: Final = "final-counts-not-the-ones-mutate-recorded"
NOT_DECIDED_CONDITION: Final[Mapping[str, str]] = {
    "name": NOT_DECIDED_CONDITION_NAME,
    "expression": f"!({DECIDED_EXPRESSION})",
}
"""The validating entries' extra matchCondition in ``--validation cel``: call /validate only where CEL cannot
decide."""


def _annotation(obj: Mapping[str, Any] | None, key: str) -> list[Any]:
    annotations = ((obj or {}).get("metadata") or {}).get("annotations")
    if isinstance(annotations, Mapping) and key in annotations:
        return [annotations[key]]
    return []


def _count(entry: Mapping[str, Any]) -> tuple[bool, int | None]:
    """(readable, count): an integer count, or None when ``allocatable``/``count`` is absent (unbounded); not
    readable for any other value (the API field is an int32, so only a hand-made object has one)."""
    allocatable = entry.get("allocatable")
    if not isinstance(allocatable, Mapping) or allocatable.get("count") is None:
        return True, None
    count = allocatable["count"]
    return (True, count) if isinstance(count, int) and not isinstance(count, bool) else (False, None)


def decided(operation: str, old: Mapping[str, Any] | None, new: Mapping[str, Any] | None,
            trust: Sequence[str] = _TRUST) -> bool:
    """Python's reading of :data:`DECIDED_EXPRESSION` for a write of ``new`` over ``old`` (JSON objects as the
    apiserver hands them to CEL): True where the validating call is skipped in ``--validation cel``.
    tests/deploy checks it agrees with two CEL engines on random objects; tests/k8s checks the apiserver."""
    if operation != "UPDATE":
        return False
    state = _annotation(new, STATE_ANNOTATION)
    if not state or not isinstance(state[0], str) or len(state[0]) > MAX_STATE_BYTES:
        return False
    if any(_annotation(new, k) != _annotation(old, k) for k in trust):
        return False
    raw = ((new or {}).get("spec") or {}).get("drivers")
    drivers = raw if isinstance(raw, list) else []
    if len(drivers) > MAX_DRIVERS:
        return False
    for d in drivers:
        name = d.get("name") if isinstance(d, Mapping) else None
        if not isinstance(name, str) or not re.fullmatch(_NAME_CHARS, name):
            return False
        readable, count = _count(d)
        if not readable or not re.search(count_pattern(name, count), state[0]):
            return False
    return True


# ---------------------------------------------------------------------------------------------------------------
# Choosing the mode: one call wherever no other mutator can rewrite a CSINode after /mutate.

VALIDATION_AUTO: Final = "auto"
"""``register --validation auto`` (the default) and ``serve --validation auto``: ``cel`` when no other mutating
webhook or MutatingAdmissionPolicy can match a CSINode write, else ``webhook``; re-checked on every caBundle pass."""
CHOSEN_MODES: Final = (VALIDATION_AUTO, *VALIDATION_MODES)

_WRITE_OPERATIONS: Final = frozenset({"CREATE", "UPDATE", "*"})
_CSINODE_RESOURCES: Final = frozenset({"csinodes", "*", "*/*"})
_CSINODE_GROUPS: Final = frozenset({"storage.k8s.io", "*"})


def _rule_matches_csinode_writes(rule: Any) -> bool:
    """Whether one ``RuleWithOperations`` (admissionregistration.k8s.io/v1) can match a CREATE or UPDATE of
    ``storage.k8s.io`` ``csinodes``. ``apiVersions`` is not read: under ``matchPolicy: Equivalent`` (the default)
    a rule for another version of the group still matches; ``scope`` ``Namespaced`` excludes CSINodes (cluster
    scoped). Anything unreadable counts as a match (the safe reading: it costs a second call, never a judgement)."""
    if not isinstance(rule, Mapping):
        return True
    operations, groups, resources = rule.get("operations"), rule.get("apiGroups"), rule.get("resources")
    if not (isinstance(operations, list) and isinstance(groups, list) and isinstance(resources, list)):
        return True
    if rule.get("scope") == "Namespaced":
        return False
    return (bool(_WRITE_OPERATIONS.intersection(operations)) and bool(_CSINODE_GROUPS.intersection(groups))
            and bool(_CSINODE_RESOURCES.intersection(resources)))


def csinode_mutators(configurations: Sequence[Mapping[str, Any]], own_configuration: str,
                     policies: Sequence[Mapping[str, Any]] = ()) -> tuple[str, ...]:
    """The other mutators that can rewrite a CSINode on CREATE or UPDATE, as ``configuration/webhook`` names
    (MutatingWebhookConfigurations, ``webhooks[].rules``) and ``mutatingadmissionpolicy/NAME``
    (``spec.matchConstraints.resourceRules``), sorted. ``own_configuration`` (the guard's own
    MutatingWebhookConfiguration) is skipped. objectSelector and matchConditions are not evaluated: a webhook that
    might match counts (reading them would trust what the objects' writers control)."""
    found: list[str] = []
    for configuration in configurations:
        name = str((configuration.get("metadata") or {}).get("name") or "")
        if name == own_configuration:
            continue
        for webhook in configuration.get("webhooks") or []:
            rules = webhook.get("rules") if isinstance(webhook, Mapping) else None
            if not isinstance(rules, list) or any(_rule_matches_csinode_writes(r) for r in rules):
                found.append(f"{name}/{webhook.get('name') if isinstance(webhook, Mapping) else '?'}")
    for policy in policies:
        name = str((policy.get("metadata") or {}).get("name") or "")
        constraints = (policy.get("spec") or {}).get("matchConstraints")
        rules = constraints.get("resourceRules") if isinstance(constraints, Mapping) else None
        if not isinstance(rules, list) or any(_rule_matches_csinode_writes(r) for r in rules):
            found.append(f"mutatingadmissionpolicy/{name}")
    return tuple(sorted(found))


def choose_validation(requested: str, mutators: Sequence[str] | None) -> tuple[str, str]:
    """``(mode, reason)`` for ``requested`` (one of :data:`CHOSEN_MODES`). ``auto`` gives ``cel`` when
    ``mutators`` is empty, ``webhook`` when it names any, and ``webhook`` when it is None (they could not be
    listed: the safe choice). ``webhook`` and ``cel`` are overrides and are returned as they are. Raises
    ValueError for another value."""
    if requested not in CHOSEN_MODES:
        raise ValueError(f"validation must be one of {', '.join(CHOSEN_MODES)}, not {requested!r}")
    if requested != VALIDATION_AUTO:
        return requested, f"--validation {requested} (override)"
    if mutators is None:
        return VALIDATION_WEBHOOK, "auto: the other mutating webhooks could not be listed, so two calls"
    if mutators:
        shown = ", ".join(mutators[:3]) + (f" and {len(mutators) - 3} more" if len(mutators) > 3 else "")
        return VALIDATION_WEBHOOK, f"auto: another mutator can rewrite CSINodes ({shown}), so two calls"
    return VALIDATION_CEL, "auto: no other mutating webhook or policy matches CSINodes, so one call"
