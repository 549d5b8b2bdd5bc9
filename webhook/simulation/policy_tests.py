"""Running table-driven policy tests: each case's CSINode writes over time through the guard, checked.

The test files (``kind: PolicyTest``) and their schema are :mod:`webhook.simulation.policy_test_files`; the results and
their reports are :mod:`webhook.simulation.policy_test_report`. ``run_test_file`` loads a file and its policy and runs
every case; ``run_cases`` runs an already loaded document.

Each write goes through :func:`webhook.simulation.chain.admit_write`: matchConditions, /mutate, its JSONPatch applied
with ``jsonpatch``, /validate, then stored unless refused or a dry run. The guard's signed state therefore carries
from step to step exactly as through the real webhook. Facts that a real cluster changes without the guard
seeing it (node labels, the driver-versions annotation, attach errors) are applied before the write.

Everything here is pure apart from reading the test and policy files: the clock is the step time and the state
key is fixed.
"""

from __future__ import annotations

import copy
import json
import os
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from webhook.admission.brake import decide_brakes
from webhook.admission.budget import IncreaseBudget
from webhook.admission.cluster import AttachError, StaticClusterView
from webhook.admission.durations import DURATION_PATTERN, parse_duration
from webhook.admission.evaluation import explain
from webhook.admission.justification import JUSTIFICATION_ANNOTATION
from webhook.admission.policy import Policy, PolicyError, json_path, load_policy
from webhook.admission.state import STATE_ANNOTATION, StateKeys, decode_state, format_time, parse_time
from webhook.simulation.chain import WriteOutcome, admit_write
from webhook.simulation.policy_test_files import (
    ABSENT,
    DEFAULT_START,
    UNBOUNDED,
    PolicyTestError,
    load_test_file,
    parse_start,
)
from webhook.simulation.policy_test_report import CaseResult, FileResult, StepResult

KUBELET = "kubelet"
NODE_GROUPS = ("system:nodes", "system:authenticated")
USER_GROUPS = ("system:authenticated",)
MIGRATED_PLUGINS = (
    "kubernetes.io/aws-ebs,kubernetes.io/azure-disk,kubernetes.io/azure-file,kubernetes.io/cinder,"
    "kubernetes.io/gce-pd,kubernetes.io/portworx-volume,kubernetes.io/vsphere-volume"
)
TEST_KEY = b"csinode-guard policy test key 0"
"""The HMAC key of the state in policy tests (fixed: runs are reproducible)."""


# -- objects ----------------------------------------------------------------------------------------------------


def _uid(*parts: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, "csinode-guard-policy-test/" + "/".join(parts)))


def _driver_entry(node: str, driver: str, count: int | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": driver, "nodeID": node, "topologyKeys": ["topology.kubernetes.io/zone"]}
    if count is not None:
        entry["allocatable"] = {"count": count}
    return entry


def _count(value: Any) -> int | str | None:
    if value == UNBOUNDED:
        return None
    return value  # type: ignore[no-any-return]


def build_csinode(node: str, drivers: Mapping[str, Any], annotations: Mapping[str, str], created: datetime) -> dict[
    str, Any
]:
    """A CSINode as kubelet creates it for ``node``: owner reference to the Node, drivers in the given order."""
    entries = []
    for driver, raw in drivers.items():
        count = _count(raw)
        if count == ABSENT:
            continue
        assert count is None or isinstance(count, int)
        entries.append(_driver_entry(node, driver, count))
    return {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "CSINode",
        "metadata": {
            "name": node,
            "uid": _uid("csinode", node),
            "resourceVersion": "1000",
            "creationTimestamp": format_time(created).replace(".000Z", "Z"),
            "annotations": {"storage.alpha.kubernetes.io/migrated-plugins": MIGRATED_PLUGINS, **annotations},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": _uid("node", node)}],
        },
        "spec": {"drivers": entries},
    }


def _apply_counts(obj: dict[str, Any], node: str, drivers: Mapping[str, Any]) -> dict[str, Any]:
    """kubelet's write: each listed driver removed and re-appended with its new count (absent: removed)."""
    new = copy.deepcopy(obj)
    spec = new.setdefault("spec", {})
    current = [d for d in (spec.get("drivers") or []) if isinstance(d, dict)]
    for driver, raw in drivers.items():
        count = _count(raw)
        previous = next((d for d in current if d.get("name") == driver), None)
        current = [d for d in current if d.get("name") != driver]
        if count == ABSENT:
            continue
        entry = copy.deepcopy(previous) if previous is not None else _driver_entry(node, driver, None)
        if count is None:
            entry.pop("allocatable", None)
        else:
            entry["allocatable"] = {"count": count}
        current.append(entry)
    spec["drivers"] = current
    return new


def _set_annotations(obj: dict[str, Any], values: Mapping[str, str | None]) -> dict[str, Any]:
    new = copy.deepcopy(obj)
    annotations = new.setdefault("metadata", {}).setdefault("annotations", {})
    for key, value in values.items():
        if value is None:
            annotations.pop(key, None)
        else:
            annotations[key] = value
    if not annotations:
        new["metadata"].pop("annotations")
    return new


def _counts_of(obj: Mapping[str, Any] | None) -> dict[str, int | None]:
    if obj is None:
        return {}
    out: dict[str, int | None] = {}
    for d in (obj.get("spec") or {}).get("drivers") or []:
        if isinstance(d, Mapping):
            out[str(d.get("name"))] = ((d.get("allocatable") or {}) or {}).get("count")
    return out


def _show(value: Any) -> str:
    if value is None:
        return UNBOUNDED
    return str(value)


# -- running ----------------------------------------------------------------------------------------------------


class _Case:
    """The working set of one running case: stored objects, cluster facts, budget, clock."""

    def __init__(self, doc: Mapping[str, Any], policy: Policy, start: datetime, source: str, where: str) -> None:
        self.doc = doc
        self.policy = policy
        self.start = start
        self.source = source
        self.where = where
        self.keys = StateKeys([TEST_KEY])
        cluster_doc = doc.get("cluster") or {}
        self.cluster = StaticClusterView(
            driver_periods={k: float(v) for k, v in (cluster_doc.get("driverPeriods") or {}).items()},
            known_attach_errors=bool(cluster_doc.get("attachErrorsKnown", True)),
        )
        cfg = policy.cluster_budget
        self.budget = IncreaseBudget(cfg.increases_per_second, cfg.burst) if cfg else None
        self.objects: dict[str, dict[str, Any] | None] = {}
        for node, raw in (doc.get("nodes") or {}).items():
            spec = raw or {}
            self._apply_node_facts(node, spec, start, json_path(("nodes", node), where))
            if not spec.get("exists", True):
                self.objects[node] = None
                continue
            if "object" in spec:
                obj = copy.deepcopy(spec["object"])
            else:
                obj = build_csinode(node, spec.get("drivers") or {}, spec.get("annotations") or {}, start)
            self.objects[node] = obj
            if spec.get("driverVersions"):
                self._publish_versions(node, spec["driverVersions"])

    # facts ------------------------------------------------------------------------------------------------------
    def _apply_node_facts(self, node: str, facts: Mapping[str, Any], now: datetime, where: str) -> None:
        info = self.cluster.nodes.get(node)
        if "labels" in facts:
            if facts["labels"] is None:
                self.cluster.nodes.pop(node, None)
                info = None
            else:
                info = dict(info or {})
                info["labels"] = dict(facts["labels"])
                self.cluster.nodes[node] = info
        if "kubeletVersion" in facts:
            info = dict(info or {"labels": {}})
            info["kubeletVersion"] = facts["kubeletVersion"]
            self.cluster.nodes[node] = info
        for driver, period in (facts.get("driverPeriods") or {}).items():
            self.cluster.driver_periods[driver] = float(period)
        for i, err in enumerate(facts.get("attachErrors") or ()):
            at = now - timedelta(seconds=parse_duration(err.get("ago", 0)))
            self._add_error(node, err["driver"], err.get("code", 8), at, err.get("volumeAttachment", ""),
                            err.get("message", ""), f"{where}.attachErrors[{i}]")
        for driver in facts.get("resourceExhausted") or ():
            self._add_error(node, driver, 8, now, "", "rpc error: code = ResourceExhausted", where)

    def _add_error(self, node: str, driver: str, code: int | None, at: datetime, va: str, message: str,
                   where: str) -> None:
        key = (node, driver)
        errors = self.cluster.attach_error_list.setdefault(key, [])
        name = va or f"csi-{uuid.uuid5(uuid.NAMESPACE_URL, f'{node}/{driver}/{len(errors)}').hex[:40]}"
        errors.append(AttachError(code=code, time=at, volume_attachment=name,
                                  message=message or f"attach failed with gRPC code {code}"))

    def _publish_versions(self, node: str, versions: Mapping[str, str]) -> None:
        """A driver's version on the node: the driver-versions annotation (out of band) and its node pod."""
        self.cluster.driver_versions.setdefault(node, {}).update(versions)
        obj = self.objects.get(node)
        if obj is None:
            return
        by_annotation: dict[str, dict[str, str]] = {}
        for driver, version in versions.items():
            source = self.policy.for_driver(driver).version_source
            by_annotation.setdefault(source.annotation, {})[driver] = version
        for annotation, values in by_annotation.items():
            assert obj is not None
            raw = ((obj.get("metadata") or {}).get("annotations") or {}).get(annotation)
            try:
                current = json.loads(raw) if raw else {}
            except (ValueError, RecursionError):
                current = {}
            if not isinstance(current, dict):
                current = {}
            current.update(values)
            self.objects[node] = _set_annotations(obj, {annotation: json.dumps(current, sort_keys=True)})
            obj = self.objects[node]

    # steps ------------------------------------------------------------------------------------------------------
    def _node_of(self, step: Mapping[str, Any], where: str) -> str:
        if "node" in step:
            node = str(step["node"])
            if node not in self.objects:
                raise PolicyTestError(self.source, f"{where}.node", f"node {node!r} is not declared under nodes")
            return node
        if len(self.objects) != 1:
            raise PolicyTestError(self.source, where, "the case has several nodes: name the step's node")
        return next(iter(self.objects))

    def _writer(self, step: Mapping[str, Any], node: str) -> tuple[str, tuple[str, ...]]:
        user = str(step.get("user", KUBELET))
        if user == KUBELET:
            username = f"system:node:{node}"
        elif user.startswith(KUBELET + ":"):
            username = f"system:node:{user[len(KUBELET) + 1:]}"
        else:
            username = user
        if "groups" in step:
            return username, tuple(step["groups"])
        return username, NODE_GROUPS if username.startswith("system:node:") else USER_GROUPS

    @staticmethod
    def _justification(entries: Sequence[Mapping[str, Any]], now: datetime) -> str:
        """The annotation value; ``expires`` is a time or a duration from the step (``2h``)."""
        out = []
        for e in entries:
            expires = e["expires"]
            if isinstance(expires, int | float) or re.fullmatch(DURATION_PATTERN, str(expires)):
                when = now + timedelta(seconds=parse_duration(expires))
            else:
                when = parse_time(str(expires))
            out.append({
                "driver": e["driver"],
                "reason": e.get("reason", "policy test"),
                "minCount": e["minCount"],
                "maxCount": e["maxCount"],
                "expires": format_time(when).replace(".000Z", "Z"),
                "ticket": e.get("ticket", "TEST-1"),
            })
        return json.dumps(out)

    def _leader_pass(self, now: datetime) -> None:
        """The audit leader's brake decision at ``now`` (:func:`webhook.admission.brake.decide_brakes`), as the
        guard takes it at the start of every audit pass: over every stored CSINode's verified state and the
        case's attach errors. The brakes it records are what the step's write is judged with."""
        states = []
        for node, obj in self.objects.items():
            meta = (obj or {}).get("metadata") or {}
            raw = (meta.get("annotations") or {}).get(STATE_ANNOTATION)
            decoded = decode_state(raw, str(meta.get("uid") or ""), self.keys) if raw is not None else None
            states.append((node, decoded.state if decoded is not None else None))
        self.cluster.brakes = decide_brakes(
            self.policy.brake, self.cluster.brakes, states, self.cluster.attach_errors, now
        )

    def run_step(self, index: int, step: Mapping[str, Any], offset: float, where: str) -> StepResult:
        now = self.start + timedelta(seconds=offset)
        node = self._node_of(step, where)
        self._apply_node_facts(node, step, now, where)
        if step.get("driverVersions"):
            self._publish_versions(node, step["driverVersions"])
        self._leader_pass(now)
        stored = self.objects[node]
        operation = str(step.get("operation", "UPDATE"))
        writes = any(k in step for k in ("drivers", "annotations", "justification", "object")) or operation != "UPDATE"
        name = str(step.get("name", ""))
        if not writes:
            finals = {k: v for k, v in _counts_of(stored).items()}
            failures = self._check(step.get("expect") or {}, None, stored, now, where)
            return StepResult(index, name, offset, node, "(cluster facts only)", None, (), finals, tuple(failures))
        username, groups = self._writer(step, node)
        new: dict[str, Any] | None
        if operation == "DELETE":
            if stored is None:
                raise PolicyTestError(self.source, where, f"DELETE of {node}, whose CSINode does not exist")
            new = None
        elif "object" in step:
            new = copy.deepcopy(step["object"])
        else:
            if operation == "CREATE":
                if stored is not None:
                    raise PolicyTestError(self.source, where, f"CREATE of {node}, whose CSINode already exists")
                base = build_csinode(node, {}, {}, now)
            else:
                if stored is None:
                    raise PolicyTestError(self.source, where, f"UPDATE of {node}, whose CSINode does not exist "
                                          "(declare it under nodes, or CREATE it first)")
                base = stored
            new = _apply_counts(base, node, step.get("drivers") or {})
            annotations: dict[str, str | None] = dict(step.get("annotations") or {})
            if "justification" in step:
                value = step["justification"]
                annotations[JUSTIFICATION_ANNOTATION] = None if value is None else self._justification(value, now)
            if annotations:
                new = _set_annotations(new, annotations)
        old = None if operation == "CREATE" else stored
        outcome = admit_write(
            old,
            new,
            policy=self.policy,
            cluster=self.cluster,
            keys=self.keys,
            now=now,
            uid=_uid("request", self.doc["name"], str(index)),
            username=username,
            groups=groups,
            operation=operation,
            dry_run=bool(step.get("dryRun", False)),
            budget=self.budget,
        )
        self.objects[node] = outcome.stored
        failures = self._check(step.get("expect") or {}, outcome, outcome.stored, now, where)
        lines: list[str] = []
        if outcome.mutate is not None:
            lines += explain(outcome.mutate)
        if outcome.validate is not None and outcome.validate.fired_rules:
            lines += [f"/validate: {line}" for line in explain(outcome.validate) if "violation" in line]
        return StepResult(
            index=index,
            name=name,
            offset=offset,
            node=node,
            summary=self._summary(operation, old, new, username, bool(step.get("dryRun", False))),
            decision=outcome.decision.value,
            fired=outcome.fired_rules,
            finals=dict(_counts_of(outcome.stored)),
            failures=tuple(failures),
            explanation=tuple(lines),
            warnings=outcome.warnings,
            message=outcome.message,
        )

    @staticmethod
    def _summary(operation: str, old: Mapping[str, Any] | None, new: Mapping[str, Any] | None, user: str,
                 dry_run: bool) -> str:
        before, after = _counts_of(old), _counts_of(new)
        parts = []
        for driver in list(dict.fromkeys([*before, *after])):
            if driver not in after:
                parts.append(f"{driver} removed")
            elif driver not in before:
                parts.append(f"{driver} registered ({_show(after[driver])})")
            elif before[driver] != after[driver]:
                parts.append(f"{driver} {_show(before[driver])} -> {_show(after[driver])}")
        old_ann = ((old or {}).get("metadata") or {}).get("annotations") or {}
        new_ann = ((new or {}).get("metadata") or {}).get("annotations") or {}
        for key in sorted(set(old_ann) | set(new_ann)):
            if key != STATE_ANNOTATION and old_ann.get(key) != new_ann.get(key):
                parts.append(f"annotation {key} {'removed' if key not in new_ann else 'set'}")
        what = ", ".join(parts) or "no count change"
        return f"{operation} {what} by {user}{' (dry run)' if dry_run else ''}"

    def _check(self, expect: Mapping[str, Any], outcome: WriteOutcome | None, stored: Mapping[str, Any] | None,
               now: datetime, where: str) -> list[str]:
        failures: list[str] = []
        if outcome is None:
            for key in ("decision", "allowed", "called", "rules", "written", "warnings", "message"):
                if key in expect:
                    raise PolicyTestError(
                        self.source,
                        f"{where}.expect.{key}",
                        "a step without a write has no decision; expect only final, state and brake",
                    )
        else:
            if "decision" in expect and expect["decision"] != outcome.decision.value:
                failures.append(f"decision: expected {expect['decision']}, got {outcome.decision.value}")
            if "allowed" in expect and expect["allowed"] != outcome.allowed:
                failures.append(f"allowed: expected {str(expect['allowed']).lower()}, got "
                                f"{str(outcome.allowed).lower()}")
            if "called" in expect and expect["called"] != outcome.called:
                failures.append(f"called: expected {str(expect['called']).lower()}, got "
                                f"{str(outcome.called).lower()} (matchConditions)")
            if "rules" in expect:
                wanted, fired = list(expect["rules"]), list(outcome.fired_rules)
                if sorted(set(wanted)) != sorted(set(fired)):
                    missing = [r for r in wanted if r not in fired]
                    extra = [r for r in fired if r not in wanted]
                    diff = " ".join([*(f"-{r}" for r in missing), *(f"+{r}" for r in extra)])
                    failures.append(f"rules: expected [{', '.join(wanted)}], got [{', '.join(fired)}]  ({diff})")
            if "written" in expect and expect["written"] != outcome.written:
                failures.append(f"written: expected {str(expect['written']).lower()}, got "
                                f"{str(outcome.written).lower()}")
            for part in expect.get("warnings") or ():
                if not any(part in w for w in outcome.warnings):
                    shown = "; ".join(outcome.warnings) or "(none)"
                    failures.append(f"warnings: expected one containing {part!r}, got: {shown}")
            if expect.get("noWarnings") and outcome.warnings:
                failures.append(f"warnings: expected none, got: {'; '.join(outcome.warnings)}")
            for part in expect.get("message") or ():
                if part not in outcome.message:
                    failures.append(f"message: expected it to contain {part!r}, got: {outcome.message or '(none)'}")
        counts = _counts_of(stored)
        for driver, raw in (expect.get("final") or {}).items():
            want = _count(raw)
            stored_count: int | str | None = counts.get(driver, ABSENT)
            if want != stored_count:
                failures.append(f"final {driver}: expected {_show(want)}, got {_show(stored_count)}")
        for driver, engaged in (expect.get("brake") or {}).items():
            brake = self.cluster.brake(driver)
            if (brake is not None) != engaged:
                got = f"engaged at {format_time(brake.engaged_at)}" if brake is not None else "not engaged"
                failures.append(f"brake {driver}: expected {'engaged' if engaged else 'not engaged'}, got {got}")
        state_expect = expect.get("state") or {}
        approvals = expect.get("approvals")
        if state_expect or approvals is not None:
            failures += self._check_state(state_expect, approvals, stored, now)
        return failures

    def _check_state(self, expect: Mapping[str, Any], approvals: int | None, stored: Mapping[str, Any] | None,
                     now: datetime) -> list[str]:
        meta = (stored or {}).get("metadata") or {}
        raw = (meta.get("annotations") or {}).get(STATE_ANNOTATION)
        decoded = decode_state(raw, str(meta.get("uid") or ""), self.keys)
        if decoded.state is None:
            problem = decoded.problem.value if decoded.problem else "missing"
            return [f"state: expected a guard state, got none ({problem})"]
        failures: list[str] = []
        state = decoded.state
        if approvals is not None and len(state.approvals) != approvals:
            failures.append(f"state approvals: expected {approvals}, got {len(state.approvals)}")
        for driver, want in expect.items():
            entry = state.entries.get(driver)
            if entry is None:
                failures.append(f"state {driver}: expected an entry, got none")
                continue
            if "count" in want and _count(want["count"]) != entry.count:
                failures.append(f"state {driver} count: expected {_show(_count(want['count']))}, "
                                f"got {_show(entry.count)}")
            if "frozen" in want:
                frozen = entry.frozen_until is not None and entry.frozen_until > now
                if frozen != want["frozen"]:
                    until = format_time(entry.frozen_until) if entry.frozen_until else "never"
                    failures.append(f"state {driver} frozen: expected {str(want['frozen']).lower()}, got "
                                    f"{str(frozen).lower()} (frozen until {until})")
            if "correction" in want:
                basis = entry.correction.basis if entry.correction else None
                if basis != want["correction"]:
                    failures.append(f"state {driver} correction: expected {want['correction'] or 'none'}, "
                                    f"got {basis or 'none'}")
            if "raised" in want:
                before = entry.raised.before if entry.raised is not None else None
                if before != want["raised"]:
                    failures.append(f"state {driver} raised: expected from {want['raised']}, got from {before}")
            if "writerVersion" in want and want["writerVersion"] != entry.writer_version:
                failures.append(f"state {driver} writerVersion: expected {want['writerVersion']}, "
                                f"got {entry.writer_version}")
        return failures

    def run(self) -> CaseResult:
        began = time.perf_counter()
        results: list[StepResult] = []
        offset = 0.0
        for i, step in enumerate(self.doc["steps"]):
            where = f"{self.where}.steps[{i}]"
            if "at" in step:
                offset = parse_duration(step["at"])
            elif "after" in step:
                offset += parse_duration(step["after"])
            try:
                results.append(self.run_step(i + 1, step, offset, where))
            except PolicyTestError as exc:
                return CaseResult(self.doc["name"], tuple(results), time.perf_counter() - began, str(exc))
        return CaseResult(self.doc["name"], tuple(results), time.perf_counter() - began)


def run_cases(doc: Mapping[str, Any], policy: Policy, source: str = "<test>") -> list[CaseResult]:
    """Run every case of a validated test document against ``policy``."""
    start = parse_start(str(doc.get("start", DEFAULT_START)), source, "$.start")
    results = []
    for i, case in enumerate(doc["cases"]):
        where = f"$.cases[{i}]"
        case_start = parse_start(str(case["start"]), source, f"{where}.start") if "start" in case else start
        try:
            results.append(_Case(case, policy, case_start, source, where).run())
        except PolicyTestError as exc:
            results.append(CaseResult(case["name"], (), 0.0, str(exc)))
    return results


def run_test_file(path: Path, policy_path: Path | None = None) -> FileResult:
    """Load ``path`` and its policy (``policy_path`` overrides the file's ``policy``), run every case."""
    try:
        doc = load_test_file(path)
    except PolicyTestError as exc:
        return FileResult(str(path), error=str(exc))
    if policy_path is None and doc.get("policy"):
        policy_path = Path(os.path.normpath(path.parent / str(doc["policy"])))
    try:
        policy = load_policy(policy_path)
    except PolicyError as exc:
        return FileResult(str(path), error=f"policy refused: {exc}")
    return FileResult(
        path=str(path),
        cases=tuple(run_cases(doc, policy, str(path))),
        policy_source=policy.source,
        policy_hash=policy.hash,
    )
