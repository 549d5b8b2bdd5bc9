"""The evaluation's time budget: a deadline the stages look at, and what they raise past it.

The core reads no clock (its ``now`` is an argument): the caller passes ``deadline``, a function that answers
True once the budget is spent (the serving layer's is ``time.monotonic() > t``; tests pass one they control).
The stages call :func:`check_deadline` between themselves and every :data:`CHECK_EVERY` changes while judging;
past the deadline they raise :class:`OutOfTimeError`, and :func:`webhook.admission.evaluation.evaluate` answers with
what it already knows to be safe (:mod:`.hurried`).
"""

from __future__ import annotations

from collections.abc import Callable

Deadline = Callable[[], bool]
"""True once the evaluation's time budget is spent."""

CHECK_EVERY = 64
"""Changes judged between two looks at the deadline (a look costs a function call)."""


class OutOfTimeError(Exception):
    """The evaluation's deadline passed before it finished."""


def check_deadline(deadline: Deadline | None) -> None:
    """Raise :class:`OutOfTimeError` when ``deadline`` (None: no budget) says the budget is spent."""
    if deadline is not None and deadline():
        raise OutOfTimeError
