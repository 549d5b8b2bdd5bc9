"""The GuardPolicy on the real apiserver: the CRD refuses a broken edit at ``kubectl apply`` with its path, a good
edit becomes live on every replica and ``kubectl get guardpolicy`` says so, and the tools judge with the policy
the guard serves.

Each test names its own GuardPolicy (``unique``) and deletes it, so the session's other tests, whose tools read
GuardPolicy ``default``, still find none and judge with the bundled default. The one exception, the CRD applied
after the guard started, needs ``default`` itself (the name is part of the policy hash): it deletes the CRD
first, which removes every GuardPolicy, and leaves the cluster without ``default`` as well.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.k8s.controlplane import (
    CLUSTER_POLICY,
    DEFAULT_POLICY,
    REPO,
    ControlPlane,
    Guard,
    counts,
    csinode_writes,
    running_guard,
    unique,
    wait_until,
)

CRD = REPO / "deploy" / "base" / "guardpolicy-crd.yaml"
EBS = "ebs.csi.aws.com"


def install_crd(cp: ControlPlane) -> None:
    cp.kubectl("apply", "-f", str(CRD))
    cp.kubectl("wait", "--for=condition=Established", "crd/guardpolicies.csinode-guard.io", "--timeout=60s")


@pytest.fixture
def crd(control_plane: ControlPlane) -> Iterator[ControlPlane]:
    install_crd(control_plane)
    yield control_plane


def policy_doc(name: str, edit: Any = None) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(DEFAULT_POLICY.read_text("utf-8"))
    doc["metadata"] = {"name": name}
    doc["spec"]["rules"]["change-rate"]["minInterval"] = "2s"
    if edit is not None:
        edit(doc)
    return doc


def apply(cp: ControlPlane, doc: dict[str, Any], check: bool = True) -> Any:
    return cp.kubectl("apply", "-f", "-", input=json.dumps(doc), check=check)


def get_policy(cp: ControlPlane, name: str) -> dict[str, Any]:
    found: dict[str, Any] = cp.kubectl_json("get", "guardpolicy", name)
    return found


def readyz(guard: Guard) -> dict[str, Any]:
    context = ssl.create_default_context(cafile=str(guard.control_plane.ca_crt))
    with urllib.request.urlopen(f"{guard.url}/readyz", context=context, timeout=10) as response:
        body: dict[str, Any] = json.loads(response.read())
    return body


def test_kubectl_apply_refuses_a_broken_guardpolicy_with_the_path_and_the_reason(crd: ControlPlane) -> None:
    name = unique("gp")

    def broken(doc: dict[str, Any]) -> None:
        doc["spec"]["rules"]["count-ceiling"]["enforcementAction"] = "block"

    refused = apply(crd, policy_doc(name, broken), check=False)
    assert refused.returncode != 0
    assert "spec.rules.count-ceiling.enforcementAction" in refused.stderr and '"block"' in refused.stderr

    def above_max(doc: dict[str, Any]) -> None:  # the schema alone cannot say it: a CEL rule
        doc["spec"]["drivers"][EBS]["ceiling"]["unknown"] = 300

    refused = apply(crd, policy_doc(name, above_max), check=False)
    assert refused.returncode != 0
    assert f"spec.drivers[{EBS}].ceiling.unknown" in refused.stderr
    assert "ceiling.unknown is above ceiling.max" in refused.stderr

    def pod_without_selector(doc: dict[str, Any]) -> None:  # a oneOf of the JSON Schema, as CEL rules
        doc["spec"]["defaults"]["versionSource"] = {"type": "pod"}

    refused = apply(crd, policy_doc(name, pod_without_selector), check=False)
    assert refused.returncode != 0
    assert "spec.defaults.versionSource" in refused.stderr and "requires namespace, selector" in refused.stderr

    def bad_duration(doc: dict[str, Any]) -> None:
        doc["spec"]["rules"]["count-rollback"]["window"] = "1hour"

    refused = apply(crd, policy_doc(name, bad_duration), check=False)
    assert refused.returncode != 0 and "spec.rules.count-rollback.window" in refused.stderr

    unknown_field = policy_doc(name)
    unknown_field["spec"]["rules"]["count-ceiling"]["enforcment"] = "deny"  # a typo kubectl's strict check catches
    refused = apply(crd, unknown_field, check=False)
    assert refused.returncode != 0 and "enforcment" in refused.stderr

    assert crd.kubectl("get", "guardpolicy", name, check=False).returncode != 0  # nothing was stored
    apply(crd, policy_doc(name))  # the good one is
    crd.kubectl("delete", "guardpolicy", name)
    explained = crd.kubectl("explain", "guardpolicy.spec.rules").stdout
    assert "Per-rule settings for every driver" in explained and "count-ceiling" in explained


def test_a_good_edit_becomes_live_on_every_replica_and_kubectl_get_says_so(
    crd: ControlPlane, guard_factory: Any
) -> None:
    cp = crd
    name, namespace = unique("gp"), unique("guard")
    cp.kubectl("create", "namespace", namespace)
    args = ("--guard-policy", name, "--lease-namespace", namespace, "--lease-name", unique("lease"),
            "--guard-policy-recreate-after", "3")
    guards: list[Guard] = [guard_factory(CLUSTER_POLICY, register=False, extra_args=args, workers=1)
                           for _ in range(2)]
    try:
        # None existed: the first replica made it from the bundled default, and both serve it.
        created = get_policy(cp, name)
        assert created["metadata"]["generation"] == 1

        def settled(generation: int) -> dict[str, Any] | None:
            obj = get_policy(cp, name)
            status = obj.get("status") or {}
            conditions = {c["type"]: c for c in status.get("conditions") or []}
            if status.get("observedGeneration") != generation or conditions.get("Enforced", {}).get("status") != \
                    "True":
                return None
            return obj

        wait_until(lambda: settled(1), timeout=60, what="generation 1 enforced")

        def raise_unknown(doc: dict[str, Any]) -> None:
            doc["spec"]["drivers"][EBS]["ceiling"]["unknown"] = 31
            # A label of its own (as Helm's ownership would be): kept when it is created again below.
            doc["metadata"]["labels"] = {"app.kubernetes.io/managed-by": "Helm"}

        apply(cp, policy_doc(name, raise_unknown))
        live = wait_until(lambda: settled(2), timeout=60, what="generation 2 enforced on every replica")
        status = live["status"]
        conditions = {c["type"]: c for c in status["conditions"]}
        assert conditions["Accepted"]["status"] == "True" and conditions["Accepted"]["observedGeneration"] == 2
        assert status["replicas"] == "2/2" and len(status["byPod"]) == 2
        assert {p["observedGeneration"] for p in status["byPod"]} == {2}
        assert {readyz(g)["policy"]["hash"] for g in guards} == {status["policyHash"]}
        table = cp.kubectl("get", "guardpolicy", name).stdout.splitlines()
        assert table[0].split()[:6] == ["NAME", "ENFORCEMENT", "RECONCILE", "ACCEPTED", "READY", "REPLICAS"]
        assert table[1].split()[0] == name and "True True 2/2" in " ".join(table[1].split())

        # An edit the schema admits and the guard's deeper checks refuse: Accepted False with the path, both
        # replicas keep the last good policy.
        def missing_profile(doc: dict[str, Any]) -> None:
            raise_unknown(doc)
            doc["spec"]["drivers"][EBS]["ceiling"]["profile"] = "no-such-profile"

        apply(cp, policy_doc(name, missing_profile))

        def refused() -> dict[str, Any] | None:
            obj = get_policy(cp, name)
            status = obj.get("status") or {}
            conditions = {c["type"]: c for c in status.get("conditions") or []}
            accepted = conditions.get("Accepted", {})
            return status if accepted.get("status") == "False" and status.get("observedGeneration") == 3 and \
                all(p.get("error") for p in status.get("byPod") or [{}]) and len(status["byPod"]) == 2 else None

        status = wait_until(refused, timeout=60, what="generation 3 refused")
        accepted = {c["type"]: c for c in status["conditions"]}["Accepted"]
        assert f"$.spec.drivers['{EBS}'].ceiling.profile" in accepted["message"]
        assert "no-such-profile" in accepted["message"]
        assert {c["type"]: c for c in status["conditions"]}["Enforced"]["status"] == "False"
        assert {p["observedGeneration"] for p in status["byPod"]} == {2}
        assert {readyz(g)["policy"]["hash"] for g in guards} == {live["status"]["policyHash"]}

        # Deleted while the guard runs: the last good policy (generation 2, not the refused 3) keeps serving, and
        # 3 s later the status writer creates the GuardPolicy again with its spec and labels, so the tools and the
        # next start read it.
        served_hash = live["status"]["policyHash"]
        cp.kubectl("delete", "guardpolicy", name)

        def recreated() -> dict[str, Any] | None:
            found = cp.kubectl("get", "guardpolicy", name, "-o", "json", check=False)
            return json.loads(found.stdout) if found.returncode == 0 else None

        again = wait_until(recreated, timeout=60, what="the GuardPolicy created again")
        assert again["spec"] == policy_doc(name, raise_unknown)["spec"]
        assert again["metadata"]["generation"] == 1  # a new object
        assert again["metadata"]["labels"].get("app.kubernetes.io/managed-by") == "Helm", again["metadata"]
        wait_until(lambda: settled(1), timeout=60, what="the re-created generation 1 enforced on every replica")
        assert get_policy(cp, name)["status"]["policyHash"] == served_hash
        assert {readyz(g)["policy"]["hash"] for g in guards} == {served_hash}
        logs = "".join(g.log.read_text() for g in guards)
        assert f"GuardPolicy {name} was deleted; created it again with the policy the guard serves" in logs
    finally:
        for g in guards:  # first: a running guard creates its GuardPolicy again
            g.stop()
        cp.kubectl("delete", "guardpolicy", name, check=False)


def test_a_crd_applied_after_the_guard_started_gets_the_guardpolicy_the_guard_serves(
    control_plane: ControlPlane, guard_factory: Any
) -> None:
    """The guard started before its CRD existed (applied out of order, or the CRD deleted and applied again): it
    serves the bundled default with no GuardPolicy, and once the CRD is applied the status writer creates the
    GuardPolicy from that default, so ``kubectl get guardpolicy`` and every tool read the policy it serves.
    GuardPolicy ``default`` itself (the name is part of the policy hash), deleted at the end as every test here
    deletes its own."""
    cp = control_plane
    name, namespace = "default", unique("guard")
    had_crd = cp.kubectl("get", "crd", "guardpolicies.csinode-guard.io", check=False).returncode == 0
    cp.kubectl("delete", "crd", "guardpolicies.csinode-guard.io", "--ignore-not-found", "--wait=true")
    cp.kubectl("create", "namespace", namespace)
    guard: Guard | None = None
    try:
        guard = guard_factory(CLUSTER_POLICY, register=False, workers=1, extra_args=(
            "--lease-namespace", namespace, "--lease-name", unique("lease"), "--guard-policy-recreate-after", "2"))
        served = readyz(guard)["policy"]["hash"]
        assert f"no GuardPolicy {name} in the cluster: serving the bundled default policy" in guard.log.read_text()
        install_crd(cp)

        def enforced() -> dict[str, Any] | None:
            found = cp.kubectl("get", "guardpolicy", name, "-o", "json", check=False)
            if found.returncode != 0:
                return None
            obj: dict[str, Any] = json.loads(found.stdout)
            conditions = {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}
            return obj if conditions.get("Enforced", {}).get("status") == "True" else None

        created = wait_until(enforced, timeout=120, interval=1, what="the GuardPolicy created and enforced")
        assert created["spec"] == yaml.safe_load(DEFAULT_POLICY.read_text("utf-8"))["spec"]
        assert created["metadata"]["generation"] == 1
        assert created["status"]["policyHash"] == served == readyz(guard)["policy"]["hash"]
        assert f"no GuardPolicy {name} in the cluster: created it from the bundled default policy" in \
            guard.log.read_text()
    finally:
        if guard is not None:  # first: a running guard creates its GuardPolicy again
            guard.stop()
        if had_crd:  # the cluster as the test found it
            install_crd(cp)
            cp.kubectl("delete", "guardpolicy", name, "--ignore-not-found")
        else:
            cp.kubectl("delete", "crd", "guardpolicies.csinode-guard.io", "--ignore-not-found", "--wait=true")


def _ceilings(cp: ControlPlane, node: str, *args: str) -> tuple[Any, dict[str, Any]]:
    """``status --node NODE -o json``: the entry's ceiling and the policy it was judged with."""
    result = subprocess.run(
        [sys.executable, "-m", "webhook", "status", "--node", node, "-o", "json", *args],
        env={**os.environ, "KUBECONFIG": str(cp.kubeconfig)}, capture_output=True, text=True, timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    return document["entries"][0]["ceiling"], document["policy"]


def test_status_judges_with_the_guardpolicy_the_guard_serves_and_says_which(
    crd: ControlPlane, guard_factory: Any
) -> None:
    cp = crd
    name, namespace = unique("gp"), unique("guard")
    cp.kubectl("create", "namespace", namespace)

    def by_label(doc: dict[str, Any]) -> None:
        doc["spec"]["drivers"][EBS]["ceiling"]["values"] = {"m5.large": 31}

    apply(cp, policy_doc(name, by_label))
    guard = guard_factory(CLUSTER_POLICY, extra_args=("--guard-policy", name, "--lease-namespace", namespace,
                                                      "--lease-name", unique("lease")))
    try:
        node = unique("labelled")
        cp.create_node(node, {"node.kubernetes.io/instance-type": "m5.large"})
        cp.kubelet(node, "install", "--driver", EBS, "--node-id", f"i-{node}", "--max-volumes", "30")
        stored = json.loads(cp.kubectl("get", "csinode", node, "-o", "json").stdout)
        assert stored["spec"]["drivers"][0]["allocatable"]["count"] == 30  # the live guard: ceiling 31 by label
        ceiling, policy = _ceilings(cp, node, "--guard-policy", name)
        assert ceiling == 31
        assert policy["name"] == name and policy["origin"] == "cluster"
        assert policy["hash"] == readyz(guard)["policy"]["hash"]
        # The bundled default, which the tools used before, says 27 for the same node.
        bundled, default = _ceilings(cp, node, "--policy", str(DEFAULT_POLICY))
        assert bundled == 27 and default["origin"] == "file"
        table = guard.csinode_guard("status", "--node", node, "--guard-policy", name).stdout
        assert table.splitlines()[-1].startswith(f"Judged with policy {name} (hash {policy['hash']}, guardpolicy/")
        tested = guard.csinode_guard("policy", "test", str(REPO / "policies" / "tests"), "--guard-policy", name,
                                     check=False)
        assert f"Judged with policy {name} (hash {policy['hash']}, guardpolicy/{name} generation 1)" in \
            tested.stderr, tested.stderr
        preflight = guard.csinode_guard("preflight", "--guard-policy", name, "-o", "json", check=False)
        assert json.loads(preflight.stdout)["policy"]["hash"] == policy["hash"], preflight.stderr
    finally:
        guard.stop()  # first: a running guard creates its GuardPolicy again
        cp.kubectl("delete", "guardpolicy", name, check=False)


def test_replay_warns_by_kind_of_fact_on_a_metadata_level_log_and_refuses_the_guards_own_log(
    crd: ControlPlane, guard: Guard, tmp_path: Path
) -> None:
    """The session's apiserver logs Nodes and VolumeAttachments at Metadata level (cluster.sh's audit policy)."""
    cp = crd
    node = unique("meta")
    cp.create_node(node, {"node.kubernetes.io/instance-type": "m5.large"})
    cp.kubelet(node, "install", "--driver", EBS, "--node-id", f"i-{node}", "--max-volumes", "20")
    cp.kubectl("label", "node", node, "touched=yes")  # a Node write, logged at Metadata level
    wait_until(lambda: cp.audit_events(lambda e: (e.get("objectRef") or {}).get("resource") == "nodes"
                                       and (e.get("objectRef") or {}).get("name") == node
                                       and e.get("stage") == "ResponseComplete"), what="the node write audited")
    out = guard.csinode_guard("replay", "--audit-log", str(cp.audit_log), "--policy", str(DEFAULT_POLICY),
                              "--no-progress", "--format", "json")
    assert out.returncode == 0, out.stderr
    assert "nodes are logged at Metadata level only" in out.stderr
    assert "no Node labels and kubelet versions" in out.stderr and "docs/apiserver-audit-policy.yaml" in out.stderr
    summary = json.loads(out.stdout)["summary"]
    assert any(w.startswith("nodes are logged at Metadata level") for w in summary["missingFacts"])
    assert summary["policy"]["hash"] and summary["policy"]["origin"] == "file"
    # The guard's own audit log is no apiserver audit log: exit 2, not a clean replay of nothing.
    wait_until(guard.decisions, what="a decision record")
    own = guard.csinode_guard("replay", "--audit-log", str(guard.decisions_log), "--policy", str(DEFAULT_POLICY),
                              "--no-progress", check=False)
    assert own.returncode == 2, own.stdout + own.stderr
    assert "not an apiserver audit log" in own.stderr


def _without_objects(source: Path, target: Path) -> None:
    """``source`` as an apiserver with cluster.sh's policy writes it: Node and VolumeAttachment events at
    Metadata level (no request or response object)."""
    lines = []
    for line in source.read_text("utf-8").splitlines():
        event = json.loads(line)
        if (event.get("objectRef") or {}).get("resource") in ("nodes", "volumeattachments"):
            event["level"] = "Metadata"
            event.pop("requestObject", None)
            event.pop("responseObject", None)
        lines.append(json.dumps(event))
    target.write_text("\n".join(lines) + "\n", "utf-8")


def test_status_and_replay_agree_with_the_live_guard_where_labels_and_attach_errors_decide(
    full_facts_cluster: ControlPlane, tmp_path: Path
) -> None:
    cp = full_facts_cluster
    install_crd(cp)
    name = unique("gp")

    def by_label(doc: dict[str, Any]) -> None:
        doc["spec"]["drivers"][EBS]["ceiling"]["values"] = {"m5.large": 31}

    apply(cp, policy_doc(name, by_label))
    args = ("--guard-policy", name, "--lease-namespace", "default")
    with running_guard(cp, tmp_path / "guard", CLUSTER_POLICY, extra_args=args) as guard:
        node = unique("facts")
        cp.create_node(node, {"node.kubernetes.io/instance-type": "m5.large"})
        cp.kubelet(node, "install", "--driver", EBS, "--node-id", f"i-{node}", "--max-volumes", "30")  # by label
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        attachment = unique("va")
        cp.kubectl("create", "-f", "-", input=json.dumps({
            "apiVersion": "storage.k8s.io/v1", "kind": "VolumeAttachment", "metadata": {"name": attachment},
            "spec": {"attacher": EBS, "nodeName": node, "source": {"persistentVolumeName": unique("pv")}},
        }))
        cp.kubectl("patch", "volumeattachment", attachment, "--subresource=status", "--type=merge", "-p",
                   json.dumps({"status": {"attached": False, "attachError": {
                       "time": now, "message": "rpc error: code = ResourceExhausted", "errorCode": 8}}}))
        time.sleep(2.5)
        cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "12")  # a correction: attach error 8
        time.sleep(2.5)
        cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "24")  # undoes it: count-rollback
        live = [r for r in guard.decisions() if r.get("node") == node and r["endpoint"] == "mutate"]
        wait_until(lambda: len(cp.audit_events(csinode_writes(node))) >= len(live), what="all writes audited")
        stored = counts(cp.get_csinode(node))[EBS]

        def rows(log: Path) -> tuple[list[tuple[Any, ...]], str]:
            out = guard.csinode_guard("replay", "--audit-log", str(log), "--guard-policy", name, "--format", "json",
                                      "--no-progress")
            events = [r for r in json.loads(out.stdout)["events"] if r["node"] == node]
            return [tuple(r.get(k) for k in ("driver", "old", "new", "final", "decision")) for r in events], out.stderr

        def live_row(record: dict[str, Any]) -> tuple[Any, ...]:
            old = "registered" if record.get("registration") and record.get("old") is None else record.get("old")
            return (record.get("driver"), old, record.get("new"), record.get("final"), record.get("decision"))

        expected = [live_row(r) for r in live]
        assert ("ebs.csi.aws.com", "registered", 30, 30, "allow") in expected  # the label's ceiling, 31
        assert any(r[-1] in ("deny", "clamp") and r[2] == 24 for r in expected), expected  # the correction held
        replayed, warnings = rows(cp.audit_log)
        assert replayed == expected, f"{replayed}\n{expected}"
        assert "Metadata level" not in warnings, warnings
        # The same log as a Metadata-level policy writes it: replay says what it lacks, and it does decide
        # otherwise (no label: the unknown ceiling 27; no attach error: no correction to hold).
        metadata_log = tmp_path / "metadata.log"
        _without_objects(cp.audit_log, metadata_log)
        blind, warnings = rows(metadata_log)
        assert "nodes are logged at Metadata level only" in warnings
        assert "volumeattachments are logged at Metadata level only" in warnings
        assert blind != expected
        # status: the same policy, the same ceiling, the count the guard stored.
        result = subprocess.run(
            [sys.executable, "-m", "webhook", "status", "--node", node, "-o", "json", "--guard-policy", name],
            env={**os.environ, "KUBECONFIG": str(cp.kubeconfig)}, capture_output=True, text=True, timeout=120,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        document = json.loads(result.stdout)
        [entry] = document["entries"]
        assert entry["allocatableCount"] == stored and entry["ceiling"] == 31 and entry["overCeiling"] is False
        assert document["policy"]["hash"] == readyz(guard)["policy"]["hash"]
    cp.kubectl("delete", "guardpolicy", name, check=False)


def test_policy_migrate_carries_the_configmap_policy_over_once(crd: ControlPlane, guard: Guard) -> None:
    cp = crd
    name, namespace = unique("gp"), unique("old-install")
    cp.kubectl("create", "namespace", namespace)

    def raise_unknown(doc: dict[str, Any]) -> None:
        doc["spec"]["drivers"][EBS]["ceiling"]["unknown"] = 31

    old = policy_doc("default", raise_unknown)
    cp.kubectl("create", "configmap", "csinode-guard-policy-5t2hk8m4", "-n", namespace,
               f"--from-literal=policy.yaml={yaml.safe_dump(old)}")
    # A replica of the new version started first and made the GuardPolicy from the bundled default.
    bundled: dict[str, Any] = yaml.safe_load(DEFAULT_POLICY.read_text("utf-8"))
    apply(cp, {**bundled, "metadata": {"name": name}})
    try:
        args = ("policy", "migrate", "--namespace", namespace, "--guard-policy", name)
        dry = guard.csinode_guard(*args, "--dry-run")
        assert dry.stdout.startswith("would replace") and get_policy(cp, name)["metadata"]["generation"] == 1
        migrated = guard.csinode_guard(*args)
        assert migrated.stdout.startswith(f"replaced guardpolicy/{name} generation 1 (the bundled default)")
        stored = get_policy(cp, name)
        assert stored["spec"] == old["spec"]
        again = guard.csinode_guard(*args)
        assert "nothing to do" in again.stdout
        # Someone edits it afterwards: a second migration leaves the edit alone unless --force.
        apply(cp, policy_doc(name))
        refused = guard.csinode_guard(*args, check=False)
        assert refused.returncode == 1 and "was edited" in refused.stderr
        assert get_policy(cp, name)["spec"] == policy_doc(name)["spec"]
    finally:
        cp.kubectl("delete", "guardpolicy", name, check=False)
