"""Policy test files: the ``kind: PolicyTest`` schema, finding the files and loading them (YAML, validated).

A test file (YAML, ``kind: PolicyTest``) holds cases; a case is a sequence of steps on one or more CSINodes. A
step is a time (``at`` from the case start, or ``after`` the previous step), the cluster facts at that moment
(node labels, driver versions, ResourceExhausted evidence, driver update periods), and one write: the writer
(``user``/``groups``), the operation, the driver counts after the write (kubelet style: each listed driver is
removed and re-appended) or a whole object, annotations (a justification). ``expect`` lists the outcome: the
decision, the rule ids that fire, the counts stored afterwards, parts of warnings and of the denial message, and
the guard's state per driver (frozen, correction). :mod:`webhook.simulation.policy_tests` runs the cases,
:mod:`webhook.simulation.policy_test_report` reports the results.

Pure apart from reading the files. See ``policies/tests/`` for examples and :data:`TEST_SCHEMA` for every
field. In short::

    apiVersion: csinode-guard.io/v1alpha1
    kind: PolicyTest
    policy: ../default.yaml            # relative to this file; `policy test --policy P` overrides it
    start: "2026-11-30T02:00:00Z"      # the clock of step 0 (per case: start)
    cases:
      - name: ...
        cluster: {driverPeriods: {ebs.csi.aws.com: 60}, attachErrorsKnown: true}
        nodes:                         # the CSINodes before step 1 (exists: false: none yet; or a whole object)
          ip-10-0-1-23.ec2.internal:
            drivers: {ebs.csi.aws.com: 25, efs.csi.aws.com: unbounded}
            labels: {node.kubernetes.io/instance-type: m6i.large}   # absent: the node is unknown to the guard
            driverVersions: {ebs.csi.aws.com: v1.37.0}
        steps:
          - at: 5m                     # or after: 30s (from the previous step); neither: same time
            node: ...                  # needed when the case has several nodes
            user: kubelet              # (default) the node's kubelet; kubelet:<other-node>; or any username
            groups: [...]              # default: system:nodes for kubelets, system:authenticated otherwise
            operation: UPDATE          # CREATE, DELETE; dryRun: true
            drivers: {ebs.csi.aws.com: 39}       # a count, unbounded (or null), absent (driver removed)
            annotations: {key: value}            # null removes
            justification: [{driver, minCount, maxCount, expires: 2h | RFC 3339, reason, ticket}]
            object: {...}              # instead of drivers/annotations: the whole new object
            labels / kubeletVersion / driverVersions / driverPeriods:   # facts from now on
            resourceExhausted: [ebs.csi.aws.com]                       # attach error, gRPC code 8, now
            attachErrors: [{driver, code: 8, ago: 2m, volumeAttachment, message}]
            expect:
              decision: clamp          # allow warn clamp deny invalid skip (skip: the webhook is not called)
              allowed: true
              called: true             # matchConditions send the write to the guard
              rules: [count-ceiling]   # exactly the rules that found a violation (any order)
              final: {ebs.csi.aws.com: 27}         # stored afterwards (unbounded, absent)
              written: true            # the stored object changed
              warnings: ["part of a warning"]      # and noWarnings: true
              message: ["part of the denial"]
              state: {ebs.csi.aws.com: {count: 27, frozen: false, correction: resource-exhausted,
                                        writerVersion: v1.37.0, raised: 20}}   # raised: the count before the
              approvals: 1                                                    # increase the brake relates to
              brake: {ebs.csi.aws.com: true}       # the driver's brake is engaged at this step

The brake (``spec.brake``, docs/brake.md) is not stated but decided: before every step, at the step's time, the
case takes the audit leader's decision (:func:`webhook.admission.brake.decide_brakes`) over every CSINode's signed
state (the increases the guard admitted in the earlier steps) and the attach errors given so far (``attachErrors``
with ``code: 8`` after the increases, on enough nodes). The step's write is judged with the brakes it records.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from webhook.admission.csinode import INT32_MAX
from webhook.admission.durations import DURATION_PATTERN
from webhook.admission.policy import RULE_IDS, STATE_INTEGRITY, describe_schema_error, json_path
from webhook.admission.safe_yaml import load_yaml
from webhook.admission.state import parse_time

API_VERSION = "csinode-guard.io/v1alpha1"
KIND = "PolicyTest"
DEFAULT_START = "2026-01-01T00:00:00Z"
"""The clock of step 0 when the file and the case name no ``start``."""
ABSENT = "absent"
"""A driver count meaning: the driver is not in the CSINode (removed, or never registered)."""
UNBOUNDED = "unbounded"
"""A driver count meaning: no allocatable count (unbounded); ``null`` means the same."""

_DURATION: dict[str, Any] = {
    "oneOf": [{"type": "string", "pattern": DURATION_PATTERN}, {"type": "number", "minimum": 0}]
}
_COUNT: dict[str, Any] = {
    "oneOf": [
        {"type": "integer", "minimum": 0, "maximum": INT32_MAX},
        {"type": "null"},
        {"enum": [ABSENT, UNBOUNDED]},
    ]
}
_COUNTS: dict[str, Any] = {"type": "object", "additionalProperties": _COUNT}
_STRINGS: dict[str, Any] = {"type": "array", "items": {"type": "string"}}
_STRING_MAP: dict[str, Any] = {"type": "object", "additionalProperties": {"type": "string"}}
_JUSTIFICATION: dict[str, Any] = {
    "type": "object",
    "required": ["driver", "minCount", "maxCount", "expires"],
    "properties": {
        "driver": {"type": "string"},
        "reason": {"type": "string"},
        "minCount": {"type": "integer", "minimum": 0},
        "maxCount": {"type": "integer", "minimum": 0},
        "expires": {"type": ["string", "number"], "description": "RFC 3339 time, or a duration from the step"},
        "ticket": {"type": "string"},
    },
    "additionalProperties": False,
}
_ATTACH_ERROR: dict[str, Any] = {
    "type": "object",
    "required": ["driver"],
    "properties": {
        "driver": {"type": "string"},
        "code": {"type": ["integer", "null"]},
        "ago": _DURATION,
        "volumeAttachment": {"type": "string"},
        "message": {"type": "string"},
    },
    "additionalProperties": False,
}
_FACTS: dict[str, Any] = {
    "labels": {"oneOf": [_STRING_MAP, {"type": "null"}]},
    "kubeletVersion": {"type": "string"},
    "driverVersions": _STRING_MAP,
    "driverPeriods": {"type": "object", "additionalProperties": {"type": "number", "minimum": 0}},
    "attachErrors": {"type": "array", "items": _ATTACH_ERROR},
    "resourceExhausted": _STRINGS,
}
_EXPECT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "decision": {"enum": ["allow", "warn", "clamp", "deny", "invalid", "skip"]},
        "allowed": {"type": "boolean"},
        "called": {"type": "boolean"},
        "rules": {"type": "array", "items": {"enum": [*RULE_IDS, STATE_INTEGRITY]}},
        "final": _COUNTS,
        "written": {"type": "boolean"},
        "warnings": _STRINGS,
        "noWarnings": {"type": "boolean"},
        "message": _STRINGS,
        "state": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "properties": {
                    "count": _COUNT,
                    "frozen": {"type": "boolean"},
                    "correction": {"enum": ["resource-exhausted", "justification", None]},
                    "writerVersion": {"type": ["string", "null"]},
                    "raised": {
                        "type": ["integer", "null"],
                        "description": "the count trusted before the increase the guard admitted inside the "
                        "brake's lookback (null: none recorded)",
                    },
                },
                "additionalProperties": False,
            },
        },
        "approvals": {"type": "integer", "minimum": 0},
        "brake": {
            "type": "object",
            "description": "driver -> whether its brake is engaged at the step (after the leader's pass)",
            "additionalProperties": {"type": "boolean"},
        },
    },
    "additionalProperties": False,
}
TEST_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["apiVersion", "kind", "cases"],
    "properties": {
        "apiVersion": {"const": API_VERSION},
        "kind": {"const": KIND},
        "metadata": {"type": "object"},
        "policy": {"type": "string", "description": "policy file, relative to the test file"},
        "start": {"type": "string"},
        "cases": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["name", "nodes", "steps"],
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "description": {"type": "string"},
                    "start": {"type": "string"},
                    "cluster": {
                        "type": "object",
                        "properties": {
                            "driverPeriods": _FACTS["driverPeriods"],
                            "attachErrorsKnown": {"type": "boolean"},
                        },
                        "additionalProperties": False,
                    },
                    "nodes": {
                        "type": "object",
                        "minProperties": 1,
                        "additionalProperties": {
                            "type": ["object", "null"],
                            "properties": {
                                "exists": {"type": "boolean"},
                                "drivers": _COUNTS,
                                "annotations": _STRING_MAP,
                                "object": {"type": "object"},
                                "labels": _FACTS["labels"],
                                "kubeletVersion": _FACTS["kubeletVersion"],
                                "driverVersions": _FACTS["driverVersions"],
                            },
                            "additionalProperties": False,
                        },
                    },
                    "steps": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "properties": {
                                "name": {"type": "string"},
                                "at": _DURATION,
                                "after": _DURATION,
                                "node": {"type": "string"},
                                "user": {"type": "string"},
                                "groups": _STRINGS,
                                "operation": {"enum": ["UPDATE", "CREATE", "DELETE"]},
                                "dryRun": {"type": "boolean"},
                                "drivers": _COUNTS,
                                "annotations": {
                                    "type": "object",
                                    "additionalProperties": {"type": ["string", "null"]},
                                },
                                "justification": {
                                    "oneOf": [{"type": "array", "items": _JUSTIFICATION}, {"type": "null"}]
                                },
                                "object": {"type": "object"},
                                **_FACTS,
                                "expect": _EXPECT,
                            },
                            "not": {"required": ["at", "after"]},
                            "additionalProperties": False,
                        },
                    },
                },
                "additionalProperties": False,
            },
        },
    },
    "additionalProperties": False,
}


class PolicyTestError(ValueError):
    """A test file that cannot be run: ``source`` file, ``path`` inside it, ``problem``."""

    def __init__(self, source: str, path: str, problem: str) -> None:
        super().__init__(f"{source}: at {path or '(document)'}: {problem}")
        self.source = source
        self.path = path
        self.problem = problem


# -- loading --------------------------------------------------------------------------------------------------


def load_test_file(path: Path) -> dict[str, Any]:
    """Read and validate a ``kind: PolicyTest`` file; raises :class:`PolicyTestError` naming the broken spot."""
    try:
        text = path.read_text("utf-8")
    except OSError as exc:
        raise PolicyTestError(str(path), "", f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise PolicyTestError(str(path), f"byte {exc.start}", "not UTF-8 text: save the policy test as UTF-8"
                              ) from None
    try:
        doc = load_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise PolicyTestError(str(path), where, f"not valid YAML: {getattr(exc, 'problem', exc)}") from None
    validator = jsonschema.Draft202012Validator(TEST_SCHEMA)
    errors = list(validator.iter_errors(doc))
    if errors:
        best = jsonschema.exceptions.best_match(errors) or errors[0]
        raise PolicyTestError(str(path), json_path(best.absolute_path), describe_schema_error(best))
    assert isinstance(doc, dict)
    return doc


def parse_start(text: str, source: str, where: str) -> datetime:
    """The RFC 3339 time of a ``start`` field; raises :class:`PolicyTestError` naming ``where`` in ``source``."""
    try:
        return parse_time(text)
    except ValueError:
        raise PolicyTestError(source, where, f"not an RFC 3339 time: {text!r}") from None


def find_test_files(paths: Sequence[Path]) -> list[Path]:
    """The test files named by ``paths``: files as given, directories' ``*.yaml``/``*.yml`` (sorted)."""
    found: list[Path] = []
    for p in paths:
        if p.is_dir():
            found += sorted(q for q in p.rglob("*") if q.suffix in (".yaml", ".yml") and q.is_file())
        else:
            found.append(p)
    return found
