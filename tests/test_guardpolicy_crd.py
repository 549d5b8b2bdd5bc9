"""The GuardPolicy CRD's schema is the JSON Schema the guard validates with: every field, every constraint.

The apiserver's own refusals (paths, CEL) are tests/k8s/test_guardpolicy.py; here, without a cluster, the CRD
shipped in deploy/ is what ``csinode-guard policy crd`` prints, and walking the JSON Schema (``$ref`` inlined)
beside the CRD's ``spec`` finds each of its fields with the same type, bounds, patterns, enums, required fields
and description, or the CEL rule that says it where a structural schema cannot.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from webhook.kube.guardpolicy_crd import _resolve, crd, crd_schema, json_schema

REPO = Path(__file__).resolve().parents[1]
CARRIED = ("pattern", "minimum", "maximum", "minLength", "maxLength", "minItems", "maxItems", "minProperties",
           "maxProperties", "description")


def _rules(node: dict[str, Any]) -> str:
    return " ".join(r["rule"] for r in node.get("x-kubernetes-validations") or [])


def _compare(source: Any, target: dict[str, Any], path: str, seen: list[str]) -> None:
    """``source`` (JSON Schema, resolved) is said by ``target`` (the CRD's node at ``path``)."""
    if not isinstance(source, dict):
        return
    seen.append(path)
    branches = source.get("oneOf")
    if branches is not None:
        types = sorted(str(b.get("type")) for b in branches)
        if types == ["number", "string"]:  # a duration: int-or-string with a CEL rule holding the pattern
            assert target.get("x-kubernetes-int-or-string") is True, path
            string = next(b for b in branches if b.get("type") == "string")
            assert string["pattern"] in _rules(target), path
            assert target.get("description") == source.get("description"), path
            return
        if "null" in types:  # nullable
            assert target.get("nullable") is True, path
            [other] = [b for b in branches if b.get("type") != "null"]
            _compare({**other, **{k: v for k, v in source.items() if k != "oneOf"}}, target, path, seen)
            return
        # discriminated: every branch's fields are there, and its const and required fields are CEL rules
        for branch in branches:
            for key, prop in (branch.get("properties") or {}).items():
                assert key in target["properties"], f"{path}.{key}"
                if "const" in prop:
                    assert prop["const"] in target["properties"][key]["enum"], f"{path}.{key}"
                    rules = _rules(target)
                    assert f"self.{key} != '{prop['const']}'" in rules, path
                    for required in branch.get("required") or []:
                        if required != key:
                            assert f"has(self.{required})" in rules or f"has(self.__{required}__)" in rules, path
                else:
                    _compare(prop, target["properties"][key], f"{path}.{key}", seen)
        return
    types = source.get("type")
    if isinstance(types, list):
        assert ("null" in types) == bool(target.get("nullable")), path
        types = next(t for t in types if t != "null")
    if types is not None:
        assert target.get("type") == types, f"{path}: {target.get('type')} != {types}"
    if "const" in source:
        assert target["enum"] == [source["const"]], path
    if "enum" in source:
        assert target["enum"] == source["enum"], path
    if "exclusiveMinimum" in source:
        assert target["minimum"] == source["exclusiveMinimum"] and target["exclusiveMinimum"] is True, path
    for key in CARRIED:
        if key in source:
            assert target.get(key) == source[key], f"{path}: {key}"
    assert sorted(target.get("required") or []) == sorted(source.get("required") or []), path
    assert _rules(target) == " ".join(r["rule"] for r in source.get("x-kubernetes-validations") or []), path
    properties = {k: v for k, v in (source.get("properties") or {}).items() if v is not True}
    extra = source.get("additionalProperties")
    if isinstance(extra, dict):
        parts = [*(extra.get("allOf") or []), {"properties": extra.get("properties") or {}}]
        merged: dict[str, Any] = {}
        for part in parts:
            merged.update({k: v for k, v in (part.get("properties") or {}).items() if v is not True})
        assert isinstance(target.get("additionalProperties"), dict), path
        if merged:
            assert set(target["additionalProperties"]["properties"]) == set(merged), path
            for key, prop in merged.items():
                _compare(prop, target["additionalProperties"]["properties"][key], f"{path}[*].{key}", seen)
        else:
            _compare(extra, target["additionalProperties"], f"{path}[*]", seen)
        return
    if properties:
        assert set(target.get("properties") or {}) == set(properties), path
        for key, prop in properties.items():
            _compare(prop, target["properties"][key], f"{path}.{key}", seen)
    if isinstance(source.get("items"), dict):
        _compare(source["items"], target["items"], f"{path}[]", seen)


def test_the_crd_says_every_field_and_constraint_of_the_json_schema() -> None:
    source = json_schema()
    resolved = _resolve(source, source["$defs"])
    seen: list[str] = []
    _compare(resolved["properties"]["spec"], crd_schema()["properties"]["spec"], "spec", seen)
    assert "spec.drivers[*].ceiling.patterns[].match" in seen
    assert "spec.rules.change-rate.clusterBudget.increasesPerSecond" in seen
    assert len(seen) > 80


def test_the_crd_is_structural_no_ref_and_every_field_typed() -> None:
    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            assert "$ref" not in node and "oneOf" not in node and "const" not in node, path
            if path.count(".properties.") and not node.get("x-kubernetes-int-or-string") and \
                    not path.endswith(("x-kubernetes-validations", "anyOf")):
                assert "type" in node, path
            for key, value in node.items():
                if key in ("properties",):
                    for name, child in value.items():
                        walk(child, f"{path}.properties.{name}")
                elif key in ("items", "additionalProperties"):
                    walk(value, f"{path}.{key}")

    for version in crd()["spec"]["versions"]:
        walk(version["schema"]["openAPIV3Schema"], "openAPIV3Schema")


def test_policy_crd_prints_the_shipped_crd() -> None:
    out = subprocess.run([sys.executable, "-m", "webhook", "policy", "crd"], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout == (REPO / "deploy" / "base" / "guardpolicy-crd.yaml").read_text("utf-8")
    shipped = yaml.safe_load(out.stdout)
    [version] = shipped["spec"]["versions"]
    assert shipped["spec"]["scope"] == "Cluster" and version["served"] and version["storage"]
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Enforcement", "Reconcile", "Accepted", "Ready", "Replicas", "Age"]
