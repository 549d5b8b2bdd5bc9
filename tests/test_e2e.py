"""End to end: the real server over TLS, kubelet-shaped AdmissionReviews, the apiserver's mutate -> validate flow.

The sequence of the issue: the node registers ebs.csi.aws.com at 25; network interfaces take two slots
(25 -> 23, allowed); a driver downgraded to an old version reports 39 (version rollback, ceiling); increases
faster than the period (denied); an approver's justification, then a drop to 0; an unbounded report (clamped
back). The policy is policies/default.yaml with change-rate's minInterval shortened to 2s, so the test runs in
seconds; everything else is the bundled default.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import signal
import threading
import time
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO, SERVICE_DNS, RunningServer, start_server
from tests.kube import (
    EBS,
    KUBELET,
    apply_response,
    base_csinode,
    counts,
    kubelet_update,
    review,
    with_annotation,
)
from webhook.serving import dev_certs, flushlock, tls

VERSIONS = "csinode-guard.io/driver-versions"
JUSTIFICATION = "csinode-guard.io/justification"
STATE = "csinode-guard.io/state"
APPROVER = {"user": "alice@example.com", "groups": ["csinode-guard:approvers", "system:authenticated"]}
REPORTER = {"user": "version-reporter", "groups": ["system:authenticated"]}


def e2e_policy(tmp_path: Path) -> Path:
    doc = yaml.safe_load((REPO / "policies" / "default.yaml").read_text())
    doc["spec"]["rules"]["change-rate"]["minInterval"] = "2s"
    # Offline there are no node pods: EBS versions come from the annotation, as a version reporter declares them.
    doc["spec"]["drivers"][EBS]["versionSource"] = {"type": "annotation"}
    doc["spec"]["versionReporters"] = {"users": [REPORTER["user"]]}
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


class Apiserver:
    """What kube-apiserver does with the webhooks: /mutate, apply the patch, /validate, store."""

    def __init__(self, server: RunningServer, stored: dict[str, Any]) -> None:
        self.server = server
        self.stored = stored

    def put(self, new: dict[str, Any], *, user: str = KUBELET, groups: list[str] | None = None,
            dry_run: bool = False) -> dict[str, Any]:
        mutate_review = review(self.stored, new, user=user, groups=groups, dry_run=dry_run)
        answer = self.server.post("/mutate", mutate_review)
        assert answer.status == 200, answer.data
        mutated = json.loads(answer.data)
        assert mutated["apiVersion"] == "admission.k8s.io/v1"
        assert mutated["kind"] == "AdmissionReview"
        assert mutated["response"]["uid"] == mutate_review["request"]["uid"]
        if not mutated["response"]["allowed"]:
            return mutated
        final = apply_response(new, mutated)
        validate_review = review(self.stored, final, user=user, groups=groups, dry_run=dry_run)
        checked = json.loads(self.server.post("/validate", validate_review).data)
        assert "patch" not in checked["response"] and "patchType" not in checked["response"]
        assert checked["response"]["uid"] == validate_review["request"]["uid"]
        assert checked["response"]["allowed"], checked["response"]
        if not dry_run:
            self.stored = final
        mutated["final"] = final
        return mutated


def test_kubelet_sequence_is_judged_as_the_design_says(server_factory: Any, tmp_path: Path) -> None:
    server = server_factory("--policy", str(e2e_policy(tmp_path)))
    api = Apiserver(server, base_csinode())

    # The node registers ebs.csi.aws.com at 25: a registration, judged (within the ceiling) and recorded.
    registered = api.put(kubelet_update(api.stored, EBS, 25))
    assert registered["response"]["allowed"] is True
    assert counts(api.stored)[EBS] == 25
    assert json.loads(api.stored["metadata"]["annotations"][STATE])["drivers"][EBS]["count"] == 25
    declared = api.put(with_annotation(api.stored, VERSIONS, json.dumps({EBS: "v1.37.0"})), **REPORTER)
    assert declared["response"]["allowed"] is True
    assert json.loads(api.stored["metadata"]["annotations"][STATE])["declared"][EBS]["by"] == "version-reporter"

    # Network interfaces take two slots: 25 -> 23 from the node's own kubelet passes and is recorded.
    eni = api.put(kubelet_update(api.stored, EBS, 23))
    assert eni["response"]["allowed"] is True
    assert "warnings" not in eni["response"]
    assert counts(api.stored)[EBS] == 23
    state = json.loads(api.stored["metadata"]["annotations"][STATE])
    assert state["drivers"][EBS]["count"] == 23
    assert state["drivers"][EBS]["writerVersion"] == "v1.37.0"
    assert state["uid"] == api.stored["metadata"]["uid"]

    # A driver downgraded to an old version reports 39: version rollback (deny, which acts as a clamp to the stored
    # count for the node's own kubelet) and above the ceiling.
    time.sleep(2.1)
    api.put(with_annotation(api.stored, VERSIONS, json.dumps({EBS: "v1.30.0"})), **REPORTER)
    rollback = api.put(kubelet_update(api.stored, EBS, 39))["response"]
    assert rollback["allowed"] is True
    # Two rules clamp: each line says what its own rule allows, one result line what was applied.
    assert rollback["warnings"][0] == (
        f"[writer-version] ip-10-0-1-23.ec2.internal/{EBS}: 23 -> 39 (this rule allows 23): driver version rolled "
        "back v1.37.0 -> v1.30.0; increases are frozen for 6h; roll the driver forward, or have an approver justify "
        "the rollback"
    )
    assert rollback["warnings"][1].startswith(
        f"[count-ceiling] ip-10-0-1-23.ec2.internal/{EBS}: 23 -> 39 (this rule allows 27): above the ceiling 27")
    assert (f"ip-10-0-1-23.ec2.internal/{EBS}: 23 -> 39 clamped to 23, what every one of writer-version, "
            "count-ceiling allows") in rollback["warnings"]
    assert any("writer-version deny acts as clamp for the node's kubelet" in w for w in rollback["warnings"])
    assert rollback["auditAnnotations"]["decision"] == "clamp"
    assert rollback["auditAnnotations"]["rules"] == "writer-version,count-ceiling"
    assert counts(api.stored)[EBS] == 23

    # Back on v1.37.0, 23 -> 25 passes; a second increase right after it comes faster than the period: held.
    api.put(with_annotation(api.stored, VERSIONS, json.dumps({EBS: "v1.37.0"})), **REPORTER)
    assert api.put(kubelet_update(api.stored, EBS, 25))["response"]["allowed"] is True
    fast = api.put(kubelet_update(api.stored, EBS, 26))["response"]
    assert fast["allowed"] is True
    assert fast["warnings"][0].startswith(f"[change-rate] ip-10-0-1-23.ec2.internal/{EBS}: 25 -> 26 (clamped to 25): ")
    assert counts(api.stored)[EBS] == 25

    # An unbounded report (after the period) is clamped back to the stored count, byte for byte: the PUT is a no-op.
    time.sleep(2.1)
    before = json.dumps(api.stored, sort_keys=False)
    unbounded = api.put(kubelet_update(api.stored, EBS, None))
    assert unbounded["response"]["allowed"] is True
    assert unbounded["response"]["auditAnnotations"]["decision"] == "clamp"
    assert any("clamped to 25" in w for w in unbounded["response"]["warnings"])
    assert json.dumps(api.stored, sort_keys=False) == before

    # An approver's justification for 0 is recorded in the signed state; then kubelet's drop to 0 passes quietly.
    expires = (datetime.now(UTC) + timedelta(hours=2)).strftime("%Y-%m-%dT%H:%M:%SZ")
    justification = [{"driver": EBS, "reason": "instance retirement", "minCount": 0, "maxCount": 0,
                      "expires": expires, "ticket": "OPS-4711"}]
    approved = api.put(with_annotation(api.stored, JUSTIFICATION, json.dumps(justification)), **APPROVER)
    assert approved["response"]["allowed"] is True
    state = json.loads(api.stored["metadata"]["annotations"][STATE])
    assert state["approvals"][0]["approvedBy"] == "alice@example.com"
    assert state["approvals"][0]["ticket"] == "OPS-4711"
    drop = api.put(kubelet_update(api.stored, EBS, 0))
    assert drop["response"]["allowed"] is True
    assert "warnings" not in drop["response"]
    assert counts(api.stored)[EBS] == 0
    correction = json.loads(api.stored["metadata"]["annotations"][STATE])["drivers"][EBS]["correction"]
    assert (correction["from"], correction["to"], correction["basis"]) == (25, 0, "justification")

    # Every answered review has its audit record (mutate and validate), with the rules that fired.
    records = server.audit_records()
    assert not [r for r in records if r["decision"] == "deny"]
    held = [r for r in records if r["decision"] == "clamp" and r["new"] in (39, 26)]
    assert {(r["new"], r["final"]) for r in held} == {(39, 23), (26, 25)}
    assert any(o["effective"] == "clamp" and o["enforcement"] == "deny" for r in held for o in r["rules"])
    assert any(r["decision"] == "clamp" and r["new"] == "unbounded" and r["final"] == 25 for r in records)
    assert server.stop() == 0


def test_an_unjustified_drop_to_zero_is_allowed_with_a_warning(server_factory: Any, tmp_path: Path) -> None:
    server = server_factory()
    stored = kubelet_update(base_csinode(), EBS, 25)
    answer = json.loads(server.post("/mutate", review(stored, kubelet_update(stored, EBS, 0))).data)["response"]
    assert answer["allowed"] is True
    assert answer["auditAnnotations"] == {"decision": "warn", "policy": answer["auditAnnotations"]["policy"],
                                          "rules": "count-rollback"}
    assert answer["warnings"][0].startswith(f"[count-rollback] ip-10-0-1-23.ec2.internal/{EBS}: 25 -> 0: ")
    assert all(len(w) <= 256 and "\n" not in w for w in answer["warnings"])


def test_a_dry_run_gets_the_same_decision(server_factory: Any) -> None:
    server = server_factory()
    stored = kubelet_update(base_csinode(), EBS, 23)
    for dry_run in (False, True):
        body = review(stored, kubelet_update(stored, EBS, 60), dry_run=dry_run)
        answer = json.loads(server.post("/mutate", body).data)["response"]
        assert answer["allowed"] is True
        ops = json.loads(base64.b64decode(answer["patch"]))
        assert {"op": "add", "path": "/spec/drivers/1/allocatable/count", "value": 27} in ops
    records = server.audit_records()
    assert [r["dryRun"] for r in records] == [False, True]


@pytest.mark.parametrize(
    ("body", "content_type", "status", "fragment"),
    [
        pytest.param(b"{not json", "application/json", 400, "not JSON", id="a body that is not JSON is a 400"),
        pytest.param({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {}},
                     "application/json", 400, "admission.k8s.io/v1", id="an AdmissionReview v1beta1 is a 400"),
        pytest.param({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}, "application/json", 400,
                     "no request", id="an AdmissionReview without request is a 400"),
        pytest.param(b"[]", "application/json", 400, "JSON object", id="a JSON list is a 400"),
        pytest.param(b"{}", "text/plain", 415, "Content-Type", id="a wrong content type is a 415"),
        pytest.param(b"", "application/json", 400, "not JSON", id="an empty body is a 400"),
    ],
)
def test_bad_input_gets_a_json_error_and_the_server_keeps_serving(
    server_factory: Any, body: Any, content_type: str, status: int, fragment: str
) -> None:
    server = server_factory()
    answer = server.post("/validate", body, content_type=content_type)
    assert answer.status == status
    error = json.loads(answer.data)
    assert error["code"] == status
    assert fragment in error["error"]
    assert server.get("/healthz").status == 200


def test_a_body_over_the_limit_is_refused_with_413_without_reading_it(server_factory: Any) -> None:
    server = server_factory("--max-body-bytes", "2048")
    stored = kubelet_update(base_csinode(), EBS, 23)
    big = review(stored, kubelet_update(stored, EBS, 22))
    big["request"]["object"]["metadata"]["annotations"]["padding"] = "x" * 4096
    answer = server.post("/mutate", big)
    assert answer.status == 413
    assert json.loads(answer.data)["code"] == 413
    fresh = server.client()
    assert fresh.request("GET", "/healthz").status == 200


def test_update_without_old_object_is_not_allowed_with_code_400(server_factory: Any) -> None:
    server = server_factory()
    body = review(None, kubelet_update(base_csinode(), EBS, 23))
    answer = json.loads(server.post("/mutate", body).data)["response"]
    assert answer["allowed"] is False
    assert answer["status"]["code"] == 400
    assert "oldObject" in answer["status"]["message"]
    assert "patch" not in answer


@pytest.mark.parametrize(
    "operation",
    [pytest.param("CREATE", id="CREATE is always allowed"),
     pytest.param("DELETE", id="the node's own DELETE is allowed")],
)
def test_the_nodes_create_and_delete_are_allowed(server_factory: Any, operation: str) -> None:
    server = server_factory()
    obj = kubelet_update(base_csinode(), EBS, 25)
    if operation == "CREATE":
        del obj["metadata"]["uid"]  # mutating admission of a CREATE runs before the apiserver sets it
    old, new = (None, obj) if operation == "CREATE" else (obj, None)
    answer = json.loads(server.post("/mutate", review(old, new, operation=operation)).data)["response"]
    assert answer["allowed"] is True
    assert "patch" not in answer and "warnings" not in answer


@pytest.mark.parametrize("path", ["/mutate", "/validate"])
def test_a_strangers_delete_is_refused_over_https(server_factory: Any, path: str) -> None:
    server = server_factory()
    obj = kubelet_update(base_csinode(), EBS, 25)
    body = review(obj, None, operation="DELETE", user="mallory", groups=["system:authenticated"])
    answer = json.loads(server.post(path, body).data)["response"]
    assert answer["allowed"] is False
    assert answer["status"]["code"] == 403
    assert "[writer-identity]" in answer["status"]["message"] and "(deletion)" in answer["status"]["message"]
    assert "patch" not in answer


def test_another_resource_is_allowed_with_a_warning(server_factory: Any) -> None:
    server = server_factory()
    body = review(base_csinode(), base_csinode())
    body["request"]["resource"] = {"group": "", "version": "v1", "resource": "nodes"}
    answer = json.loads(server.post("/validate", body).data)["response"]
    assert answer["allowed"] is True
    assert "nodes" in answer["warnings"][0]
    assert "misconfig" in server.stderr_path.read_text() or "nodes" in server.stderr_path.read_text()


def test_keep_alive_serves_many_reviews_on_one_tls_connection(server_factory: Any) -> None:
    server = server_factory()
    stored = kubelet_update(base_csinode(), EBS, 25)
    pool = server.client()
    for i in range(20):
        answer = pool.request("POST", "/validate?timeout=10s",
                              body=json.dumps(review(stored, kubelet_update(stored, EBS, 24 - i % 3))).encode(),
                              headers={"Content-Type": "application/json"})
        assert answer.status == 200
    assert pool.num_connections == 1


def test_metrics_count_requests_by_endpoint_and_decision(server_factory: Any) -> None:
    server = server_factory()
    stored = kubelet_update(base_csinode(), EBS, 25)
    server.post("/mutate", review(stored, kubelet_update(stored, EBS, 24)))
    server.post("/mutate", b"nope")
    # Per-request samples reach the metric files within a second (the worker's flusher; webhook.serving.metrics).
    deadline = time.monotonic() + 10
    while True:
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
        if "csinode_guard_requests_total{" in text or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert 'csinode_guard_requests_total{decision="allow",dry_run="false",endpoint="mutate"} 1.0' in text
    assert 'csinode_guard_request_duration_seconds_count{endpoint="mutate"} 1.0' in text
    assert 'csinode_guard_rule_results_total{enforcement="none",result="pass",rule="count-ceiling"} 1.0' in text
    assert 'csinode_guard_bad_requests_total{code="400"} 1.0' in text
    expiry = [line for line in text.splitlines()
              if line.startswith("csinode_guard_serving_certificate_expiry_timestamp_seconds ")]
    assert len(expiry) == 1
    not_after = tls.certificate_not_after(server.cert_dir / "tls.crt").timestamp()
    assert float(expiry[0].split()[1]) == pytest.approx(not_after)


def test_a_scrape_waits_while_a_worker_writes_a_batch_of_samples(server_factory: Any, tmp_path: Path) -> None:
    """A scrape never sees half a flushed batch: it reads under the lock a worker's flush holds exclusively."""
    shared = tmp_path / "prometheus"
    shared.mkdir()
    server = server_factory(env={"PROMETHEUS_MULTIPROC_DIR": str(shared)})
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    assert urllib.request.urlopen(url, timeout=5).status == 200
    scraped: list[str] = []
    with open(shared / flushlock.LOCK_NAME, "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # what a worker holds while it writes one batch
        scrape = threading.Thread(
            target=lambda: scraped.append(urllib.request.urlopen(url, timeout=10).read().decode()), daemon=True
        )
        scrape.start()
        scrape.join(1.0)
        assert scrape.is_alive() and not scraped, "the scrape read the sample files while a batch was being written"
        fcntl.flock(lock, fcntl.LOCK_UN)
    scrape.join(10)
    assert scraped and "csinode_guard_serving_certificate_expiry_timestamp_seconds" in scraped[0]


def test_a_sample_file_caught_while_a_worker_creates_it_does_not_fail_the_scrape(
    server_factory: Any, tmp_path: Path
) -> None:
    """prometheus_client creates a worker's sample file empty and sizes it a moment later; a scrape in that moment
    (or after a worker was killed in it, which leaves the empty file for good) still answers with every sample."""
    shared = tmp_path / "prometheus"
    shared.mkdir()
    server = server_factory(env={"PROMETHEUS_MULTIPROC_DIR": str(shared)})
    stored = kubelet_update(base_csinode(), EBS, 25)
    assert server.post("/mutate", review(stored, kubelet_update(stored, EBS, 24))).status == 200
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    counted = 'csinode_guard_requests_total{decision="allow",dry_run="false",endpoint="mutate"} 1.0'
    deadline = time.monotonic() + 10
    while counted not in urllib.request.urlopen(url, timeout=5).read().decode() and time.monotonic() < deadline:
        time.sleep(0.2)
    for name in ("counter_empty.db", "histogram_empty.db", "gauge_livesum_empty.db"):  # no worker's pid
        (shared / name).write_bytes(b"")
    answer = urllib.request.urlopen(url, timeout=5)
    assert answer.status == 200
    assert counted in answer.read().decode()


def test_sigterm_finishes_and_exits_zero(server_factory: Any) -> None:
    server = server_factory()
    stored = kubelet_update(base_csinode(), EBS, 25)
    server.post("/mutate", review(stored, kubelet_update(stored, EBS, 24)))
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=30) == 0
    assert len(server.audit_records()) == 1


def test_serves_from_read_only_secret_mounts_without_generating_anything(tmp_path: Path) -> None:
    """As deployed: tls.crt/tls.key/ca.crt and the state key are read-only Secret files; nothing is written."""
    secret = tmp_path / "secret"
    paths = dev_certs.ensure_dev_certs(secret / "certs", [SERVICE_DNS])
    paths.ca_key.unlink()
    (secret / "certs" / "ca-bundle.crt").unlink()
    key_file = secret / "state-key"
    key_file.write_text(os.urandom(32).hex() + "\n")
    for f in [*(secret / "certs").iterdir(), key_file]:
        f.chmod(0o400)
    (secret / "certs").chmod(0o500)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    try:
        server = start_server(run_dir, "--no-generate-certs", "--state-key-file", str(key_file),
                              cert_dir=secret / "certs")
        try:
            stored = kubelet_update(base_csinode(), EBS, 25)
            answer = json.loads(server.post("/mutate", review(stored, kubelet_update(stored, EBS, 23))).data)
            assert answer["response"]["allowed"] is True
            assert sorted(p.name for p in (secret / "certs").iterdir()) == ["ca.crt", "tls.crt", "tls.key"]
        finally:
            assert server.stop() == 0
    finally:
        (secret / "certs").chmod(0o700)


def test_a_given_metrics_directory_keeps_everything_but_old_samples(server_factory: Any, tmp_path: Path) -> None:
    shared = tmp_path / "prometheus"
    shared.mkdir()
    (shared / "notes.txt").write_text("not ours")
    (shared / "counter_4242.db").write_bytes(b"stale samples of an earlier run")
    server = server_factory(env={"PROMETHEUS_MULTIPROC_DIR": str(shared)})
    assert server.get("/healthz").status == 200
    assert (shared / "notes.txt").read_text() == "not ours"
    assert not (shared / "counter_4242.db").exists()


def test_a_metrics_directory_the_server_made_is_removed_when_it_exits(server_factory: Any, tmp_path: Path) -> None:
    own_tmp = tmp_path / "tmp"
    own_tmp.mkdir()
    server = server_factory(env={"TMPDIR": str(own_tmp)})
    stored = kubelet_update(base_csinode(), EBS, 25)
    assert server.post("/mutate", review(stored, kubelet_update(stored, EBS, 24))).status == 200
    made = [p for p in own_tmp.iterdir() if p.name.startswith("csinode-guard-metrics-")]
    assert len(made) == 1 and any(made[0].glob("*.db"))  # the workers write their samples there
    assert server.stop() == 0
    assert not made[0].exists()


def test_the_benchmark_noop_endpoint_exists_only_when_enabled_and_answers_a_valid_review(server_factory: Any) -> None:
    stored = kubelet_update(base_csinode(), EBS, 25)
    body = review(stored, kubelet_update(stored, EBS, 39), uid="noop-uid-1")
    plain = server_factory(workers=1)
    assert plain.post("/noop", body).status == 404
    bench = server_factory(workers=1, env={"CSINODE_GUARD_BENCHMARK_NOOP": "1"})
    answer = bench.post("/noop", body)
    assert answer.status == 200
    document = json.loads(answer.data)
    assert document["apiVersion"] == "admission.k8s.io/v1" and document["kind"] == "AdmissionReview"
    assert document["response"] == {"uid": "noop-uid-1", "allowed": True}  # judges nothing: 39 is not clamped
    master = bench.process.pid
    workers = Path(f"/proc/{master}/task/{master}/children").read_text().split()
    assert str(document["worker"]) in workers  # the worker process that answered, for the spread benchmark
    assert bench.post("/noop", b"{not json").status == 400
    assert bench.post("/noop", body, content_type="text/plain").status == 415
    assert bench.audit_records() == []  # the floor writes no audit record
