"""The rules, one pure module each. ``RULES`` lists them in evaluation order by their stable ids."""

from __future__ import annotations

from collections.abc import Callable

from webhook.admission.rules import change_rate, count_ceiling, count_rollback, writer_identity, writer_version
from webhook.admission.rules.base import RuleContext, Violation

Check = Callable[[RuleContext], list[Violation]]

RULES: tuple[tuple[str, Check], ...] = (
    (writer_identity.RULE_ID, writer_identity.check),
    (writer_version.RULE_ID, writer_version.check),
    (count_ceiling.RULE_ID, count_ceiling.check),
    (count_rollback.RULE_ID, count_rollback.check),
    (change_rate.RULE_ID, change_rate.check),
)

__all__ = ["RULES", "Check", "RuleContext", "Violation"]
