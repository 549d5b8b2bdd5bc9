"""Stage 3, settle: what the rules found (:class:`~.judge.Judgement`) -> a :class:`Settlement`.

Each finding gets its effective action (:mod:`.effective`) and its place among the decision's rule outcomes (a
rule has one outcome per change: a pass, or its violations); each change its final count (clamps -> the most
restrictive allowed count, the one closest to the old); then, in /mutate, a denial that only forbids a rise
that clamps already prevent becomes a clamp (moot), and when nothing is denied the cluster budget is asked
for the increases the request would admit (change-rate judges them with its answer). Any ``deny`` -> denied
(403, a line per violation); otherwise clamps, warnings, or allowed (:mod:`.messages`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from webhook.admission.budget import IncreaseBudget
from webhook.admission.csinode import CountChange, format_count
from webhook.admission.decision import Decision, Mode, Note, RuleOutcome
from webhook.admission.evaluation.classify import Write
from webhook.admission.evaluation.effective import Finding, effective_action, freezes, keeps_stored_count
from webhook.admission.evaluation.judge import Found, Judgement, judge_budget
from webhook.admission.evaluation.messages import admitted_lines, denial_lines
from webhook.admission.evaluation.wording import finding_line
from webhook.admission.policy import EnforcementAction
from webhook.admission.rules.base import BudgetAnswer, Violation


class Settlement(NamedTuple):
    """The settled findings of one write.

    ``findings`` with their effective actions, ``outcomes`` every rule's outcome per change (and the
    request-level ones), ``notes`` the classification's and the judging's notes; ``finals`` the count each
    changed entry ends with (denied or not); ``decision`` deny, clamp, warn or allow; ``message`` a denial's
    lines (empty when admitted); ``warnings`` the answer's warnings, the notes not included; ``freezing`` the
    indices of the changes a version rollback freezes (admitted writes only).
    """

    findings: tuple[Finding, ...]
    outcomes: tuple[RuleOutcome, ...]
    notes: tuple[Note, ...]
    finals: Mapping[str, int | None]
    decision: Decision
    message: tuple[str, ...]
    warnings: tuple[str, ...]
    freezing: frozenset[int]


def closest_to_old(change: CountChange, targets: list[int]) -> int:
    """Of the counts clamps allow, the most restrictive: the lowest for an increase or a first registration (every
    clamp of one caps it), else the highest."""
    if change.is_increase or change.is_first_registration:
        return min(targets)
    return max(targets)


def rises(change: CountChange, final: int | None) -> bool:
    """True when ``final`` is above the change's old count (unbounded counts as above)."""
    if final is None:
        return change.old is not None
    return change.old is not None and final > change.old


class _Ledger:
    """The findings and outcomes of one settling, in order (lists filled by :meth:`add`; no attribute is assigned
    after the constructor)."""

    def __init__(self, write: Write) -> None:
        self.write = write
        self.findings: list[Finding] = []
        self.outcomes: list[RuleOutcome] = []
        self.notes: list[Note] = [*write.notes, *write.declarations.notes]
        self.by_change: dict[int, list[int]] = {}  # change index -> positions of its findings
        self.starts: dict[str, int] = {}  # driver of a change -> index of its first outcome (drivers are unique)

    def _passed_at(self, change: CountChange, rule: str) -> int | None:
        """The index of ``rule``'s "pass" outcome on ``change``, if it has one (among the change's own
        outcomes: judged together)."""
        start = self.starts.get(change.driver)
        if start is None:
            return None
        for i in range(start, len(self.outcomes)):
            o = self.outcomes[i]
            if o.driver != change.driver:
                return None
            if o.rule == rule and o.result == "pass":
                return i
        return None

    def add(self, index: int | None, v: Violation, force: EnforcementAction | None = None) -> None:
        """Record a finding. A rule has one outcome per change: a pass, or its violations; so a violation found
        once the rule knows more (change-rate, given the cluster budget's answer) takes the place of its pass.
        ``force`` sets the effective action whatever the scope and the write (a refusal for everyone)."""
        write = self.write
        change = write.changes[index] if index is not None else None
        if change is not None:
            self.starts.setdefault(change.driver, len(self.outcomes))
        effective = force or effective_action(write, v, change)
        if effective is EnforcementAction.DENY and change is not None and keeps_stored_count(write, v, change):
            # deny acts as clamp for the node's kubelet: to the count the denial would have kept (the stored one).
            effective = EnforcementAction.CLAMP
            v = v._replace(clamp_to=change.old)
            note = Note(
                f"{write.node}/{change.driver}: {v.rule} deny acts as clamp for the node's kubelet "
                f"(to the stored count {format_count(change.old)}; kubelet's write succeeds)",
                change.driver,
            )
            if note not in self.notes:
                self.notes.append(note)
        passed = self._passed_at(change, v.rule) if change is not None else None
        at = len(self.outcomes) if passed is None else passed
        self.findings.append(Finding(change, index, v, effective, at))
        if index is not None:
            self.by_change.setdefault(index, []).append(len(self.findings) - 1)
        suffix = f" (clamped to {format_count(v.clamp_to)})" if effective is EnforcementAction.CLAMP else ""
        outcome = RuleOutcome(
            rule=v.rule,
            driver=change.driver if change else None,
            result="violation",
            enforcement=v.action,
            effective=effective,
            message=finding_line(write.node, change, v, suffix),
        )
        if at < len(self.outcomes):
            self.outcomes[at] = outcome
        else:
            self.outcomes.append(outcome)

    def finals(self) -> dict[str, int | None]:
        finals: dict[str, int | None] = {}
        findings = self.findings
        for i, c in enumerate(self.write.changes):
            targets = [
                target
                for p in self.by_change.get(i, ())
                if findings[p].effective is EnforcementAction.CLAMP
                and (target := findings[p].violation.clamp_to) is not None
            ]
            finals[c.driver] = closest_to_old(c, targets) if targets else c.new
        return finals

    def settle_moot_denials(self, finals: Mapping[str, int | None]) -> None:
        """A denial that only forbids any rise (change-rate, a freeze) is moot when clamps already keep the old
        count: the write then becomes a clamp that changes nothing — one request per period instead of kubelet's
        four retries of a denial (DESIGN.md, write amplification)."""
        if self.write.mode is not Mode.MUTATE:
            return
        for pos, f in enumerate(self.findings):
            c = f.change
            if (
                c is not None
                and f.effective is EnforcementAction.DENY
                and c.old is not None
                and f.violation.clamp_to == c.old
                and finals[c.driver] == c.old
                and c.new != c.old
            ):
                self.findings[pos] = f._replace(effective=EnforcementAction.CLAMP)
                self.outcomes[f.outcome] = self.outcomes[f.outcome]._replace(
                    effective=EnforcementAction.CLAMP,
                    message=finding_line(self.write.node, c, f.violation, f" (clamped to {format_count(c.old)})"),
                )

    def check_budget(self, judgement: Judgement, finals: Mapping[str, int | None], budget: IncreaseBudget | None,
                     clock: float) -> bool:
        """Ask the cluster-wide budget for the increases the request would admit, one by one in the object's order
        within the node's fair share (taking them; a dry run only looks), and let change-rate judge each with its
        own answer: what fits is admitted, the rest found (clamped for the node's kubelet). A driver the cluster
        has no CSIDriver object for asks nothing. True when change-rate found something."""
        write = self.write
        if budget is None or write.mode is not Mode.MUTATE:
            return False
        rising = [(i, c) for i, c in enumerate(write.changes)
                  if not c.registration and rises(c, finals[c.driver]) and c.driver not in judgement.unbudgeted]
        if not rising:
            return False
        # A dry run gets the decision a real request would get, but takes nothing from the budget.
        granted = budget.admit(write.node, len(rising), clock, dry_run=write.request.dry_run)
        found = False
        for k, (i, c) in enumerate(rising):
            answer = BudgetAnswer(budget.rate, budget.burst, k < granted)
            for v in judge_budget(judgement.contexts[c.driver], answer):
                self.add(i, v)
                found = True
        return found


def settle(write: Write, judgement: Judgement, budget: IncreaseBudget | None = None,
           budget_clock: float | None = None) -> Settlement:
    """Settle ``judgement`` of ``write``. ``budget`` (/mutate only; a dry-run request is judged against it
    without taking from it) is read with ``budget_clock`` seconds (None: ``write.now`` as a timestamp)."""
    ledger = _Ledger(write)
    outcomes, starts = ledger.outcomes, ledger.starts
    for verdict in judgement.verdicts:
        if isinstance(verdict, RuleOutcome):  # a pass
            starts.setdefault(verdict.driver or "", len(outcomes))
            outcomes.append(verdict)
        elif isinstance(verdict, Found):
            ledger.add(verdict.change, verdict.violation, verdict.force)
        else:
            ledger.notes.append(verdict.note)
    finals = ledger.finals()
    ledger.settle_moot_denials(finals)
    denied = [f for f in ledger.findings if f.effective is EnforcementAction.DENY]
    clock = budget_clock if budget_clock is not None else write.now.timestamp()
    if not denied and ledger.check_budget(judgement, finals, budget, clock):
        finals = ledger.finals()
        denied = [f for f in ledger.findings if f.effective is EnforcementAction.DENY]
    findings = tuple(ledger.findings)
    if denied:
        lines, others = denial_lines(write.node, denied, findings, finals)
        return Settlement(findings, tuple(ledger.outcomes), tuple(ledger.notes), finals, Decision.DENY,
                          tuple(lines), tuple(others), frozenset())
    decision, warnings = admitted_lines(write.node, write.changes, findings, finals)
    freezing = frozenset(f.change_index for f in findings
                         if f.change_index is not None and freezes(write, f.violation, f.change, f.effective))
    return Settlement(findings, tuple(ledger.outcomes), tuple(ledger.notes), finals, decision, (),
                      tuple(warnings), freezing)
