"""Records the guard signs and keeps where only it writes: the node history records and the brakes (ConfigMaps in
the guard's namespace, ``data.record``). One format: a JSON object with a format version ``v``, its fields, and
``sig``, the HMAC of the canonical form of everything else with a state key (:class:`webhook.admission.state.StateKeys`,
the same keys as the CSINode states). Pure: no I/O."""

from __future__ import annotations

import json
from collections.abc import Set
from typing import Any

from webhook.admission.state import StateKeys, _canonical


def seal_record(doc: dict[str, Any], keys: StateKeys) -> str:
    """``doc`` (a JSON object without ``sig``) signed with the signing key, in the canonical form (ASCII)."""
    signed = {**doc, "sig": keys.sign(_canonical(doc))}
    return _canonical(signed).decode("ascii")


def open_record(
    value: str | None, keys: StateKeys, *, version: int, fields: Set[str], max_bytes: int
) -> dict[str, Any] | None:
    """The fields of a sealed record (``sig`` removed) when ``value`` is a JSON object of at most ``max_bytes``
    characters with format ``version``, exactly ``fields`` besides ``sig``, and a signature one of ``keys``
    verifies; None otherwise (absent, malformed, too long, another format, edited, forged). Never raises."""
    if not value or len(value) > max_bytes:
        return None
    try:
        doc = json.loads(value)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("v") != version:
        return None
    signature = doc.pop("sig", None)
    if not isinstance(signature, str) or set(doc) != fields:
        return None
    try:
        if not keys.verify(_canonical(doc), signature):
            return None
    except (TypeError, ValueError, RecursionError):
        return None
    return doc
