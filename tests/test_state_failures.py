"""State that is not used, through the real server: counted per reason (``missing`` too), logged when unusable.

The monitoring overlay's alert on ``csinode_guard_state_verification_failures_total`` leaves ``reason="missing"``
out (tests/deploy); this checks that the series it filters exists and that the others are logged once each.
"""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

from tests.kube import EBS, base_csinode, kubelet_update, review, with_annotation
from webhook.admission.state import STATE_ANNOTATION, EntryState, GuardState, StateKeys, encode_state, parse_time


def scrape_until(server: Any, *wanted: str) -> str:
    """The metrics text once every line of ``wanted`` is in it (the workers flush once a second)."""
    deadline = time.monotonic() + 15
    while True:
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
        if all(w in text for w in wanted) or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def test_missing_state_is_counted_and_a_bad_signature_is_counted_and_logged_once(server_factory: Any) -> None:
    server = server_factory("--workers", "1")
    stored = kubelet_update(base_csinode(), EBS, 25)
    uid = stored["metadata"]["uid"]
    forged_value = encode_state(
        GuardState(uid, {EBS: EntryState(count=25, changed_at=parse_time("2026-11-30T01:00:00Z"))}),
        StateKeys([b"not the server's key, 32 bytes!!"]),
    )
    forged = with_annotation(stored, STATE_ANNOTATION, forged_value)

    for _ in range(2):  # no state yet: the entry's first judged write
        assert server.post("/mutate", review(stored, kubelet_update(stored, EBS, 24))).status == 200
    assert server.post("/mutate", review(forged, kubelet_update(forged, EBS, 24))).status == 200

    missing = 'csinode_guard_state_verification_failures_total{reason="missing"} 2.0'
    bad = 'csinode_guard_state_verification_failures_total{reason="bad-signature"} 1.0'
    text = scrape_until(server, missing, bad)
    assert missing in text and bad in text, [line for line in text.splitlines() if "state_verification" in line]

    log = server.stderr_path.read_text()
    warnings = [line for line in log.splitlines() if "state annotation" in line]
    assert len(warnings) == 1, warnings
    assert "bad-signature" in warnings[0] and stored["metadata"]["name"] in warnings[0]
    assert "WARNING" in warnings[0]
    assert json.loads(forged_value)["sig"] not in log and forged_value not in log
