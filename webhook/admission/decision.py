"""What :func:`webhook.admission.evaluation.evaluate` decides about one AdmissionRequest, as values. Pure.

:class:`AdmissionDecision` is the AdmissionResponse plus everything the audit records
(:mod:`webhook.admission.audit_records`), the metrics and the CLIs read: every rule's outcome per change
(:class:`RuleOutcome`), what happened to each count change (:class:`ChangeOutcome`), the notes
(:class:`Note`, each with the driver it is about), the state problem and the next state. :func:`explain` and
:func:`response_summary` render a decision for people and tests.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

from webhook.admission.csinode import CountChange
from webhook.admission.policy import EnforcementAction
from webhook.admission.review import AdmissionResponse
from webhook.admission.state import GuardState, StateProblem


class Mode(enum.StrEnum):
    """Which endpoint asks: /mutate may clamp and writes state; /validate checks the final object."""

    MUTATE = "mutate"
    VALIDATE = "validate"


class Decision(enum.StrEnum):
    """The outcome label used in metrics, audit records and auditAnnotations."""

    ALLOW = "allow"
    WARN = "warn"
    CLAMP = "clamp"
    DENY = "deny"
    INVALID = "invalid"
    SKIP = "skip"


class Note(str):
    """A note of an evaluation (a warning that no rule raised): its text, and the changed driver it is about.

    A ``str`` whose value is the text, so whatever reads notes as text (AdmissionResponse warnings, logs,
    :func:`explain`) reads them as before; ``driver`` names the driver the note is about (None: the request, an
    annotation, or no driver), which the audit record of that driver's change carries
    (:func:`webhook.admission.audit_records.build_records`) without parsing the text.
    """

    driver: str | None

    def __new__(cls, text: str, driver: str | None = None) -> Note:
        note = super().__new__(cls, text)
        note.driver = driver
        return note

    @property
    def text(self) -> str:
        """The note's text as a plain ``str``."""
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"Note({self.text!r}, driver={self.driver!r})"


class RuleOutcome(NamedTuple):
    """One rule's result for one change (``driver`` None: a request-level finding); an immutable named tuple
    (five or more per review: cheaper to build than a frozen dataclass).

    ``result`` is ``pass`` or ``violation``; ``enforcement`` the configured action, ``effective`` what it did
    after scope, exemptions and mode. ``message`` is the full ``[rule] node/driver: old -> new: why; how``
    line for violations, a short explanation for passes.
    """

    rule: str
    driver: str | None
    result: str
    enforcement: EnforcementAction | None
    effective: EnforcementAction | None
    message: str


class ChangeOutcome(NamedTuple):
    """What happened to one count change: requested ``new``, admitted ``final`` (None = unbounded)."""

    change: CountChange
    final: int | None
    writer_version: str | None
    correction: str | None = None
    frozen: bool = False
    notes: tuple[str, ...] = ()
    stored: tuple[int | None, ...] = ()
    """The count the object held before the write, when it is not ``change.old`` (an entry judged from the last
    count the guard accepted, after a write that went through unjudged); empty otherwise."""

    @property
    def before(self) -> int | None:
        """The count the object held before the write (what a refusal keeps)."""
        return self.stored[0] if self.stored else self.change.old


class AdmissionDecision(NamedTuple):
    """The result of :func:`evaluate`: the AdmissionResponse plus everything audit and metrics need."""

    response: AdmissionResponse
    decision: Decision
    node: str = ""
    outcomes: tuple[RuleOutcome, ...] = ()
    changes: tuple[ChangeOutcome, ...] = ()
    state_problem: StateProblem | None = None
    state_detail: str = ""
    exempt: bool = False
    in_scope: bool = True
    approvals_recorded: int = 0
    new_state: GuardState | None = None
    notes: tuple[Note, ...] = ()
    """Notes of the evaluation, in order; they are also the last warnings of the response."""

    @property
    def fired_rules(self) -> list[str]:
        """Ids of rules with a violation, in order, without repeats."""
        seen: list[str] = []
        for o in self.outcomes:
            if o.result == "violation" and o.rule not in seen:
                seen.append(o.rule)
        return seen


def explain(decision: AdmissionDecision) -> list[str]:
    """One human-readable line per rule outcome (``evaluate`` CLI, ``policy test`` diffs)."""
    lines = []
    for o in decision.outcomes:
        where = o.driver or "(request)"
        if o.result == "pass":
            lines.append(f"{o.rule:16} {where}: pass - {o.message}")
        else:
            effective = o.effective.value if o.effective else "?"
            configured = o.enforcement.value if o.enforcement else "?"
            lines.append(f"{o.rule:16} {where}: violation ({configured} -> {effective}) - {o.message}")
    for note in decision.notes:
        lines.append(f"note: {note}")
    if decision.state_problem is not None and decision.state_problem is not StateProblem.MISSING:
        lines.append(f"state: ignored ({decision.state_problem.value}: {decision.state_detail}); entries judged as new")
    return lines


def response_summary(decision: AdmissionDecision) -> dict[str, Any]:
    """A compact dict of a decision (decision, fired rules, finals) for CLIs and tests."""
    return {
        "decision": decision.decision.value,
        "rules": decision.fired_rules,
        "finals": {c.change.driver: c.final for c in decision.changes},
    }
