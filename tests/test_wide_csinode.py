"""Judging grows linearly with the drivers of a CSINode: each change looks only at its own driver's approvals.

Not timed (``python -m benchmarks.wide_csinode`` measures the time): the measure is how many times an approval
is checked, which was drivers x approvals before (3.4 s for 4,000 drivers with one approval each).
"""

from __future__ import annotations

import pytest

from benchmarks.wide_csinode import measure


@pytest.mark.parametrize("drivers", [200, 800])
def test_each_change_checks_only_its_own_drivers_approvals(drivers: int) -> None:
    result = measure(drivers, approvals=True)
    assert result["decision"] == "allow"
    assert result["approval_checks_per_driver"] <= 2, result
