"""One CSINode write through the apiserver's admission chain, offline: what ``policy test`` and ``replay`` run.

The apiserver calls the guard only when the registration's ``matchConditions`` hold (an UPDATE that changes a
count of a driver present in both objects, or one of the guard's annotations; see
``webhook.kube.registration.CHANGE_EXPRESSION``, mirrored by :func:`reaches_guard`). It then sends the AdmissionReview
to /mutate, applies the returned JSONPatch to the object, sends the result to /validate with the same
``oldObject`` and writer, and stores the result unless the request is a dry run. A stored object equal to the
old one is a no-op (nothing written to etcd).

:func:`admit_write` does exactly that with the real wire format: it builds the AdmissionReview JSON, parses it
with :func:`webhook.admission.review.parse_review`, evaluates, builds the response document with
:func:`webhook.admission.review.build_response` and applies its base64 JSONPatch with the ``jsonpatch`` library, so the
guard state (the signed ``csinode-guard.io/state`` annotation) carries from write to write as it does in a
cluster. Pure apart from the clock and budget it is given.
"""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import jsonpatch

from webhook.admission.budget import IncreaseBudget
from webhook.admission.cluster import ClusterView
from webhook.admission.evaluation import AdmissionDecision, Decision, Mode, evaluate
from webhook.admission.policy import Policy
from webhook.admission.review import AdmissionRequest, build_response, parse_review
from webhook.admission.state import StateKeys
from webhook.kube.registration import webhook_entry

_GVK = {"group": "storage.k8s.io", "version": "v1", "kind": "CSINode"}
_GVR = {"group": "storage.k8s.io", "version": "v1", "resource": "csinodes"}
_OPTIONS_KIND = {"UPDATE": "UpdateOptions", "CREATE": "CreateOptions", "DELETE": "DeleteOptions"}


def reaches_guard(operation: str, old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> bool:
    """True when one of the webhook entries' ``matchConditions`` sends this write to the guard.

    Mirrors ``webhook.kube.registration.MATCH_CONDITIONS`` and ``NEVER_REFUSED_MATCH_CONDITIONS``
    (:func:`webhook.kube.registration.webhook_entry`): CREATE, and an UPDATE with a count change, a registration, a
    removal or a guard annotation change.
    """
    return webhook_entry(operation, old, new) is not None


def build_review(
    old: Mapping[str, Any] | None,
    new: Mapping[str, Any] | None,
    *,
    uid: str,
    username: str,
    groups: Sequence[str],
    operation: str = "UPDATE",
    dry_run: bool = False,
) -> dict[str, Any]:
    """An ``admission.k8s.io/v1`` AdmissionReview for a CSINode write, shaped as kube-apiserver sends it."""
    name = str(((new or old or {}).get("metadata") or {}).get("name") or "")
    options: dict[str, Any] = {"kind": _OPTIONS_KIND.get(operation, "UpdateOptions"), "apiVersion": "meta.k8s.io/v1"}
    if operation != "DELETE" and username.startswith("system:node:"):
        options["fieldManager"] = "kubelet"
    return {
        "kind": "AdmissionReview",
        "apiVersion": "admission.k8s.io/v1",
        "request": {
            "uid": uid,
            "kind": dict(_GVK),
            "resource": dict(_GVR),
            "requestKind": dict(_GVK),
            "requestResource": dict(_GVR),
            "name": name,
            "operation": operation,
            "userInfo": {"username": username, "groups": list(groups)},
            "object": copy.deepcopy(dict(new)) if new is not None else None,
            "oldObject": copy.deepcopy(dict(old)) if old is not None else None,
            "dryRun": dry_run,
            "options": options,
        },
    }


def apply_review_patch(obj: Mapping[str, Any], document: Mapping[str, Any]) -> dict[str, Any]:
    """The object after the apiserver applies a /mutate response document's JSONPatch (a copy; none: unchanged)."""
    raw = document.get("response", {}).get("patch")
    if not raw:
        return copy.deepcopy(dict(obj))
    ops = json.loads(base64.b64decode(raw))
    result: dict[str, Any] = jsonpatch.apply_patch(copy.deepcopy(dict(obj)), ops)
    return result


def _bump_resource_version(obj: dict[str, Any] | None) -> dict[str, Any] | None:
    """The apiserver gives every write that changed the object a new resourceVersion."""
    if obj is None:
        return None
    meta = obj.get("metadata")
    if isinstance(meta, dict) and str(meta.get("resourceVersion", "")).isdigit():
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)
    return obj


def _without_resource_version(obj: Mapping[str, Any] | None) -> Any:
    if obj is None:
        return None
    out = copy.deepcopy(dict(obj))
    meta = out.get("metadata")
    if isinstance(meta, dict):
        meta.pop("resourceVersion", None)
        meta.pop("managedFields", None)
    return out


@dataclass(frozen=True)
class WriteOutcome:
    """What the admission chain did with one write.

    ``called`` is False when ``matchConditions`` kept the write from the guard (it is then written as sent).
    ``decision`` is the /mutate decision, or the /validate one when /validate refused the mutated object.
    ``stored`` is the object the apiserver holds afterwards (the old one when refused or a dry run, None when
    the CSINode does not exist); ``written`` is True when the write changed the stored object.
    """

    called: bool
    decision: Decision
    allowed: bool
    stored: dict[str, Any] | None
    written: bool
    mutate: AdmissionDecision | None = None
    validate: AdmissionDecision | None = None
    request: AdmissionRequest | None = None
    warnings: tuple[str, ...] = ()
    message: str = ""
    fired_rules: tuple[str, ...] = field(default_factory=tuple)


def _refused(
    stored_old: dict[str, Any] | None,
    mutated: AdmissionDecision,
    validated: AdmissionDecision | None,
    request: AdmissionRequest,
    warnings: tuple[str, ...],
    answer: Mapping[str, Any],
    fired: Sequence[str],
) -> WriteOutcome:
    """The outcome of a write that /mutate (``validated`` None) or /validate refused: nothing is stored."""
    return WriteOutcome(
        called=True,
        decision=(validated or mutated).decision,
        allowed=False,
        stored=stored_old,
        written=False,
        mutate=mutated,
        validate=validated,
        request=request,
        warnings=warnings,
        message=str(answer.get("status", {}).get("message", "")),
        fired_rules=tuple(fired),
    )


def admit_write(
    old: Mapping[str, Any] | None,
    new: Mapping[str, Any] | None,
    *,
    policy: Policy,
    cluster: ClusterView,
    keys: StateKeys,
    now: datetime,
    uid: str,
    username: str,
    groups: Sequence[str],
    operation: str = "UPDATE",
    dry_run: bool = False,
    budget: IncreaseBudget | None = None,
) -> WriteOutcome:
    """Send one write (``old`` -> ``new``) through matchConditions, /mutate, the patch and /validate.

    ``new`` None is a DELETE, ``old`` None a CREATE. ``budget`` is the replica's cluster-wide increase budget,
    read with ``now`` as its clock (as the server reads it with its own).
    """
    stored_old = copy.deepcopy(dict(old)) if old is not None else None
    if not reaches_guard(operation, old, new):
        changed = _without_resource_version(new) != _without_resource_version(stored_old)
        written = changed and not dry_run
        stored = _bump_resource_version(copy.deepcopy(dict(new)) if new is not None else None)
        return WriteOutcome(
            called=False,
            decision=Decision.SKIP,
            allowed=True,
            stored=stored if written else stored_old,
            written=written,
        )
    review = build_review(old, new, uid=uid, username=username, groups=groups, operation=operation,
                          dry_run=dry_run)
    request = parse_review(json.dumps(review))
    mutated = evaluate(request, policy, cluster, now, keys, mode=Mode.MUTATE, budget=budget,
                       budget_clock=now.timestamp())
    document = build_response(request.uid, mutated.response, allow_patch=True)
    body = document["response"]
    warnings = tuple(body.get("warnings") or ())
    if not body["allowed"]:
        return _refused(stored_old, mutated, None, request, warnings, body, mutated.fired_rules)
    final = apply_review_patch(new or {}, document)
    second = build_review(old, final, uid=uid, username=username, groups=groups, operation=operation,
                          dry_run=dry_run)
    validated = evaluate(parse_review(json.dumps(second)), policy, cluster, now, keys, mode=Mode.VALIDATE)
    checked = build_response(request.uid, validated.response, allow_patch=False)["response"]
    fired = list(mutated.fired_rules)
    fired += [r for r in validated.fired_rules if r not in fired]
    if not checked["allowed"]:
        return _refused(stored_old, mutated, validated, request, warnings, checked, fired)
    changed = _without_resource_version(final) != _without_resource_version(stored_old)
    written = changed and not dry_run
    return WriteOutcome(
        called=True,
        decision=mutated.decision,
        allowed=True,
        stored=_bump_resource_version(final) if written else stored_old,
        written=written,
        mutate=mutated,
        validate=validated,
        request=request,
        warnings=warnings,
        fired_rules=tuple(fired),
    )
