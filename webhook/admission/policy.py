"""The GuardPolicy: model, loading and validation against the packaged JSON Schema.

A policy is YAML (``apiVersion: csinode-guard.io/v1alpha1``, ``kind: GuardPolicy``): principals (writers,
justifiers, exemptions), per-rule settings with an enforcement action, ``defaults`` for every driver and
per-driver overrides under ``drivers`` (deep-merged over the defaults; a driver's ``rules`` are merged over
``spec.rules``). Durations are ``30s``, ``15m``, ``1h30m`` or seconds. A driver ceiling may name a driver profile
(``policies/profiles/<name>.yaml``, ``kind: DriverProfile``) that maps node label values to ceilings.

Errors: :class:`PolicyError` names the file, the path inside the document and the broken constraint; a broken
policy is never half-loaded.
"""

from __future__ import annotations

import copy
import enum
import fnmatch
import functools
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from webhook.admission.cluster import PodVersionSource
from webhook.admission.durations import DURATION_HINT, DURATION_PATTERN, parse_duration
from webhook.admission.safe_yaml import load_yaml
from webhook.admission.versions import VersionError, parse_version

RULE_IDS = ("writer-identity", "writer-version", "count-ceiling", "count-rollback", "change-rate")
STATE_INTEGRITY = "state-integrity"
DRIVER_VERSIONS_ANNOTATION = "csinode-guard.io/driver-versions"
BUNDLED_POLICY = "default.yaml"


class PolicyError(ValueError):
    """A policy or profile that cannot be used: ``source`` file, ``path`` in the document, ``constraint``."""

    def __init__(self, source: str, path: str, constraint: str) -> None:
        super().__init__(f"{source}: at {path or '(document)'}: {constraint}")
        self.source = source
        self.path = path
        self.constraint = constraint


class EnforcementAction(enum.StrEnum):
    """What a violated rule does (not the apiserver's ``dryRun`` flag).

    ``deny`` rejects the write; ``clamp`` (/mutate) rewrites the count to the nearest allowed value and warns;
    ``warn`` allows with an AdmissionResponse warning; ``dryrun`` allows, recording only an audit record and a
    metric.
    """

    DENY = "deny"
    CLAMP = "clamp"
    WARN = "warn"
    DRYRUN = "dryrun"


@dataclass(frozen=True)
class Principals:
    """Users, groups and service accounts (``namespace/name``) that a policy names."""

    users: frozenset[str] = frozenset()
    groups: frozenset[str] = frozenset()
    service_accounts: frozenset[str] = frozenset()

    def contains(self, username: str, groups: tuple[str, ...]) -> bool:
        """True when the requester (``userInfo.username``/``groups``) is one of these principals."""
        if username in self.users or not self.groups.isdisjoint(groups):
            return True
        prefix = "system:serviceaccount:"
        if username.startswith(prefix):
            return username[len(prefix) :].replace(":", "/", 1) in self.service_accounts
        return False


@dataclass(frozen=True)
class VersionSource:
    """Where a driver's version on a node comes from: ``annotation``, ``pod`` or ``kubelet``."""

    type: str
    annotation: str = DRIVER_VERSIONS_ANNOTATION
    pod: PodVersionSource | None = None


@dataclass(frozen=True)
class PatternCeiling:
    """A glob (fnmatch) on the node label value and its ceiling (count)."""

    match: str
    ceiling: int


@dataclass(frozen=True)
class DriverProfile:
    """Ceilings per node label value for one driver, read from the driver's own tables (``source``)."""

    name: str
    driver: str
    node_label: str
    default: int
    ceilings: Mapping[str, int]
    patterns: tuple[PatternCeiling, ...]
    case_insensitive: bool
    source: Mapping[str, Any]

    def lookup(self, value: str) -> int | None:
        """The ceiling for label ``value``: exact entry, then the first matching pattern; None if neither."""
        key = value.lower() if self.case_insensitive else value
        if key in self.ceilings:
            return self.ceilings[key]
        for p in self.patterns:
            if fnmatch.fnmatchcase(key, p.match):
                return p.ceiling
        return None


@dataclass(frozen=True)
class Ceiling:
    """A driver's ceiling: ``max`` overall, refined by ``node_label`` via values, patterns and a profile.

    ``unknown`` applies when the label (or the node) is unknown or its value is not listed; it defaults to the
    profile's default, then to ``max``.
    """

    max: int | None = None
    node_label: str | None = None
    unknown: int | None = None
    values: Mapping[str, int] = field(default_factory=dict)
    patterns: tuple[PatternCeiling, ...] = ()
    profile: DriverProfile | None = None

    @property
    def label(self) -> str | None:
        """The node label that selects the ceiling (``nodeLabel``, else the profile's), None when none does."""
        return self.node_label or (self.profile.node_label if self.profile else None)

    def resolve(self, labels: Mapping[str, str] | None) -> tuple[int | None, str]:
        """The ceiling (count, None = no ceiling) for a node with ``labels`` (None = unknown) and why."""
        label = self.label
        value = labels.get(label) if (labels is not None and label) else None
        found: int | None = None
        why = ""
        if value is not None:
            if value in self.values:
                found, why = self.values[value], f"{label}={value}"
            else:
                for p in self.patterns:
                    if fnmatch.fnmatchcase(value, p.match):
                        found, why = p.ceiling, f"{label}={value} matches {p.match}"
                        break
            if found is None and self.profile is not None:
                hit = self.profile.lookup(value)
                if hit is not None:
                    found, why = hit, f"{label}={value} (profile {self.profile.name})"
        if found is None and label:
            fallback = self.unknown
            if fallback is None and self.profile is not None:
                fallback = self.profile.default
            if fallback is not None:
                state = "unknown node" if labels is None else f"{label}={value or '(unset)'} not listed"
                found, why = fallback, f"ceiling for {state}"
        if self.max is not None and (found is None or found > self.max):
            found, why = self.max, "driver ceiling"
        return found, why


@dataclass(frozen=True)
class RuleSettings:
    """Effective settings of the five rules for one driver. Durations are seconds."""

    identity_action: EnforcementAction = EnforcementAction.DENY
    version_action: EnforcementAction = EnforcementAction.DENY
    version_on_unknown: str = "allow"
    freeze_for: float = 6 * 3600.0
    ceiling_action: EnforcementAction = EnforcementAction.CLAMP
    rollback_action: EnforcementAction = EnforcementAction.DENY
    rollback_window: float = 3600.0
    recovery_step: int = 2
    recovery_gate: str = "attaches"
    """``count-rollback.recoveryGate``: ``attaches`` (a recovery step needs attaches without a capacity-class failure
    since the last step, :mod:`webhook.admission.rules.count_rollback`) or ``time`` (``recoveryStep`` per change)."""
    drop_to_zero_action: EnforcementAction = EnforcementAction.WARN
    rate_action: EnforcementAction = EnforcementAction.DENY
    min_interval: float = 60.0
    integrity_action: EnforcementAction = EnforcementAction.DENY


@dataclass(frozen=True)
class DriverPolicy:
    """Everything the rules need for one driver (defaults merged with the driver's overrides)."""

    driver: str
    rules: RuleSettings
    version_source: VersionSource
    min_version: str | None = None
    max_step_up: int | None = None
    ceiling: Ceiling = field(default_factory=Ceiling)


@dataclass(frozen=True)
class ClusterBudget:
    """change-rate's cluster-wide increase budget per replica: a token bucket (increases/second, burst)."""

    increases_per_second: float
    burst: int


@dataclass(frozen=True)
class BrakeSettings:
    """``spec.brake``: when capacity-class attach failures follow the increases the guard admitted, hold every
    increase of that driver cluster-wide (:mod:`webhook.admission.brake`).

    ``enabled`` the audit leader engages brakes at all; ``lookback`` seconds: an increase admitted this recently,
    and a VolumeAttachment attach error with gRPC code 8 (ResourceExhausted) on that node after it, are evidence;
    the brake engages when at least ``min_nodes`` nodes with such an increase had such a failure, or at least
    ``min_fraction`` of the nodes with such an increase (counted only when two or more failed);
    ``quiet_period`` seconds without a capacity-class failure of the driver anywhere release it."""

    enabled: bool = True
    lookback: float = 3600.0
    min_nodes: int = 3
    min_fraction: float = 0.5
    quiet_period: float = 1800.0


@dataclass(frozen=True)
class Policy:
    """A loaded, validated GuardPolicy. ``hash`` is the SHA-256 of the canonical document (audit, metric)."""

    name: str
    source: str
    hash: str
    writers: Principals
    justifiers: Principals
    exemptions: Principals
    version_reporters: Principals
    scope_match_labels: Mapping[str, str] | None
    evidence_within: float
    large_decrease_fraction: float
    cluster_budget: ClusterBudget | None
    default_driver: DriverPolicy
    drivers: Mapping[str, DriverPolicy]
    document: Mapping[str, Any]
    brake: BrakeSettings = field(default_factory=BrakeSettings)

    def declares_versions(self, username: str, groups: tuple[str, ...]) -> bool:
        """True when the requester may set the driver-versions annotation: a principal listed under
        ``spec.versionReporters``, ``spec.writers`` or ``spec.justifiers`` (never a kubelet by itself)."""
        return any(p.contains(username, groups) for p in (self.version_reporters, self.writers, self.justifiers))

    @functools.cached_property
    def version_annotations(self) -> frozenset[str]:
        """The annotations the ``annotation`` version sources read: ``csinode-guard.io/driver-versions`` and
        any other name a driver's ``versionSource.annotation`` gives."""
        names = {DRIVER_VERSIONS_ANNOTATION}
        for d in (self.default_driver, *self.drivers.values()):
            if d.version_source.type == "annotation":
                names.add(d.version_source.annotation)
        return frozenset(names)

    @functools.cached_property
    def evidence_window(self) -> timedelta:
        """``evidence_within`` (seconds) as a timedelta, made once per policy."""
        return timedelta(seconds=self.evidence_within)

    @functools.cached_property
    def _unnamed_drivers(self) -> dict[str, DriverPolicy]:
        return {}

    def for_driver(self, driver: str) -> DriverPolicy:
        """The :class:`DriverPolicy` for ``driver`` (the defaults when the policy does not name it)."""
        found = self.drivers.get(driver)
        if found is not None:
            return found
        found = self._unnamed_drivers.get(driver)
        if found is None:
            found = DriverPolicy(
                driver=driver,
                rules=self.default_driver.rules,
                version_source=self.default_driver.version_source,
                min_version=self.default_driver.min_version,
                max_step_up=self.default_driver.max_step_up,
                ceiling=self.default_driver.ceiling,
            )
            if len(self._unnamed_drivers) < 1024:  # remembered: driver names are few (bounded for odd input)
                self._unnamed_drivers[driver] = found
        return found

    def pod_version_sources(self) -> list[PodVersionSource]:
        """The ``pod`` version sources the cluster view must watch, one per driver that uses one."""
        return [d.version_source.pod for d in self.drivers.values() if d.version_source.pod is not None]


@cache
def _schema() -> dict[str, Any]:
    text = resources.files("webhook").joinpath("schema/guardpolicy.schema.json").read_text("utf-8")
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def bundled_policy_path() -> Path:
    """Path of the default policy shipped in the package (``policies/default.yaml``)."""
    return Path(str(resources.files("webhook").joinpath("policies", BUNDLED_POLICY)))


def bundled_profiles_dir() -> Path:
    """Directory of the driver profiles shipped in the package (``policies/profiles``)."""
    return Path(str(resources.files("webhook").joinpath("policies", "profiles")))


_PLAIN_MEMBER = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


def json_path_member(path: str, key: str | int) -> str:
    """``path`` extended by one member: ``.rules`` for a plain name, ``[0]`` for an index, and the bracket form
    ``['ebs.csi.aws.com']`` for any other name (a dotted driver name or label value would otherwise be ambiguous:
    ``$.spec.drivers.ebs.csi.aws.com.ceiling``). Quotes and backslashes in the name are escaped."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    if _PLAIN_MEMBER.fullmatch(key):
        return f"{path}.{key}"
    quoted = key.replace("\\", "\\\\").replace("'", "\\'")
    return f"{path}['{quoted}']"


def json_path(parts: Iterable[str | int], start: str = "$") -> str:
    """The JSON Path of ``parts`` (keys and indexes) below ``start``: ``$.spec.drivers['ebs.csi.aws.com'].ceiling``."""
    out = start
    for p in parts:
        out = json_path_member(out, p)
    return out


def describe_schema_error(error: jsonschema.exceptions.ValidationError) -> str:
    """The constraint a schema violation broke, in words: a malformed duration (not a number), version, service
    account or profile name says what it should look like, never the raw regular expression (which the JSON log
    escapes once more); anything else is jsonschema's own message."""
    number = isinstance(error.instance, int | float) and not isinstance(error.instance, bool)
    for e in () if number else (error, error.parent):
        schema = e.schema if e is not None else None
        if isinstance(schema, Mapping) and (
            schema.get("pattern") == DURATION_PATTERN
            or any(isinstance(s, Mapping) and s.get("pattern") == DURATION_PATTERN for s in schema.get("oneOf") or ())
        ):
            return f"{error.instance!r} is not {DURATION_HINT} (or a number of seconds)"
    if error.validator == "pattern" and isinstance(error.validator_value, str):
        for needle, form in _PATTERN_FORMS:
            if needle in error.validator_value:
                return f"{error.instance!r} is not {form}"
    return str(error.message)


_PATTERN_FORMS = (
    ("(\\.\\d+){0,2}", "a version like v1.30.0 or 1.30"),
    (")?/[a-z0-9]", "a service account written as namespace/name (kube-system/ebs-csi-controller-sa)"),
    ("([-.a-z0-9]*[a-z0-9])?$", "a profile name (lower-case letters, digits, '-' and '.')"),
)
"""What each pattern of the policy schema (webhook/schema) asks for, in words, by a fragment of the pattern."""


def _deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    result = copy.deepcopy(dict(base))
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(result.get(key), Mapping):
            result[key] = _deep_merge(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def _principals(raw: Mapping[str, Any] | None) -> Principals:
    raw = raw or {}
    return Principals(
        users=frozenset(raw.get("users") or ()),
        groups=frozenset(raw.get("groups") or ()),
        service_accounts=frozenset(raw.get("serviceAccounts") or ()),
    )


def _action(raw: Mapping[str, Any], rule: str, default: EnforcementAction) -> EnforcementAction:
    value = (raw.get(rule) or {}).get("enforcementAction")
    return EnforcementAction(value) if value else default


def _rule_settings(raw: Mapping[str, Any]) -> RuleSettings:
    d = RuleSettings()
    version = raw.get("writer-version") or {}
    rollback = raw.get("count-rollback") or {}
    rate = raw.get("change-rate") or {}
    drop = rollback.get("dropToZero") or {}
    return RuleSettings(
        identity_action=_action(raw, "writer-identity", d.identity_action),
        version_action=_action(raw, "writer-version", d.version_action),
        version_on_unknown=str(version.get("onUnknown", d.version_on_unknown)),
        freeze_for=parse_duration(version.get("freezeFor", d.freeze_for)),
        ceiling_action=_action(raw, "count-ceiling", d.ceiling_action),
        rollback_action=_action(raw, "count-rollback", d.rollback_action),
        rollback_window=parse_duration(rollback.get("window", d.rollback_window)),
        recovery_step=int(rollback.get("recoveryStep", d.recovery_step)),
        recovery_gate=str(rollback.get("recoveryGate", d.recovery_gate)),
        drop_to_zero_action=EnforcementAction(drop.get("enforcementAction", d.drop_to_zero_action.value)),
        rate_action=_action(raw, "change-rate", d.rate_action),
        min_interval=parse_duration(rate.get("minInterval", d.min_interval)),
        integrity_action=_action(raw, STATE_INTEGRITY, d.integrity_action),
    )


def load_profile(path: Path) -> DriverProfile:
    """Load a ``kind: DriverProfile`` YAML file; raises :class:`PolicyError` when it is not one."""
    try:
        doc = load_yaml(path.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise PolicyError(str(path), "", f"cannot read profile: {exc}") from None
    try:
        spec = doc["spec"]
        if doc.get("kind") != "DriverProfile":
            raise PolicyError(str(path), "$.kind", "must be DriverProfile")
        ceilings = {str(k): int(v) for k, v in (spec.get("ceilings") or {}).items()}
        if spec.get("caseInsensitive"):
            ceilings = {k.lower(): v for k, v in ceilings.items()}
        return DriverProfile(
            name=str(doc["metadata"]["name"]),
            driver=str(spec["driver"]),
            node_label=str(spec.get("nodeLabel") or "node.kubernetes.io/instance-type"),
            default=int(spec["default"]),
            ceilings=ceilings,
            patterns=tuple(
                PatternCeiling(str(p["match"]), int(p["ceiling"])) for p in spec.get("patterns") or ()
            ),
            case_insensitive=bool(spec.get("caseInsensitive", False)),
            source=dict(spec.get("source") or {}),
        )
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, RecursionError) as exc:
        raise PolicyError(str(path), "$.spec", f"not a valid DriverProfile: {exc}") from None


def _find_profile(name: str, policy_dir: Path | None, source: str, where: str) -> DriverProfile:
    candidates = []
    if policy_dir is not None:
        candidates.append(policy_dir / "profiles" / f"{name}.yaml")
    candidates.append(bundled_profiles_dir() / f"{name}.yaml")
    for candidate in candidates:
        if candidate.is_file():
            return load_profile(candidate)
    raise PolicyError(source, where, f"driver profile {name!r} not found (looked in {[str(c) for c in candidates]})")


def _version_source(raw: Mapping[str, Any] | None, driver: str) -> VersionSource:
    if not raw:
        return VersionSource(type="annotation")
    kind = raw["type"]
    if kind == "pod":
        labels = raw["selector"]["matchLabels"]
        return VersionSource(
            type="pod",
            pod=PodVersionSource(
                driver=driver,
                namespace=str(raw["namespace"]),
                match_labels=tuple(sorted((str(k), str(v)) for k, v in labels.items())),
                container=raw.get("container"),
                label=raw.get("label"),
            ),
        )
    if kind == "annotation":
        return VersionSource(type="annotation", annotation=str(raw.get("annotation", DRIVER_VERSIONS_ANNOTATION)))
    return VersionSource(type=str(kind))


def _driver_policy(
    driver: str, settings: Mapping[str, Any], rules: Mapping[str, Any], source: str, where: str,
    policy_dir: Path | None,
) -> DriverPolicy:
    min_version = settings.get("minVersion")
    if min_version is not None:
        try:
            parse_version(str(min_version))
        except VersionError as exc:
            raise PolicyError(source, json_path_member(where, "minVersion"), str(exc)) from None
    raw_ceiling = settings.get("ceiling") or {}
    profile = None
    if raw_ceiling.get("profile"):
        profile = _find_profile(raw_ceiling["profile"], policy_dir, source,
                                json_path(("ceiling", "profile"), where))
    maximum = raw_ceiling.get("max")
    if maximum is not None:
        below_max: dict[tuple[str, ...], Any] = {("unknown",): raw_ceiling.get("unknown")}
        below_max.update({("values", k): v for k, v in (raw_ceiling.get("values") or {}).items()})
        for key, value in below_max.items():
            if value is not None and value > maximum:
                raise PolicyError(source, json_path(("ceiling", *key), where),
                                  f"{value} is above ceiling.max {maximum}")
    ceiling = Ceiling(
        max=raw_ceiling.get("max"),
        node_label=raw_ceiling.get("nodeLabel"),
        unknown=raw_ceiling.get("unknown"),
        values=dict(raw_ceiling.get("values") or {}),
        patterns=tuple(PatternCeiling(p["match"], p["ceiling"]) for p in raw_ceiling.get("patterns") or ()),
        profile=profile,
    )
    return DriverPolicy(
        driver=driver,
        rules=_rule_settings(rules),
        version_source=_version_source(settings.get("versionSource"), driver),
        min_version=str(min_version) if min_version is not None else None,
        max_step_up=settings.get("maxStepUp"),
        ceiling=ceiling,
    )


def parse_policy(doc: Any, source: str = "<policy>", policy_dir: Path | None = None) -> Policy:
    """Validate a policy document (already parsed YAML) and build a :class:`Policy`.

    Raises :class:`PolicyError` with the JSON path of the first (deepest) schema violation, or of a semantic
    problem (a minVersion that is not a version, a profile that does not exist).
    """
    validator = jsonschema.Draft202012Validator(_schema())
    errors = sorted(validator.iter_errors(doc), key=lambda e: (-len(e.absolute_path), str(e.absolute_path)))
    if errors:
        best = jsonschema.exceptions.best_match(errors)
        if best is None:  # pragma: no cover - iter_errors returned errors
            best = errors[0]
        raise PolicyError(source, json_path(best.absolute_path), describe_schema_error(best))
    spec = doc["spec"]
    base_rules = spec.get("rules") or {}
    defaults = spec.get("defaults") or {}
    if "rules" in defaults:
        # The schema's driverSettings admits ``rules`` for spec.drivers.<driver>; under defaults it would be ignored.
        raise PolicyError(
            source,
            "$.spec.defaults.rules",
            "rules are set under spec.rules (every driver) or spec.drivers.<driver>.rules, not under spec.defaults",
        )
    drivers: dict[str, DriverPolicy] = {}
    for name, override in (spec.get("drivers") or {}).items():
        merged = _deep_merge(defaults, {k: v for k, v in override.items() if k != "rules"})
        if "ceiling" in override and override["ceiling"] is not None:
            merged["ceiling"] = override["ceiling"]
        rules = _deep_merge(base_rules, override.get("rules") or {})
        drivers[name] = _driver_policy(name, merged, rules, source, json_path(("spec", "drivers", name)),
                                       policy_dir)
    default_driver = _driver_policy("*", defaults, base_rules, source, "$.spec.defaults", policy_dir)
    scope = (spec.get("enforcementScope") or {}).get("nodeSelector")
    evidence = spec.get("evidence") or {}
    budget_raw = (base_rules.get("change-rate") or {}).get("clusterBudget")
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str).encode()
    return Policy(
        name=str((doc.get("metadata") or {}).get("name") or Path(source).stem),
        source=source,
        hash=hashlib.sha256(canonical).hexdigest()[:16],
        writers=_principals(spec.get("writers")),
        justifiers=_principals(spec.get("justifiers")),
        exemptions=_principals(spec.get("exemptions")),
        version_reporters=_principals(spec.get("versionReporters")),
        scope_match_labels=dict(scope.get("matchLabels") or {}) if scope is not None else None,
        evidence_within=parse_duration(evidence.get("resourceExhaustedWithin", "15m")),
        large_decrease_fraction=float(evidence.get("largeDecreaseFraction", 0.5)),
        cluster_budget=ClusterBudget(float(budget_raw["increasesPerSecond"]), int(budget_raw["burst"]))
        if budget_raw
        else None,
        default_driver=default_driver,
        drivers=drivers,
        document=doc,
        brake=_brake_settings(spec.get("brake") or {}),
    )


def _brake_settings(raw: Mapping[str, Any]) -> BrakeSettings:
    """``spec.brake`` (schema-checked) with the bundled defaults for what it leaves out."""
    defaults = BrakeSettings()
    return BrakeSettings(
        enabled=bool(raw.get("enabled", defaults.enabled)),
        lookback=parse_duration(raw["lookback"]) if "lookback" in raw else defaults.lookback,
        min_nodes=int(raw.get("minNodes", defaults.min_nodes)),
        min_fraction=float(raw.get("minFraction", defaults.min_fraction)),
        quiet_period=parse_duration(raw["quietPeriod"]) if "quietPeriod" in raw else defaults.quiet_period,
    )


def load_policy(path: str | Path | None = None) -> Policy:
    """Load and validate a policy YAML file (the bundled default when ``path`` is None).

    Raises :class:`PolicyError` (naming the file, the path inside the document and the constraint) when the
    file cannot be read, is not YAML, is not a single document or breaks the schema.
    """
    file = Path(path) if path is not None else bundled_policy_path()
    source = str(path) if path is not None else f"(bundled) {BUNDLED_POLICY}"
    try:
        text = file.read_text("utf-8")
    except OSError as exc:
        raise PolicyError(source, "", f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise PolicyError(source, f"byte {exc.start}", "not UTF-8 text: save the policy as UTF-8") from None
    try:
        doc = load_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise PolicyError(source, where, f"not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if doc is None:  # nothing but whitespace and comments: a truncated write, or the wrong file
        raise PolicyError(source, "$", "the file is empty (no YAML document): write a GuardPolicy into it")
    try:
        return parse_policy(doc, source, file.parent)
    except PolicyError:
        raise
    except RecursionError:  # a document within YAML's nesting limit can still be too deep for the validation
        raise PolicyError(source, "", "nested too deeply") from None
    except (TypeError, ValueError, OverflowError) as exc:  # e.g. a mapping key that is not a string (YAML 123:)
        raise PolicyError(source, "", f"not a valid policy: {exc}") from None
