"""The GuardPolicy CustomResourceDefinition, generated from the one JSON Schema the guard validates with.

``webhook/schema/guardpolicy.schema.json`` (JSON Schema 2020-12) is the only description of a policy. The CRD's
``openAPIV3Schema`` is made from it by :func:`crd_schema`, so that the apiserver refuses at ``kubectl apply`` what
the guard would refuse at load (the guard's deeper checks, such as a driver profile that exists, stay in the guard
and show in the resource's ``Accepted`` condition). A structural schema (apiextensions.k8s.io/v1, "Specifying a
structural schema") cannot say everything JSON Schema can, so the conversion is:

- ``$ref`` is inlined (the schema has no recursion); ``$schema``, ``$id``, ``title``, ``$defs`` go;
- ``const`` becomes a one-value ``enum``; ``exclusiveMinimum: N`` becomes ``minimum: N, exclusiveMinimum: true``;
- ``type: [T, "null"]`` and ``oneOf: [S, {type: null}]`` become ``nullable: true``;
- ``additionalProperties: false`` goes: the apiserver prunes unknown fields and ``kubectl apply`` (strict field
  validation) refuses them; ``additionalProperties: true`` (anything) is dropped with its property;
- a duration (a string ``1h30m`` or a number of seconds) is ``x-kubernetes-int-or-string`` with a CEL rule for the
  two forms: the apiserver refuses a fractional number of seconds (write ``500ms``), which the guard accepts from a
  file;
- a ``oneOf`` whose branches are told apart by a ``const`` discriminator (``versionSource.type``) becomes one
  object with every branch's properties and CEL ``x-kubernetes-validations`` that say which fields each ``type``
  requires and forbids;
- ``propertyNames`` goes; its limits are in the CEL rules written next to it (``x-kubernetes-validations`` in the
  JSON Schema, which JSON Schema ignores and this conversion copies).

``metadata`` is left to the apiserver (a CRD may constrain only name and generateName); ``status`` is the guard's
own (:data:`STATUS_SCHEMA`). ``csinode-guard policy crd`` prints the CRD; ``deploy/base/guardpolicy-crd.yaml`` is
that output, and tests/deploy fails when they differ.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from importlib import resources
from typing import Any

GROUP = "csinode-guard.io"
VERSION = "v1alpha1"
PLURAL = "guardpolicies"
KIND = "GuardPolicy"
CRD_NAME = f"{PLURAL}.{GROUP}"

_DROP = {"$schema", "$id", "title", "$defs", "additionalProperties", "propertyNames"}

CONDITION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type", "status"],
    "properties": {
        "type": {"type": "string", "description": "Accepted or Enforced."},
        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
        "reason": {"type": "string"},
        "message": {"type": "string"},
        "observedGeneration": {"type": "integer", "format": "int64"},
        "lastTransitionTime": {"type": "string", "format": "date-time"},
    },
}

STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "Written by the guard replica that holds the policy-status Lease, from what every replica "
    "reports in its own Lease (never per admission request).",
    "properties": {
        "observedGeneration": {
            "type": "integer", "format": "int64",
            "description": "The metadata.generation the guard has judged (the Accepted condition is about it).",
        },
        "policyHash": {
            "type": "string",
            "description": "The policy hash of that generation, as in the guard's audit records, /readyz and every "
            "tool's output.",
        },
        "enforcement": {
            "type": "string",
            "description": "Rule enforcement actions counted (e.g. 'deny 4, clamp 1, warn 1'), '(scoped)' when "
            "spec.enforcementScope limits enforcement to some nodes.",
        },
        "replicas": {
            "type": "string",
            "description": "Replicas serving observedGeneration / replicas reporting (e.g. 2/2).",
        },
        "conditions": {
            "type": "array",
            "items": CONDITION_SCHEMA,
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
            "description": "Accepted: the guard's checks pass (else the reason and the path of the first error); "
            "Enforced: every reporting replica serves observedGeneration.",
        },
        "byPod": {
            "type": "array",
            "description": "What each replica serves, from its report (a replica silent for long is left out).",
            "items": {
                "type": "object",
                "required": ["id"],
                "properties": {
                    "id": {"type": "string", "description": "The replica (pod name)."},
                    "observedGeneration": {
                        "type": "integer", "format": "int64",
                        "description": "The generation this replica serves (0: none of this resource's).",
                    },
                    "policyHash": {"type": "string"},
                    "source": {"type": "string", "description": "Where its policy comes from."},
                    "error": {"type": "string", "description": "Why it refused the newest generation, if it did."},
                    "reportedAt": {"type": "string", "format": "date-time"},
                },
            },
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["id"],
        },
    },
}

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Enforcement", "type": "string", "jsonPath": ".status.enforcement",
     "description": "Rule enforcement actions counted."},
    {"name": "Reconcile", "type": "string", "jsonPath": ".spec.reconcile",
     "description": "What the background audit does with a standing count the rules no longer allow."},
    {"name": "Accepted", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Accepted")].status',
     "description": "The guard accepted the newest generation."},
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Enforced")].status',
     "description": "Every replica serves the newest generation."},
    {"name": "Replicas", "type": "string", "jsonPath": ".status.replicas",
     "description": "Replicas serving it / replicas reporting."},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


@cache
def json_schema() -> dict[str, Any]:
    """The GuardPolicy JSON Schema the guard validates with (``webhook/schema/guardpolicy.schema.json``)."""
    text = resources.files("webhook").joinpath("schema/guardpolicy.schema.json").read_text("utf-8")
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    """``node`` with every ``$ref: #/$defs/X`` inlined (sibling keywords, such as a description, kept)."""
    if isinstance(node, list):
        return [_resolve(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    ref = node.get("$ref")
    if isinstance(ref, str):
        name = ref.removeprefix("#/$defs/")
        out.update(_resolve(defs[name], defs))
    for key, value in node.items():
        if key != "$ref":
            out[key] = _resolve(value, defs)
    return out


def _is_duration(node: dict[str, Any]) -> bool:
    branches = node.get("oneOf") or []
    types = sorted(str(b.get("type")) for b in branches if isinstance(b, dict))
    return types == ["number", "string"]


def _discriminated(branches: list[dict[str, Any]]) -> str | None:
    """The property whose ``const`` tells the branches of a ``oneOf`` apart, or None."""
    for b in branches:
        for key, prop in (b.get("properties") or {}).items():
            if isinstance(prop, dict) and "const" in prop and all(
                "const" in ((o.get("properties") or {}).get(key) or {}) for o in branches
            ):
                return str(key)
    return None


def _structural(node: Any) -> Any:
    """One JSON Schema node (``$ref`` already inlined) as a structural OpenAPI v3 node (see the module docstring)."""
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if _is_duration(node):
        string = next(b for b in node["oneOf"] if b.get("type") == "string")
        number = next(b for b in node["oneOf"] if b.get("type") == "number")
        minimum = number.get("minimum", 0)
        rule = f"type(self) == int ? self >= {minimum} : self.matches(r'{string['pattern']}')"
        out: dict[str, Any] = {
            "x-kubernetes-int-or-string": True,
            **({"maxLength": string["maxLength"]} if "maxLength" in string else {}),
            "x-kubernetes-validations": [
                {"rule": rule, "message": "a duration such as 30s, 15m or 1h30m, or a whole number of seconds"},
            ],
        }
        if "description" in node:
            out["description"] = node["description"]
        return out
    one_of = node.pop("oneOf", None)
    if one_of is not None:
        nullable = [b for b in one_of if b.get("type") == "null"]
        others = [b for b in one_of if b.get("type") != "null"]
        if nullable and len(others) == 1:
            merged = {**others[0], **node, "nullable": True}
            return _structural(merged)
        key = _discriminated(others)
        if key is None:
            raise ValueError(f"no structural form for oneOf {one_of!r}")
        return _structural(_merge_discriminated(node, others, key))
    if isinstance(node.get("type"), list):
        types = [t for t in node["type"] if t != "null"]
        if "null" in node["type"]:
            node["nullable"] = True
        node["type"] = types[0]
    if "const" in node:
        node["enum"] = [node.pop("const")]
        node.setdefault("type", "string")
    if "exclusiveMinimum" in node and not isinstance(node["exclusiveMinimum"], bool):
        node["minimum"] = node["exclusiveMinimum"]
        node["exclusiveMinimum"] = True
    if "enum" in node and "type" not in node:
        node["type"] = "string"
    properties = node.get("properties")
    if isinstance(properties, dict):
        node["properties"] = {k: _structural(v) for k, v in properties.items() if v is not True}
        node.setdefault("type", "object")
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        # A map: structural schemas allow additionalProperties with a schema (not with properties).
        node["additionalProperties"] = _structural(_flatten_all_of(extra))
        node.setdefault("type", "object")
        node.pop("properties", None)
    if isinstance(node.get("items"), dict):
        node["items"] = _structural(node["items"])
    return {k: v for k, v in node.items() if k not in _DROP or (k == "additionalProperties" and isinstance(v, dict))}


def _flatten_all_of(node: dict[str, Any]) -> dict[str, Any]:
    """``{allOf: [S], properties: P}`` as one schema: S with P's properties added (spec.drivers' values)."""
    parts = node.get("allOf")
    if not parts:
        return node
    merged: dict[str, Any] = copy.deepcopy(parts[0])
    for part in parts[1:]:
        merged.setdefault("properties", {}).update(part.get("properties") or {})
    merged.setdefault("properties", {}).update(node.get("properties") or {})
    for key, value in node.items():
        if key not in ("allOf", "properties"):
            merged[key] = value
    return merged


_CEL_RESERVED = {"true", "false", "null", "in", "as", "break", "const", "continue", "else", "for", "function", "if",
                 "import", "let", "loop", "package", "namespace", "return", "var", "void", "while"}


def _cel_field(name: str) -> str:
    """A property name as a CEL field: a reserved word is escaped as ``__name__`` (Kubernetes' CEL escaping)."""
    return f"__{name}__" if name in _CEL_RESERVED else name


def _merge_discriminated(node: dict[str, Any], branches: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """A ``oneOf`` on ``key`` as one object with CEL rules: each value of ``key`` requires its branch's required
    fields and forbids the fields only other branches have."""
    properties: dict[str, Any] = {}
    values: list[str] = []
    for b in branches:
        for name, prop in (b.get("properties") or {}).items():
            if name == key:
                values.append(str(prop["const"]))
            elif name not in properties:
                properties[name] = prop
    discriminator = {"type": "string", "enum": values}
    if isinstance((node.get("properties") or {}).get(key), dict):
        discriminator.update({k: v for k, v in node["properties"][key].items() if k not in ("const", "enum")})
    rules: list[dict[str, Any]] = list(node.get("x-kubernetes-validations") or [])
    for b in branches:
        value = str(b["properties"][key]["const"])
        own = set(b.get("properties") or {}) - {key}
        required = [r for r in b.get("required") or [] if r != key]
        foreign = sorted(set(properties) - own)
        if required:
            rules.append({
                "rule": f"self.{key} != '{value}' || ({' && '.join(f'has(self.{_cel_field(r)})' for r in required)})",
                "message": f"{key} {value} requires {', '.join(required)}",
            })
        if foreign:
            rules.append({
                "rule": f"self.{key} != '{value}' || !({' || '.join(f'has(self.{_cel_field(f)})' for f in foreign)})",
                "message": f"{key} {value} takes none of {', '.join(foreign)}",
            })
    out = {k: v for k, v in node.items() if k not in ("properties", "x-kubernetes-validations")}
    out["type"] = "object"
    out["properties"] = {key: discriminator, **properties}
    if rules:
        out["x-kubernetes-validations"] = rules
    return out


def crd_schema() -> dict[str, Any]:
    """The ``openAPIV3Schema`` of the GuardPolicy CRD: the JSON Schema's ``spec``, structural, plus ``status``."""
    source = json_schema()
    resolved = _resolve(source, source.get("$defs") or {})
    spec = _structural(resolved["properties"]["spec"])
    return {
        "type": "object",
        "description": str(source.get("title", KIND)) + ": the policy csinode-guard enforces on writes of "
        "CSINode.spec.drivers[].allocatable.count (KEP-4876). Cluster-scoped; the guard serves the one its "
        "--guard-policy names (default: default).",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": STATUS_SCHEMA,
        },
    }


def crd() -> dict[str, Any]:
    """The GuardPolicy CustomResourceDefinition (apiextensions.k8s.io/v1): cluster-scoped, one version
    (``v1alpha1``, served and stored), the status subresource, printer columns and short name ``gp``."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/name": "csinode-guard"}},
        "spec": {
            "group": GROUP,
            "scope": "Cluster",
            "names": {
                "plural": PLURAL,
                "singular": "guardpolicy",
                "kind": KIND,
                "listKind": f"{KIND}List",
                "shortNames": ["gp"],
                "categories": ["csinode-guard"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": crd_schema()},
                }
            ],
        },
    }


def crd_yaml() -> str:
    """:func:`crd` as the YAML shipped in ``deploy/base/guardpolicy-crd.yaml`` (with a header saying so)."""
    import yaml  # noqa: PLC0415

    header = (
        "# Generated by `csinode-guard policy crd` from webhook/schema/guardpolicy.schema.json: do not edit.\n"
        "# tests/deploy fails when this file differs from the generator's output; regenerate with\n"
        "#   csinode-guard policy crd > deploy/base/guardpolicy-crd.yaml\n"
    )
    return header + yaml.safe_dump(crd(), sort_keys=False, width=120)
