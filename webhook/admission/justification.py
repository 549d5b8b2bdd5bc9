"""Operator justifications: the ``csinode-guard.io/justification`` annotation on a CSINode.

An approver approves an unusual change ahead of time with a JSON list::

    [{"driver": "ebs.csi.aws.com", "reason": "replaced ENI config", "minCount": 0, "maxCount": 10,
      "expires": "2026-12-01T00:00:00Z", "ticket": "OPS-123"}]

It counts only when a principal listed under ``spec.justifiers`` in the policy set it; the guard then records
the approval (who, when, what) in its signed state (``webhook.admission.state``). This module only parses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime

from webhook.admission.csinode import INT32_MAX
from webhook.admission.state import parse_time

JUSTIFICATION_ANNOTATION = "csinode-guard.io/justification"


class JustificationError(ValueError):
    """The justification annotation is not a JSON list of valid entries (message says which)."""


@dataclass(frozen=True)
class Justification:
    """One approval request: ``driver`` counts in [min_count, max_count] are justified until ``expires``."""

    driver: str
    reason: str
    min_count: int
    max_count: int
    expires: datetime
    ticket: str


MAX_ENTRIES = 256
"""Justifications one annotation may hold (a node has a few drivers; the apiserver caps annotations at 256 KiB)."""


def _int(entry: dict[str, object], key: str, where: str) -> int:
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= INT32_MAX:
        # allocatable.count is an int32: no justification needs more, and the signed state must hold it exactly
        raise JustificationError(f"{where}.{key} must be an integer from 0 to {INT32_MAX}")
    return value


def parse_justifications(value: str) -> list[Justification]:
    """Parse the annotation value; raises :class:`JustificationError` naming the bad entry and field."""
    try:
        doc = json.loads(value)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, or an integer over 4300 digits
        raise JustificationError(f"{JUSTIFICATION_ANNOTATION} is not JSON: {exc}") from None
    if isinstance(doc, dict):
        doc = [doc]
    if not isinstance(doc, list):
        raise JustificationError(f"{JUSTIFICATION_ANNOTATION} must be a JSON list of objects")
    if len(doc) > MAX_ENTRIES:
        raise JustificationError(f"{JUSTIFICATION_ANNOTATION} has {len(doc)} entries; at most {MAX_ENTRIES}")
    result: list[Justification] = []
    for i, entry in enumerate(doc):
        where = f"{JUSTIFICATION_ANNOTATION}[{i}]"
        if not isinstance(entry, dict):
            raise JustificationError(f"{where} must be an object")
        driver = entry.get("driver")
        reason = entry.get("reason")
        expires = entry.get("expires")
        if not isinstance(driver, str) or not driver:
            raise JustificationError(f"{where}.driver must be a driver name")
        if not isinstance(reason, str) or not reason.strip():
            raise JustificationError(f"{where}.reason must say why")
        if not isinstance(expires, str):
            raise JustificationError(f"{where}.expires must be an RFC 3339 time")
        try:
            when = parse_time(expires).astimezone(UTC)  # also refuses a time that UTC cannot hold (year 10000)
        except (ValueError, OverflowError):
            raise JustificationError(f"{where}.expires must be an RFC 3339 time") from None
        min_count = _int(entry, "minCount", where)
        max_count = _int(entry, "maxCount", where)
        if min_count > max_count:
            raise JustificationError(f"{where}: minCount {min_count} is above maxCount {max_count}")
        ticket = entry.get("ticket", "")
        result.append(
            Justification(
                driver=driver,
                reason=reason.strip(),
                min_count=min_count,
                max_count=max_count,
                expires=when,
                ticket=str(ticket) if ticket is not None else "",
            )
        )
    return result
