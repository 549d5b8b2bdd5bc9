"""GuardPolicy YAML: loading, validation messages, durations, per-driver overrides, ceilings
(webhook.admission.policy)."""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from webhook.admission.durations import format_duration, parse_duration
from webhook.admission.policy import (
    Ceiling,
    DriverProfile,
    EnforcementAction,
    PatternCeiling,
    Policy,
    PolicyError,
    Principals,
    bundled_policy_path,
    load_policy,
    load_profile,
    parse_policy,
)

REPO = Path(__file__).resolve().parent.parent
POLICIES = REPO / "policies"
EBS = "ebs.csi.aws.com"
GCE = "pd.csi.storage.gke.io"
AZURE = "disk.csi.azure.com"
VSPHERE = "csi.vsphere.vmware.com"
INSTANCE_TYPE = "node.kubernetes.io/instance-type"

MINIMAL: dict[str, Any] = {"apiVersion": "csinode-guard.io/v1alpha1", "kind": "GuardPolicy", "spec": {}}


def policy_files() -> list[Path]:
    """Every policy YAML under policies/, except driver profiles and policy tests."""
    return sorted(
        p for p in POLICIES.rglob("*.y*ml") if not {"profiles", "tests"} & set(p.relative_to(POLICIES).parts[:-1])
    )


def make_policy(**spec: Any) -> Policy:
    return parse_policy({**MINIMAL, "spec": spec}, "test.yaml")


# -- every shipped policy loads ------------------------------------------------------------------------------------


def test_the_policies_directory_has_policies_to_check() -> None:
    assert POLICIES / "default.yaml" in policy_files()


@pytest.mark.parametrize(
    "path", [pytest.param(p, id=f"{p.relative_to(REPO)} loads") for p in policy_files()]
)
def test_every_policy_in_the_policies_directory_loads(path: Path) -> None:
    policy = load_policy(path)
    assert policy.source == str(path)
    assert len(policy.hash) == 16


def test_the_bundled_default_is_policies_default_yaml() -> None:
    assert bundled_policy_path().read_bytes() == (POLICIES / "default.yaml").read_bytes()


def test_load_policy_without_a_path_loads_the_bundled_default() -> None:
    policy = load_policy()
    assert policy.name == "default"
    assert policy.source == "(bundled) default.yaml"
    assert policy.hash == load_policy(POLICIES / "default.yaml").hash


def test_the_default_policy_has_the_ceilings_the_driver_sources_give() -> None:
    policy = load_policy()

    def ceiling(driver: str, labels: dict[str, str] | None) -> int | None:
        return policy.for_driver(driver).ceiling.resolve(labels)[0]

    assert policy.for_driver(EBS).ceiling.max == 128
    assert ceiling(EBS, None) == 27
    assert policy.for_driver(GCE).ceiling.max == 127
    assert ceiling(GCE, {INSTANCE_TYPE: "e2-micro"}) == 15
    assert ceiling(GCE, None) == 127
    assert policy.for_driver(AZURE).ceiling.max == 64
    assert ceiling(AZURE, None) == 16
    assert ceiling(VSPHERE, None) == 255
    assert ceiling("nfs.csi.k8s.io", None) is None


def test_the_default_policy_has_the_documented_rule_settings() -> None:
    rules = load_policy().for_driver(EBS).rules

    assert (rules.identity_action, rules.version_action, rules.ceiling_action) == (
        EnforcementAction.DENY,
        EnforcementAction.DENY,
        EnforcementAction.CLAMP,
    )
    assert (rules.rollback_action, rules.drop_to_zero_action, rules.rate_action, rules.integrity_action) == (
        EnforcementAction.DENY,
        EnforcementAction.WARN,
        EnforcementAction.DENY,
        EnforcementAction.DENY,
    )
    assert rules.version_on_unknown == "allow"
    assert (rules.freeze_for, rules.rollback_window, rules.recovery_step, rules.min_interval) == (
        6 * 3600.0,
        3600.0,
        2,
        60.0,
    )
    assert load_policy().for_driver(EBS).max_step_up == 16


# -- broken policies -----------------------------------------------------------------------------------------------


def broken(change: str, value: Any) -> dict[str, Any]:
    """MINIMAL with ``value`` set at the dotted path ``change`` (``spec.rules.change-rate.minInterval``)."""
    doc = copy.deepcopy(MINIMAL)
    *parents, last = change.split("|")
    target = doc
    for key in parents:
        target = target.setdefault(key, {})
    target[last] = value
    return doc


@pytest.mark.parametrize(
    ("doc", "path", "constraint"),
    [
        pytest.param(broken("apiVersion", "v1"), "$.apiVersion", "'csinode-guard.io/v1alpha1' was expected",
                     id="a wrong apiVersion"),
        pytest.param(broken("kind", "Policy"), "$.kind", "'GuardPolicy' was expected", id="a wrong kind"),
        pytest.param({"apiVersion": "csinode-guard.io/v1alpha1", "kind": "GuardPolicy"}, "$",
                     "'spec' is a required property", id="no spec"),
        pytest.param(broken("spec|rule", {}), "$.spec", "Additional properties are not allowed ('rule' was unexpected)",
                     id="a misspelt spec field"),
        pytest.param(
            broken("spec|rules|count-ceiling", {"enforcementAction": "block"}),
            "$.spec.rules.count-ceiling.enforcementAction",
            "'block' is not one of ['deny', 'clamp', 'warn', 'dryrun']",
            id="an unknown enforcement action",
        ),
        pytest.param(
            broken("spec|rules|writer-identity", {"enforcementAction": "clamp"}),
            "$.spec.rules.writer-identity.enforcementAction",
            "'clamp' is not one of ['deny', 'warn', 'dryrun']",
            id="clamp for a rule that cannot clamp",
        ),
        pytest.param(
            broken("spec|rules|count-roll-back", {}),
            "$.spec.rules",
            "'count-roll-back' was unexpected",
            id="an unknown rule id",
        ),
        pytest.param(
            broken("spec|rules|change-rate", {"minInterval": "1m30"}),
            "$.spec.rules.change-rate.minInterval",
            "'1m30' is not a duration like 30s, 15m or 2h (or a number of seconds)",
            id="a duration without a unit",
        ),
        pytest.param(
            broken("spec|rules|count-rollback", {"window": -5}),
            "$.spec.rules.count-rollback.window",
            "-5 is less than the minimum of 0",
            id="a negative duration",
        ),
        pytest.param(
            broken("spec|rules|count-rollback", {"recoveryStep": 0}),
            "$.spec.rules.count-rollback.recoveryStep",
            "0 is less than the minimum of 1",
            id="a recovery step of 0",
        ),
        pytest.param(
            broken("spec|rules|change-rate", {"clusterBudget": {"increasesPerSecond": 5}}),
            "$.spec.rules.change-rate.clusterBudget",
            "'burst' is a required property",
            id="a cluster budget without burst",
        ),
        pytest.param(
            broken("spec|drivers", {EBS: {"ceiling": {"max": -1}}}),
            f"$.spec.drivers['{EBS}'].ceiling.max",
            "-1 is less than the minimum of 0",
            id="a negative ceiling",
        ),
        pytest.param(
            broken("spec|defaults", {"ceiling": {"max": 2147483648}}),
            "$.spec.defaults.ceiling.max",
            "2147483648 is greater than the maximum of 2147483647",
            id="a ceiling above int32",
        ),
        pytest.param(
            broken("spec|defaults", {"maxStepUp": 0}),
            "$.spec.defaults.maxStepUp",
            "0 is less than the minimum of 1",
            id="a max step up of 0",
        ),
        pytest.param(
            broken("spec|writers", {"serviceAccounts": ["kube-system:csi-controller"]}),
            "$.spec.writers.serviceAccounts[0]",
            "'kube-system:csi-controller' is not a service account written as namespace/name",
            id="a service account not written as namespace slash name",
        ),
        pytest.param(
            broken("spec|evidence", {"largeDecreaseFraction": 1.5}),
            "$.spec.evidence.largeDecreaseFraction",
            "1.5 is greater than the maximum of 1",
            id="a large decrease fraction above 1",
        ),
        pytest.param(
            broken("spec|enforcementScope", {"nodeSelector": {"matchLabels": {"canary": True}}}),
            "$.spec.enforcementScope.nodeSelector.matchLabels.canary",
            "True is not of type 'string'",
            id="a node selector label that is not a string",
        ),
        pytest.param(
            broken("spec|defaults", {"versionSource": {"type": "pod", "namespace": "kube-system"}}),
            "$.spec.defaults.versionSource",
            "is not valid under any of the given schemas",
            id="a pod version source without selector",
        ),
        pytest.param(
            broken("spec|drivers", {EBS: {"minVersion": "1.2.3-01"}}),
            f"$.spec.drivers['{EBS}'].minVersion",
            "not a semantic version: '1.2.3-01'",
            id="a min version that is not a semantic version",
        ),
        pytest.param(
            broken("spec|drivers", {EBS: {"minVersion": "latest"}}),
            f"$.spec.drivers['{EBS}'].minVersion",
            "'latest' is not a version like v1.30.0 or 1.30",
            id="a min version that is not a version at all",
        ),
        pytest.param(
            broken("spec|drivers", {EBS: {"ceiling": {"profile": "EBS_Profile"}}}),
            f"$.spec.drivers['{EBS}'].ceiling.profile",
            "'EBS_Profile' is not a profile name",
            id="a profile name with capitals",
        ),
        pytest.param(
            broken("spec|drivers", {EBS: {"ceiling": {"profile": "no-such-profile"}}}),
            f"$.spec.drivers['{EBS}'].ceiling.profile",
            "driver profile 'no-such-profile' not found",
            id="a driver profile that does not exist",
        ),
        pytest.param(
            broken("spec|defaults", {"rules": {"count-ceiling": {"enforcementAction": "deny"}}}),
            "$.spec.defaults.rules",
            "rules are set under spec.rules (every driver) or spec.drivers.<driver>.rules, not under spec.defaults",
            id="rules under defaults that would be ignored",
        ),
    ],
)
def test_a_broken_policy_is_refused_naming_file_path_and_constraint(
    tmp_path: Path, doc: dict[str, Any], path: str, constraint: str
) -> None:
    file = tmp_path / "guard.yaml"
    file.write_text(yaml.safe_dump(doc))

    with pytest.raises(PolicyError) as caught:
        load_policy(file)

    error = caught.value
    assert (error.source, error.path) == (str(file), path)
    assert constraint in error.constraint
    assert str(error).startswith(f"{file}: at {path}: ")
    assert constraint in str(error)


@pytest.mark.parametrize(
    ("text", "path", "constraint"),
    [
        pytest.param("spec: [unclosed\n", "line 2, column 1", "not valid YAML", id="text that is not YAML"),
        pytest.param("a: 1\n---\nb: 2\n", "line 2, column 1", "not valid YAML", id="two YAML documents"),
        pytest.param("", "$", "the file is empty (no YAML document)", id="an empty file"),
        pytest.param("# a comment only\n\n", "$", "the file is empty (no YAML document)", id="comments only"),
        pytest.param("- GuardPolicy\n", "$", "is not of type 'object'", id="a YAML list"),
    ],
)
def test_a_file_that_is_not_one_policy_document_is_refused(
    tmp_path: Path, text: str, path: str, constraint: str
) -> None:
    file = tmp_path / "guard.yaml"
    file.write_text(text)

    with pytest.raises(PolicyError) as caught:
        load_policy(file)

    assert (caught.value.source, caught.value.path) == (str(file), path)
    assert constraint in caught.value.constraint


def test_a_missing_file_is_refused_naming_it(tmp_path: Path) -> None:
    file = tmp_path / "missing.yaml"
    with pytest.raises(PolicyError, match=r"missing\.yaml: at \(document\): cannot read: No such file"):
        load_policy(file)


def test_policy_error_is_a_value_error() -> None:
    assert issubclass(PolicyError, ValueError)


# -- durations -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        pytest.param("30s", 30.0, id="seconds"),
        pytest.param("15m", 900.0, id="minutes"),
        pytest.param("6h", 21600.0, id="hours"),
        pytest.param("2d", 172800.0, id="days"),
        pytest.param("500ms", 0.5, id="milliseconds"),
        pytest.param("1h30m", 5400.0, id="hours and minutes"),
        pytest.param("1.5m", 90.0, id="a fraction"),
        pytest.param(" 30s ", 30.0, id="surrounding whitespace"),
        pytest.param(45, 45.0, id="a plain number of seconds"),
        pytest.param(0, 0.0, id="zero"),
    ],
)
def test_parse_duration(value: str | float, seconds: float) -> None:
    assert parse_duration(value) == seconds


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("", id="empty"),
        pytest.param("1m30", id="a number without unit at the end"),
        pytest.param("m", id="a unit without number"),
        pytest.param("-5s", id="a negative text"),
        pytest.param(-1, id="a negative number"),
        pytest.param("5 s", id="a space inside"),
        pytest.param("5S", id="an upper case unit"),
        pytest.param("1.5.5s", id="two decimal points"),
        pytest.param("1w", id="weeks"),
        pytest.param(True, id="a boolean"),
    ],
)
def test_parse_duration_refuses_malformed_values(value: Any) -> None:
    with pytest.raises(ValueError):
        parse_duration(value)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        pytest.param(0, "0.0s", id="zero"),
        pytest.param(0.25, "0.2s", id="under a second"),
        pytest.param(1, "1s", id="one second"),
        pytest.param(60, "1m", id="one minute"),
        pytest.param(90, "1m30s", id="a minute and a half"),
        pytest.param(3600, "1h", id="one hour"),
        pytest.param(90061, "1d1h1m1s", id="every unit"),
        pytest.param(59.6, "1m", id="rounded to whole seconds"),
    ],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_policy_durations_become_seconds() -> None:
    policy = make_policy(
        evidence={"resourceExhaustedWithin": "10m"},
        rules={
            "writer-version": {"freezeFor": "1h30m"},
            "count-rollback": {"window": "2h"},
            "change-rate": {"minInterval": 90},
        },
    )
    rules = policy.for_driver(EBS).rules

    assert policy.evidence_within == 600.0
    assert (rules.freeze_for, rules.rollback_window, rules.min_interval) == (5400.0, 7200.0, 90.0)


def test_an_empty_spec_gets_the_built_in_defaults() -> None:
    policy = make_policy()
    rules = policy.for_driver(EBS).rules

    assert policy.evidence_within == 900.0
    assert policy.large_decrease_fraction == 0.5
    assert policy.cluster_budget is None
    assert policy.scope_match_labels is None
    assert (rules.ceiling_action, rules.rate_action, rules.min_interval) == (
        EnforcementAction.CLAMP,
        EnforcementAction.DENY,
        60.0,
    )
    assert policy.for_driver(EBS).max_step_up is None
    assert policy.for_driver(EBS).ceiling == Ceiling()
    assert policy.for_driver(EBS).version_source.type == "annotation"


# -- per-driver overrides ------------------------------------------------------------------------------------------

OVERRIDES = make_policy(
    rules={
        "count-ceiling": {"enforcementAction": "deny"},
        "count-rollback": {"window": "2h", "recoveryStep": 3, "dropToZero": {"enforcementAction": "deny"}},
        "change-rate": {"clusterBudget": {"increasesPerSecond": 5, "burst": 50}},
    },
    defaults={
        "maxStepUp": 16,
        "minVersion": "v1.20.0",
        "versionSource": {"type": "annotation", "annotation": "example.com/versions"},
        "ceiling": {"max": 100, "nodeLabel": INSTANCE_TYPE, "unknown": 20},
    },
    drivers={
        EBS: {
            "minVersion": "v1.30.0",
            "ceiling": {"max": 128},
            "rules": {
                "count-ceiling": {"enforcementAction": "warn"},
                "count-rollback": {"recoveryStep": 5},
            },
        },
        GCE: {"maxStepUp": None, "ceiling": None},
        AZURE: {
            "versionSource": {
                "type": "pod",
                "namespace": "kube-system",
                "selector": {"matchLabels": {"app": "csi-azuredisk-node"}},
                "container": "azuredisk",
            }
        },
    },
)


def test_a_driver_override_is_merged_over_the_defaults() -> None:
    ebs = OVERRIDES.for_driver(EBS)

    assert ebs.min_version == "v1.30.0"
    assert ebs.max_step_up == 16
    assert (ebs.version_source.type, ebs.version_source.annotation) == ("annotation", "example.com/versions")


def test_a_drivers_rules_are_merged_over_spec_rules() -> None:
    rules = OVERRIDES.for_driver(EBS).rules

    assert rules.ceiling_action is EnforcementAction.WARN
    assert (rules.recovery_step, rules.rollback_window) == (5, 7200.0)
    assert rules.drop_to_zero_action is EnforcementAction.DENY


def test_a_drivers_ceiling_replaces_the_default_ceiling_as_a_whole() -> None:
    assert OVERRIDES.for_driver(EBS).ceiling == Ceiling(max=128)


def test_null_in_a_driver_override_removes_the_default() -> None:
    gce = OVERRIDES.for_driver(GCE)
    assert gce.max_step_up is None
    assert gce.ceiling == Ceiling()


def test_a_driver_the_policy_does_not_name_gets_the_defaults() -> None:
    other = OVERRIDES.for_driver("nfs.csi.k8s.io")

    assert other.driver == "nfs.csi.k8s.io"
    assert (other.min_version, other.max_step_up) == ("v1.20.0", 16)
    assert other.ceiling == Ceiling(max=100, node_label=INSTANCE_TYPE, unknown=20)
    assert other.rules.ceiling_action is EnforcementAction.DENY
    assert other.rules.recovery_step == 3


def test_overrides_do_not_leak_into_other_drivers() -> None:
    assert OVERRIDES.for_driver(AZURE).rules.ceiling_action is EnforcementAction.DENY
    assert OVERRIDES.for_driver(AZURE).min_version == "v1.20.0"


def test_a_pod_version_source_is_listed_for_the_cluster_view() -> None:
    (source,) = OVERRIDES.pod_version_sources()

    assert OVERRIDES.for_driver(AZURE).version_source.type == "pod"
    assert (source.driver, source.namespace, source.match_labels, source.container, source.label) == (
        AZURE,
        "kube-system",
        (("app", "csi-azuredisk-node"),),
        "azuredisk",
        None,
    )


def test_the_cluster_budget_comes_from_change_rate() -> None:
    assert OVERRIDES.cluster_budget is not None
    assert (OVERRIDES.cluster_budget.increases_per_second, OVERRIDES.cluster_budget.burst) == (5.0, 50)


def test_the_policy_hash_follows_the_content() -> None:
    same = make_policy(rules={"count-ceiling": {"enforcementAction": "deny"}})
    again = make_policy(rules={"count-ceiling": {"enforcementAction": "deny"}})
    other = make_policy(rules={"count-ceiling": {"enforcementAction": "warn"}})

    assert same.hash == again.hash
    assert same.hash != other.hash


# -- ceilings ------------------------------------------------------------------------------------------------------

PROFILE = DriverProfile(
    name="example",
    driver=EBS,
    node_label=INSTANCE_TYPE,
    default=27,
    ceilings={"m5.large": 25, "t3.micro": 39},
    patterns=(PatternCeiling("r7i.*", 31),),
    case_insensitive=False,
    source={},
)


@pytest.mark.parametrize(
    ("ceiling", "labels", "expected"),
    [
        pytest.param(Ceiling(), None, (None, ""), id="no ceiling at all"),
        pytest.param(Ceiling(max=255), {INSTANCE_TYPE: "x"}, (255, "driver ceiling"), id="only a driver maximum"),
        pytest.param(
            Ceiling(max=128, node_label=INSTANCE_TYPE, values={"m7i.large": 31}),
            {INSTANCE_TYPE: "m7i.large"},
            (31, "node.kubernetes.io/instance-type=m7i.large"),
            id="a listed label value",
        ),
        pytest.param(
            Ceiling(max=128, node_label=INSTANCE_TYPE, patterns=(PatternCeiling("e2-*", 15),)),
            {INSTANCE_TYPE: "e2-medium"},
            (15, "node.kubernetes.io/instance-type=e2-medium matches e2-*"),
            id="a matching pattern",
        ),
        pytest.param(
            Ceiling(
                node_label=INSTANCE_TYPE,
                values={"e2-medium": 7},
                patterns=(PatternCeiling("e2-*", 15),),
            ),
            {INSTANCE_TYPE: "e2-medium"},
            (7, "node.kubernetes.io/instance-type=e2-medium"),
            id="a listed value wins over a pattern",
        ),
        pytest.param(
            Ceiling(node_label=INSTANCE_TYPE, patterns=(PatternCeiling("e2-*", 15), PatternCeiling("e2-m*", 3))),
            {INSTANCE_TYPE: "e2-medium"},
            (15, "node.kubernetes.io/instance-type=e2-medium matches e2-*"),
            id="the first matching pattern wins",
        ),
        pytest.param(
            Ceiling(max=128, node_label=INSTANCE_TYPE, unknown=27),
            None,
            (27, "ceiling for unknown node"),
            id="unknown for an unknown node",
        ),
        pytest.param(
            Ceiling(max=128, node_label=INSTANCE_TYPE, unknown=27),
            {"kubernetes.io/os": "linux"},
            (27, "ceiling for node.kubernetes.io/instance-type=(unset) not listed"),
            id="unknown for a node without the label",
        ),
        pytest.param(
            Ceiling(max=128, node_label=INSTANCE_TYPE, unknown=27, values={"m5.large": 25}),
            {INSTANCE_TYPE: "m6i.large"},
            (27, "ceiling for node.kubernetes.io/instance-type=m6i.large not listed"),
            id="unknown for a value that is not listed",
        ),
        pytest.param(
            Ceiling(max=128, node_label=INSTANCE_TYPE),
            {INSTANCE_TYPE: "m6i.large"},
            (128, "driver ceiling"),
            id="the maximum when nothing matches and no unknown is set",
        ),
        pytest.param(
            Ceiling(max=30, node_label=INSTANCE_TYPE, values={"huge": 64}),
            {INSTANCE_TYPE: "huge"},
            (30, "driver ceiling"),
            id="the maximum caps a larger label value",
        ),
        pytest.param(
            Ceiling(max=128, profile=PROFILE),
            {INSTANCE_TYPE: "t3.micro"},
            (39, "node.kubernetes.io/instance-type=t3.micro (profile example)"),
            id="a profile entry with the profile's label",
        ),
        pytest.param(
            Ceiling(max=128, profile=PROFILE),
            {INSTANCE_TYPE: "r7i.2xlarge"},
            (31, "node.kubernetes.io/instance-type=r7i.2xlarge (profile example)"),
            id="a profile pattern",
        ),
        pytest.param(
            Ceiling(max=128, node_label=INSTANCE_TYPE, values={"t3.micro": 20}, profile=PROFILE),
            {INSTANCE_TYPE: "t3.micro"},
            (20, "node.kubernetes.io/instance-type=t3.micro"),
            id="the policy's own values win over the profile",
        ),
        pytest.param(
            Ceiling(max=128, profile=PROFILE),
            {INSTANCE_TYPE: "c7g.large"},
            (27, "ceiling for node.kubernetes.io/instance-type=c7g.large not listed"),
            id="the profile default for a value it does not list",
        ),
        pytest.param(
            Ceiling(max=128, unknown=16, profile=PROFILE),
            None,
            (16, "ceiling for unknown node"),
            id="the policy's unknown wins over the profile default",
        ),
    ],
)
def test_ceiling_resolve(
    ceiling: Ceiling, labels: dict[str, str] | None, expected: tuple[int | None, str]
) -> None:
    assert ceiling.resolve(labels) == expected


def test_a_profile_is_loaded_from_the_policy_directory(tmp_path: Path) -> None:
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "example.yaml").write_text(
        textwrap.dedent(
            """\
            apiVersion: csinode-guard.io/v1alpha1
            kind: DriverProfile
            metadata: {name: example}
            spec:
              driver: ebs.csi.aws.com
              caseInsensitive: true
              default: 27
              ceilings: {M5.Large: 25}
              patterns: [{match: "r7i.*", ceiling: 31}]
              source: {repository: https://example.com}
            """
        )
    )
    (tmp_path / "guard.yaml").write_text(
        yaml.safe_dump({**MINIMAL, "spec": {"drivers": {EBS: {"ceiling": {"max": 128, "profile": "example"}}}}})
    )

    ceiling = load_policy(tmp_path / "guard.yaml").for_driver(EBS).ceiling

    assert ceiling.profile is not None
    assert ceiling.profile.node_label == INSTANCE_TYPE
    assert ceiling.resolve({INSTANCE_TYPE: "m5.large"})[0] == 25
    assert ceiling.resolve({INSTANCE_TYPE: "R7I.large"})[0] == 31
    assert ceiling.resolve(None)[0] == 27


@pytest.mark.parametrize(
    ("text", "constraint"),
    [
        pytest.param("kind: GuardPolicy\nspec: {driver: x, default: 1}\nmetadata: {name: x}\n", "must be DriverProfile",
                     id="another kind"),
        pytest.param("kind: DriverProfile\nmetadata: {name: x}\nspec: {driver: x}\n", "not a valid DriverProfile",
                     id="a profile without default"),
        pytest.param("kind: DriverProfile\n", "not a valid DriverProfile", id="a profile without spec"),
        pytest.param("kind: [\n", "cannot read profile", id="a profile that is not YAML"),
    ],
)
def test_a_broken_profile_is_refused_naming_the_file(tmp_path: Path, text: str, constraint: str) -> None:
    file = tmp_path / "broken.yaml"
    file.write_text(text)
    with pytest.raises(PolicyError) as caught:
        load_profile(file)
    assert caught.value.source == str(file)
    assert constraint in caught.value.constraint


@pytest.mark.parametrize(
    "path", [pytest.param(p, id=f"{p.name} loads") for p in sorted((POLICIES / "profiles").glob("*.yaml"))]
)
def test_every_driver_profile_loads(path: Path) -> None:
    profile = load_profile(path)
    assert profile.driver == path.stem
    assert profile.default > 0


# -- principals ----------------------------------------------------------------------------------------------------

PRINCIPALS = Principals(
    users=frozenset({"alice"}),
    groups=frozenset({"csinode-guard:approvers"}),
    service_accounts=frozenset({"kube-system/csi-limits-controller"}),
)


@pytest.mark.parametrize(
    ("username", "groups", "contains"),
    [
        pytest.param("alice", (), True, id="a listed user"),
        pytest.param("bob", ("system:authenticated", "csinode-guard:approvers"), True, id="a member of a listed group"),
        pytest.param(
            "system:serviceaccount:kube-system:csi-limits-controller", (), True, id="a listed service account"
        ),
        pytest.param("system:serviceaccount:default:csi-limits-controller", (), False,
                     id="a service account of the same name in another namespace"),
        pytest.param("bob", ("system:authenticated",), False, id="anyone else"),
        pytest.param("", (), False, id="anonymous"),
        pytest.param("kube-system/csi-limits-controller", (), False, id="a user named like a service account"),
    ],
)
def test_principals_contains(username: str, groups: tuple[str, ...], contains: bool) -> None:
    assert PRINCIPALS.contains(username, groups) is contains


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        pytest.param(
            "apiVersion: csinode-guard.io/v1alpha1\nkind: GuardPolicy\nspec:\n  defaults:\n"
            "    maxStepUp: 4\n    maxStepUp: 8\n",
            "duplicate key 'maxStepUp'",
            id="a key given twice is refused instead of the last one winning",
        ),
        pytest.param(
            "apiVersion: csinode-guard.io/v1alpha1\nkind: GuardPolicy\nspec:\n  drivers:\n    d:\n      ceiling:\n"
            "        max: 128\n        unknown: 500\n",
            "500 is above ceiling.max 128",
            id="an unknown-type ceiling above the driver maximum is refused",
        ),
    ],
)
def test_policy_mistakes_that_yaml_and_the_schema_let_through_are_refused(
    tmp_path: Path, text: str, fragment: str
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError) as caught:
        load_policy(path)
    assert fragment in str(caught.value)
    assert str(path) in str(caught.value)


def test_a_policy_that_is_not_utf8_is_refused_with_the_file_named(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_bytes("apiVersion: csinode-guard.io/v1alpha1\nkind: GuardPolicy\nspec: {}\n".encode("utf-16"))
    with pytest.raises(PolicyError) as caught:
        load_policy(path)
    assert "not UTF-8" in str(caught.value)
    assert str(path) in str(caught.value)
