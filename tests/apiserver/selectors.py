"""Label and field selectors as the apiserver parses them (``k8s.io/apimachinery/pkg/labels``, ``.../fields``).

Label selectors: ``k=v``, ``k==v``, ``k!=v``, ``k in (a,b)``, ``k notin (a,b)``, ``k`` (exists), ``!k`` (does not
exist), joined by commas. Field selectors: ``path=value``, ``path==value``, ``path!=value`` joined by commas, where
``path`` is a dotted JSON path (``metadata.name``, ``metadata.namespace``, ``spec.nodeName``, ``status.phase``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

Matcher = Callable[[Mapping[str, Any]], bool]


class SelectorError(ValueError):
    """A selector the apiserver would reject with 400 Bad Request."""


def _split_terms(selector: str) -> list[str]:
    """Split on commas outside parentheses."""
    terms: list[str] = []
    depth = 0
    current = ""
    for char in selector:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            terms.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        terms.append(current.strip())
    return [t for t in terms if t]


_SET_TERM = re.compile(r"^([^\s!=()]+)\s+(in|notin)\s+\(([^)]*)\)$")


def parse_label_selector(selector: str | None) -> Matcher:
    """A predicate on an object's ``metadata.labels`` for a label selector string (None or "" match all)."""
    if not selector:
        return lambda _obj: True
    checks: list[Callable[[Mapping[str, str]], bool]] = []
    for term in _split_terms(selector):
        set_match = _SET_TERM.match(term)
        if set_match:
            key, op, raw_values = set_match.groups()
            values = {v.strip() for v in raw_values.split(",") if v.strip()}
            if op == "in":
                checks.append(lambda labels, k=key, vs=values: labels.get(k) in vs)
            else:
                checks.append(lambda labels, k=key, vs=values: labels.get(k) not in vs)
        elif "!=" in term:
            key, value = (p.strip() for p in term.split("!=", 1))
            checks.append(lambda labels, k=key, v=value: labels.get(k) != v)
        elif "=" in term:
            key, value = (p.strip() for p in term.replace("==", "=", 1).split("=", 1))
            checks.append(lambda labels, k=key, v=value: labels.get(k) == v)
        elif term.startswith("!"):
            key = term[1:].strip()
            checks.append(lambda labels, k=key: k not in labels)
        elif re.fullmatch(r"[A-Za-z0-9._/-]+", term):
            checks.append(lambda labels, k=term: k in labels)
        else:
            raise SelectorError(f"unable to parse requirement: {term!r}")

    def matches(obj: Mapping[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(check(labels) for check in checks)

    return matches


def field_value(obj: Mapping[str, Any], path: str) -> str:
    """The value at a dotted path as the apiserver's field set renders it ("" when absent)."""
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def parse_field_selector(selector: str | None) -> Matcher:
    """A predicate on an object for a field selector string (None or "" match all)."""
    if not selector:
        return lambda _obj: True
    checks: list[Matcher] = []
    for term in _split_terms(selector):
        if "!=" in term:
            path, value = (p.strip() for p in term.split("!=", 1))
            checks.append(lambda obj, p=path, v=value: field_value(obj, p) != v)
        elif "=" in term:
            path, value = (p.strip() for p in term.replace("==", "=", 1).split("=", 1))
            checks.append(lambda obj, p=path, v=value: field_value(obj, p) == v)
        else:
            raise SelectorError(f"invalid field selector term: {term!r}")
    return lambda obj: all(check(obj) for check in checks)
