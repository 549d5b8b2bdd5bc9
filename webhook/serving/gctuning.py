"""Garbage-collector settings of a serving worker: what lives long is frozen, requests' garbage dies young.

A review allocates a few hundred containers (the decoded 6.6 KB AdmissionReview with its managedFields, the
value objects of the judgement) that are all alive until the answer is built, and almost none survive it:
reference counting frees them, and none of them form cycles. CPython's default first-generation threshold
(700 allocations) starts a collection in the middle of nearly every review; it scans the live objects of that
review and promotes them, and the older generations then scan them again. A threshold of 10,000 lets a
collection run once every few dozen reviews and find mostly freed memory: measured on the core benchmark,
p50 -15 % and mean -25 %, with no growth of the resident set (benchmarks/run.py, memory section).
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000
"""Allocations minus deallocations of containers between two collections of the youngest generation."""


def settle_for_requests() -> None:
    """Collect once, freeze every object alive now, and raise the youngest generation's threshold.

    Called in each worker after the app is built (and by the core benchmark, to measure the same thing).
    Frozen objects (the app, the policy, the caches built at start) are never scanned again by full
    collections; older generations keep CPython's default thresholds.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
