"""``csinode-guard restore NODE --driver D``: as a subprocess with the real kubernetes client against the local
API-wire test server (tests/apiserver), and its pure planning step.

The CSINode carries a state signed with a key file the test writes; the guard itself is not running, so the
test that matters most also feeds the PUT the command sent through the guard's real ``evaluate`` as the
apiserver would (old object, new object, the operator as an approver) and checks that it is admitted.
"""

from __future__ import annotations

import copy
import json
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from kube import EBS, NODE, base_csinode, driver_entry, review

from tests.apiserver import FakeApiServer, RecordedRequest
from tests.clirun import run_cli
from webhook.admission.cluster import UnknownClusterView
from webhook.admission.evaluation import Mode, evaluate
from webhook.admission.policy import load_policy
from webhook.admission.restore_plan import JustificationRequest, RestoreError, build_justifications, plan_restore
from webhook.admission.review import parse_review
from webhook.admission.state import (
    STATE_ANNOTATION,
    Correction,
    EntryState,
    GuardState,
    StateKeys,
    encode_state,
    format_time,
    parse_time,
)

CSINODES = "csinodes.storage.k8s.io"
JUSTIFICATION = "csinode-guard.io/justification"
EFS = "efs.csi.aws.com"
KEY = bytes(range(100, 132))  # 32 bytes; written to the key file as hex
KEYS = StateKeys([KEY])
OTHER_KEYS = StateKeys([b"some-other-hmac-key-of-32-bytes!"])
CHANGED = datetime(2026, 11, 30, 1, 2, 3, tzinfo=UTC)
REASON = "driver reported 39 after a bad config push"
APPROVER = "alice"
APPROVER_GROUPS = ["csinode-guard:approvers", "system:authenticated"]


def csinode(
    count: int | None = 39,
    trusted: int | None = 25,
    *,
    keys: StateKeys = KEYS,
    state: bool = True,
    correction: Correction | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The kubelet's CSINode for NODE with EFS and EBS (``count``), and a state that trusts EBS at ``trusted``."""
    obj = base_csinode()
    obj["spec"]["drivers"].append(driver_entry(EBS, count))
    if state:
        entry = EntryState(count=trusted, changed_at=CHANGED, writer_version="v1.37.0", correction=correction)
        guard_state = GuardState(uid=obj["metadata"]["uid"], entries={EBS: entry})
        obj["metadata"]["annotations"][STATE_ANNOTATION] = encode_state(guard_state, keys)
    obj["metadata"]["annotations"].update(annotations or {})
    return obj


def ebs_count(obj: dict[str, Any]) -> int | None:
    entry = next(d for d in obj["spec"]["drivers"] if d["name"] == EBS)
    count: int | None = (entry.get("allocatable") or {}).get("count")
    return count


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "state.key"
    path.write_text(f"# csinode-guard state key\n{KEY.hex()}\n")
    return path


def restore(kubeconfig: str, *extra: str, node: str = NODE, driver: str = EBS) -> subprocess.CompletedProcess[str]:
    return run_cli(
        "restore", node, "--driver", driver, "--reason", REASON, "--kubeconfig", kubeconfig, *extra,
        cwd=Path(kubeconfig).parent,
    )


def puts(apiserver: FakeApiServer) -> list[RecordedRequest]:
    return [r for r in apiserver.requests if r.method == "PUT"]


def admit_as_approver(old: dict[str, Any], new: dict[str, Any], now: datetime) -> Any:
    """What the guard (default policy, no cluster facts) decides on the UPDATE old -> new sent by an approver."""
    request = parse_review(json.dumps(review(old, new, user=APPROVER, groups=APPROVER_GROUPS)))
    return evaluate(request, load_policy(), UnknownClusterView(), now, KEYS, mode=Mode.MUTATE)


# --- the command ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("count", "trusted", "correction"),
    [
        pytest.param(39, 25, None, id="a-count-raised-behind-the-guards-back-goes-down-to-the-trusted-count"),
        pytest.param(
            5,
            23,
            Correction(at=CHANGED, before=25, after=23, basis="resource-exhausted"),
            id="a-count-dropped-behind-the-guards-back-goes-up-to-the-trusted-count",
        ),
    ],
)
def test_restore_writes_the_trusted_count_with_a_justification_covering_exactly_it(
    apiserver: FakeApiServer,
    kubeconfig: str,
    key_file: Path,
    count: int,
    trusted: int,
    correction: Correction | None,
) -> None:
    before = csinode(count, trusted, correction=correction)
    apiserver.load([before])
    read = apiserver.get(CSINODES, NODE)
    assert read is not None
    started = datetime.now(UTC)

    result = restore(kubeconfig, "--ticket", "OPS-123", "--state-key-file", str(key_file))

    assert result.returncode == 0, result.stderr
    assert f"spec.drivers[{EBS}].allocatable.count: {count} -> {trusted}" in result.stdout
    assert f"last trusted count {trusted} (accepted {format_time(CHANGED)}, writer version v1.37.0), verified" in (
        result.stdout
    )
    assert f"restored: {EBS} on {NODE} count {count} -> {trusted}" in result.stdout
    [put] = puts(apiserver)
    assert put.query == {"fieldManager": "csinode-guard-restore"}
    body = put.body
    assert body["metadata"]["resourceVersion"] == read["metadata"]["resourceVersion"]
    assert ebs_count(body) == trusted
    [justification] = json.loads(body["metadata"]["annotations"][JUSTIFICATION])
    expires = parse_time(justification.pop("expires"))
    assert justification == {"driver": EBS, "reason": REASON, "minCount": trusted, "maxCount": trusted,
                             "ticket": "OPS-123"}
    assert started + timedelta(minutes=59) < expires < datetime.now(UTC) + timedelta(hours=1)
    unchanged = copy.deepcopy(read)
    unchanged["metadata"]["annotations"][JUSTIFICATION] = body["metadata"]["annotations"][JUSTIFICATION]
    next(d for d in unchanged["spec"]["drivers"] if d["name"] == EBS)["allocatable"]["count"] = trusted
    assert body == unchanged  # nothing else touched: other drivers, the state, managedFields, order
    stored = apiserver.get(CSINODES, NODE)
    assert stored is not None and ebs_count(stored) == trusted

    decision = admit_as_approver(read, body, started + timedelta(minutes=1))
    assert decision.response.allowed, decision.response.message
    assert decision.decision.value == "allow"
    assert decision.new_state is not None and decision.new_state.entries[EBS].count == trusted


def test_the_same_update_from_someone_who_is_not_an_approver_is_denied_by_the_guard(
    apiserver: FakeApiServer, kubeconfig: str, key_file: Path
) -> None:
    apiserver.load([csinode(39, 25)])
    read = apiserver.get(CSINODES, NODE)
    assert read is not None
    assert restore(kubeconfig, "--state-key-file", str(key_file), "--dry-run=server").returncode == 0
    [put] = puts(apiserver)

    request = parse_review(json.dumps(review(read, put.body, user="bob", groups=["system:authenticated"])))
    decision = evaluate(request, load_policy(), UnknownClusterView(), datetime.now(UTC), KEYS)

    assert not decision.response.allowed
    assert "bob is not a justifier" in decision.response.message


def test_restore_reads_again_and_retries_after_a_conflict(
    apiserver: FakeApiServer, kubeconfig: str, key_file: Path
) -> None:
    apiserver.load([csinode(39, 25)])
    apiserver.fail_next(CSINODES, 409, method="PUT", message="the object has been modified", count=2)

    result = restore(kubeconfig, "--state-key-file", str(key_file))

    assert result.returncode == 0, result.stderr
    assert [r.method for r in apiserver.requests if r.resource == CSINODES] == ["GET", "PUT"] * 3
    assert result.stderr.count("changed since it was read (409 Conflict); reading it again") == 2
    stored = apiserver.get(CSINODES, NODE)
    assert stored is not None and ebs_count(stored) == 25


def test_restore_gives_up_after_five_conflicts(apiserver: FakeApiServer, kubeconfig: str, key_file: Path) -> None:
    apiserver.load([csinode(39, 25)])
    apiserver.fail_next(CSINODES, 409, method="PUT", message="the object has been modified", count=5)

    result = restore(kubeconfig, "--state-key-file", str(key_file))

    assert result.returncode == 1
    assert len(puts(apiserver)) == 5
    assert "the update was refused; nothing changed: the API server answered 409 Conflict" in result.stderr


def test_the_deprecated_bare_dry_run_of_restore_is_a_server_dry_run_and_warns(
    apiserver: FakeApiServer, kubeconfig: str, key_file: Path
) -> None:
    apiserver.load([csinode(39, 25)])

    result = restore(kubeconfig, "--state-key-file", str(key_file), "--dry-run")

    assert result.returncode == 0, result.stderr
    assert "--dry-run without a value is deprecated" in result.stderr and "--dry-run=server" in result.stderr
    [put] = puts(apiserver)
    assert put.query["dryRun"] == "All"


def test_restore_client_dry_run_prints_the_change_and_sends_nothing(
    apiserver: FakeApiServer, kubeconfig: str, key_file: Path
) -> None:
    apiserver.load([csinode(39, 25)])

    result = restore(kubeconfig, "--state-key-file", str(key_file), "--dry-run=client")

    assert result.returncode == 0, result.stderr
    assert f"spec.drivers[{EBS}].allocatable.count: 39 -> 25" in result.stdout
    assert "client dry run: nothing was sent" in result.stdout
    assert puts(apiserver) == []


def test_restore_dry_run_prints_the_change_and_sends_a_server_side_dry_run(
    apiserver: FakeApiServer, kubeconfig: str, key_file: Path
) -> None:
    apiserver.load([csinode(39, 25)])

    result = restore(kubeconfig, "--state-key-file", str(key_file), "--dry-run=server")

    assert result.returncode == 0, result.stderr
    assert f"spec.drivers[{EBS}].allocatable.count: 39 -> 25" in result.stdout
    assert f"metadata.annotations[{JUSTIFICATION}]: [" in result.stdout
    assert "dry run: the API server accepted the update (dryRun=All" in result.stdout
    [put] = puts(apiserver)
    assert put.query["dryRun"] == "All"
    assert ebs_count(put.body) == 25
    stored = apiserver.get(CSINODES, NODE)
    assert stored is not None and ebs_count(stored) == 39
    assert JUSTIFICATION not in stored["metadata"]["annotations"]


def test_restore_shows_the_api_servers_refusal(apiserver: FakeApiServer, kubeconfig: str, key_file: Path) -> None:
    apiserver.load([csinode(39, 25)])
    denial = (
        'admission webhook "increases-and-other-writers.mutate.csinode-guard.io" denied the request: [writer-identity] '
        f"{NODE}/{EBS}: alice is not a justifier the policy lists"
    )
    apiserver.fail_next(CSINODES, 403, method="PUT", message=denial)

    result = restore(kubeconfig, "--state-key-file", str(key_file))

    assert result.returncode == 1
    assert f"the update was refused; nothing changed: the API server answered 403 Forbidden: {denial}" in (
        result.stderr
    )
    stored = apiserver.get(CSINODES, NODE)
    assert stored is not None and ebs_count(stored) == 39


@pytest.mark.parametrize(
    ("obj", "args", "message"),
    [
        pytest.param(None, ["--node", "ip-10-9-9-9.ec2.internal"], "csinode ip-10-9-9-9.ec2.internal not found",
                     id="node-not-found"),
        pytest.param(csinode(), ["--driver", "disk.csi.azure.com"],
                     f"driver disk.csi.azure.com is not in CSINode {NODE} (drivers: {EFS}, {EBS})",
                     id="driver-not-in-the-csinode"),
        pytest.param(csinode(), ["--driver", EFS],
                     f"has no entry for {EFS} (entries: {EBS}): it has not accepted a count change",
                     id="driver-without-a-state-entry"),
        pytest.param(csinode(state=False), [], f"CSINode {NODE} has no {STATE_ANNOTATION} annotation",
                     id="no-state"),
        pytest.param(csinode(keys=OTHER_KEYS), [],
                     f"the state on CSINode {NODE} does not verify (bad-signature: signature does not verify); "
                     "wrong --state-key-file", id="state-signed-with-another-key"),
        pytest.param(csinode(25, 25), [], f"nothing to restore: {EBS} on {NODE} already has count 25",
                     id="count-already-trusted"),
        pytest.param(csinode(39, None), [], f"the last trusted count of {EBS} on {NODE} is unbounded",
                     id="trusted-count-unbounded"),
    ],
)
def test_restore_refuses_with_a_clear_message_and_writes_nothing(
    apiserver: FakeApiServer,
    kubeconfig: str,
    key_file: Path,
    obj: dict[str, Any] | None,
    args: list[str],
    message: str,
) -> None:
    if obj is not None:
        apiserver.load([obj])
    node, driver = NODE, EBS
    if args[:1] == ["--node"]:
        node = args[1]
    if args[:1] == ["--driver"]:
        driver = args[1]

    result = restore(kubeconfig, "--state-key-file", str(key_file), node=node, driver=driver)

    assert result.returncode == 1
    assert message in " ".join(result.stderr.split())
    assert puts(apiserver) == []


def test_a_state_edited_by_hand_does_not_verify(apiserver: FakeApiServer, kubeconfig: str, key_file: Path) -> None:
    obj = csinode(39, 25)
    annotations = obj["metadata"]["annotations"]
    annotations[STATE_ANNOTATION] = annotations[STATE_ANNOTATION].replace('"count":25', '"count":39')
    apiserver.load([obj])

    result = restore(kubeconfig, "--state-key-file", str(key_file))

    assert result.returncode == 1
    assert "does not verify (bad-signature" in result.stderr
    assert puts(apiserver) == []


def test_restore_without_a_key_refuses_before_contacting_the_cluster(
    apiserver: FakeApiServer, kubeconfig: str
) -> None:
    apiserver.load([csinode(39, 25)])
    apiserver.requests.clear()

    result = restore(kubeconfig)

    assert result.returncode == 2
    assert "--state-key-file is required to verify the guard's state" in result.stderr
    assert "--no-verify" in result.stderr
    assert apiserver.requests == []


def test_restore_no_verify_uses_the_state_and_says_loudly_that_it_is_unverified(
    apiserver: FakeApiServer, kubeconfig: str
) -> None:
    apiserver.load([csinode(39, 25, keys=OTHER_KEYS)])

    result = restore(kubeconfig, "--no-verify")

    assert result.returncode == 0, result.stderr
    assert "last trusted count 25" in result.stdout and "UNVERIFIED (--no-verify)" in result.stdout
    assert result.stderr.count("WARNING: --no-verify: the state's signature was NOT checked. The count 25 is "
                               "UNVERIFIED") == 2
    stored = apiserver.get(CSINODES, NODE)
    assert stored is not None and ebs_count(stored) == 25


def test_no_verify_and_a_key_file_exclude_each_other(kubeconfig: str, key_file: Path) -> None:
    result = restore(kubeconfig, "--no-verify", "--state-key-file", str(key_file))

    assert result.returncode == 2
    assert "--no-verify and --state-key-file exclude each other" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--expires-in", "soon"], "not a duration", id="expires-in-not-a-duration"),
        pytest.param(["--expires-in", "0s"], "must be positive", id="expires-in-zero"),
    ],
)
def test_restore_rejects_bad_options(kubeconfig: str, key_file: Path, args: list[str], message: str) -> None:
    result = restore(kubeconfig, "--state-key-file", str(key_file), *args)

    assert result.returncode == 2
    assert message in result.stderr


def test_restore_reason_is_required(kubeconfig: str, key_file: Path) -> None:
    result = run_cli("restore", NODE, "--driver", EBS, "--state-key-file", str(key_file), "--kubeconfig",
                     kubeconfig, cwd=key_file.parent)

    assert result.returncode == 2
    assert "Missing option '--reason'" in result.stderr


# --- planning (pure) ------------------------------------------------------------------------------------------

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
REQUEST = JustificationRequest(REASON, None, NOW + timedelta(hours=1))


def test_the_plan_keeps_valid_justifications_and_drops_expired_ones() -> None:
    valid = {"driver": EFS, "reason": "r", "minCount": 0, "maxCount": 3, "expires": "2026-12-02T00:00:00Z",
             "ticket": "T-1", "extra": "kept as is"}
    expired = {"driver": EBS, "reason": "old", "minCount": 1, "maxCount": 2, "expires": "2026-11-01T00:00:00Z"}
    obj = csinode(39, 25, annotations={JUSTIFICATION: json.dumps([valid, expired])})

    plan = plan_restore(obj, EBS, KEYS, REQUEST, NOW)

    assert json.loads(plan.justification) == [
        valid,
        {"driver": EBS, "reason": REASON, "minCount": 25, "maxCount": 25, "expires": "2026-12-01T13:00:00.000Z"},
    ]
    assert plan.notes == ("dropping 1 expired justification(s)",)


def test_a_justification_annotation_that_does_not_parse_is_replaced_with_a_note() -> None:
    value, notes = build_justifications('{"driver": 1}', EBS, 25, REQUEST, NOW)

    assert [j["minCount"] for j in json.loads(value)] == [25]
    assert len(notes) == 1 and notes[0].startswith(f"replacing the {JUSTIFICATION} annotation, which does not parse")


def test_the_plan_sets_allocatable_on_a_driver_that_had_none() -> None:
    obj = csinode(None, 25)

    plan = plan_restore(obj, EBS, KEYS, REQUEST, NOW)

    assert plan.current is None
    assert next(d for d in plan.body["spec"]["drivers"] if d["name"] == EBS)["allocatable"] == {"count": 25}
    assert obj["spec"]["drivers"][-1] == driver_entry(EBS, None)  # the input is not modified


def test_unverified_reading_still_refuses_a_state_of_another_object() -> None:
    obj = csinode(39, 25)
    obj["metadata"]["uid"] = "00000000-0000-0000-0000-000000000000"

    with pytest.raises(RestoreError, match="was recorded for another object"):
        plan_restore(obj, EBS, None, REQUEST, NOW)
