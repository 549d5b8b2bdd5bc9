"""Replay a Kubernetes apiserver audit log through a policy: what would the guard have done?

Input: JSON lines of ``audit.k8s.io/v1`` ``Event`` (plain or gzip, any size). The replay picks the
``ResponseComplete`` events of ``csinodes`` (create, update, patch, delete) and judges every update and patch with
the event's ``requestReceivedTimestamp`` as the clock and its ``user`` (or ``impersonatedUser``) as the writer.

What it needs from the log:

- **Objects.** The previous version of a CSINode is rebuilt from the earlier events: the ``responseObject`` where
  present (``RequestResponse`` level), else the last ``requestObject`` (``Request`` level). An update's new object
  is its ``requestObject``; a patch's is its ``responseObject``, or the ``requestObject`` applied to the previous
  version (a JSON patch, or a merge patch whose ``spec.drivers`` are merged by name as a strategic merge patch
  does). ``Metadata``-level events carry no objects: they are counted as not judgeable, and the object's version
  is forgotten (the next event cannot be judged either, it seeds the object again).
- **The guard's memory.** The counts follow the log (what really happened); the guard's signed state follows the
  replay: each judged write sees the state the guard would have written on the previous one, signed with a key of
  the replay. Any real ``csinode-guard.io/state`` in the log is replaced. So rate limits, corrections and
  freezes work as if the guard had been installed, while every write is judged against what really was stored.
- **Cluster facts** come from the same log when it has them: Node labels and kubelet version (``nodes`` events
  with objects), CSIDriver ``nodeAllocatableUpdatePeriodSeconds`` (``csidrivers``), and VolumeAttachment attach
  errors with their gRPC code (``volumeattachments``, ``status.attachError.errorCode``; 8 = ResourceExhausted).
  ``--cluster-facts`` adds facts the log lacks. Attach errors are *unknown* until the first VolumeAttachment
  event, as for a guard whose cache has not synced. A ``pod`` version source is not replayed (no pod events).
- **The brake** (``spec.brake``): before every judged write, at its time, the audit leader's decision
  (:func:`webhook.admission.brake.decide_brakes`) over the replayed states (the increases the guard would have
  admitted) and the attach errors logged so far; the write is judged with the brakes it records, the summary lists
  the brakes that engaged or released and ``audit_sink`` gets the leader's records. The guard decides at the start
  of every audit pass, so a live guard may engage up to one audit interval later than the replay.

Order: audit backends write an event when its stage completes, so ``requestReceivedTimestamp`` order differs from
line order by up to the longest request. Files are merged line by line in requestReceivedTimestamp order (rotated
files one after the other, overlapping files interleaved), and within the stream a **bounded reorder buffer** (a
heap) holds the relevant events until the newest time seen is ``reorder_window`` seconds past them (default 5 min;
at most ``max_buffered`` events). An event older than one already replayed is replayed at once and counted as late.
This keeps memory bounded by the window, not the file, which an external sort would not need but which would cost a
second pass and temporary disk the size of the log.

Duplicates: an event whose auditID and stage were already seen among the last ``max_buffered`` events (the same
log given twice, a file and its copy, overlapping rotations) is counted as a duplicate and skipped, so nothing is
judged or counted twice. The summary accounts for every distinct audit event: skipped (other resources, other
stages, reads), cluster facts (``nodes``, ``csidrivers``, ``volumeattachments`` events), or CSINode writes.

Memory is constant in the size of the log: lines are streamed (gzip included); only the last version of each
CSINode (without ``managedFields``), the facts per node and driver, and counters per node, driver and minute are
kept. Lines are parsed as JSON only when they mention a resource of interest; any other line is only checked to
look like a JSON object. A line that is not JSON (a truncated last line included) is reported with its file and
line number and skipped; a truncated gzip stream ends that file with a report. Nothing in the input is fatal.

The files are read by :mod:`webhook.simulation.replay_input`; the rows, problems and summary are
:mod:`webhook.simulation.replay_results`. This module judges the events.
"""

from __future__ import annotations

import copy
import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import jsonpatch

from webhook.admission.audit_records import build_records
from webhook.admission.brake import brake_audit_record, decide_brakes
from webhook.admission.budget import IncreaseBudget
from webhook.admission.cluster import AttachError, StaticClusterView
from webhook.admission.csinode import format_count
from webhook.admission.evaluation import AdmissionDecision, Mode
from webhook.admission.policy import Policy
from webhook.admission.state import STATE_ANNOTATION, GuardState, StateKeys, decode_state, format_time, parse_time
from webhook.simulation.chain import admit_write
from webhook.simulation.replay_input import Progress, order_files, scan_lines
from webhook.simulation.replay_results import FACT_RESOURCES, Problem, Row, Summary

JUDGED_STAGES = ("ResponseComplete", "Panic")
REPLAY_KEY = b"csinode-guard replay state key 0"


def _strip(obj: Any) -> Any:
    if isinstance(obj, dict):
        meta = obj.get("metadata")
        if isinstance(meta, dict) and "managedFields" in meta:
            obj = dict(obj)
            obj["metadata"] = {k: v for k, v in meta.items() if k != "managedFields"}
    return obj


@dataclass(order=True)
class _Queued:
    time: str
    seq: int
    event: dict[str, Any] = field(compare=False)
    source: str = field(compare=False, default="")
    line: int = field(compare=False, default=0)


def _event_time(event: Mapping[str, Any]) -> datetime | None:
    text = event.get("requestReceivedTimestamp") or event.get("stageTimestamp")
    if not isinstance(text, str):
        return None
    try:
        return parse_time(text)
    except ValueError:
        return None


# -- replaying --------------------------------------------------------------------------------------------------


def _merge(base: Any, patch: Any) -> Any:
    """JSON merge patch, with ``spec.drivers`` merged by name (CSINodeSpec's patchMergeKey)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base) if isinstance(base, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        if value is None:
            out.pop(key, None)
        elif key == "drivers" and isinstance(value, list) and isinstance(out.get(key), list):
            merged = {d.get("name"): d for d in out[key] if isinstance(d, dict)}
            order = [d.get("name") for d in out[key] if isinstance(d, dict)]
            for entry in value:
                if not isinstance(entry, dict):
                    continue
                name = entry.get("name")
                if entry.get("$patch") == "delete":
                    merged.pop(name, None)
                    continue
                merged[name] = _merge(merged.get(name, {}), entry)
                if name not in order:
                    order.append(name)
            out[key] = [merged[n] for n in order if n in merged]
        else:
            out[key] = _merge(out.get(key), value)
    return out


def _with_state(obj: Mapping[str, Any], state: str | None) -> dict[str, Any]:
    out = copy.deepcopy(dict(obj))
    meta = out.setdefault("metadata", {})
    annotations = dict(meta.get("annotations") or {})
    annotations.pop(STATE_ANNOTATION, None)
    if state is not None:
        annotations[STATE_ANNOTATION] = state
    if annotations:
        meta["annotations"] = annotations
    else:
        meta.pop("annotations", None)
    return out


def _state_of(obj: Mapping[str, Any] | None) -> str | None:
    annotations = ((obj or {}).get("metadata") or {}).get("annotations") or {}
    value = annotations.get(STATE_ANNOTATION)
    return str(value) if value is not None else None


class Replayer:
    """Judges audit events one by one (in time order); ``on_row`` gets every :class:`Row`.

    ``audit_sink`` (optional) gets the guard audit records the server would have written (``audit`` commands
    read them). ``cluster`` starts the facts (``--cluster-facts``); the log adds to them.
    """

    def __init__(
        self,
        policy: Policy,
        on_row: Callable[[Row], None],
        *,
        cluster: StaticClusterView | None = None,
        audit_sink: Callable[[list[dict[str, Any]]], None] | None = None,
        summary: Summary | None = None,
    ) -> None:
        self.policy = policy
        self.on_row = on_row
        self.audit_sink = audit_sink
        self.summary = summary or Summary()
        self.keys = StateKeys([REPLAY_KEY])
        self.cluster = cluster or StaticClusterView()
        if cluster is None:
            self.cluster.known_attach_errors = False
        cfg = policy.cluster_budget
        self.budget = IncreaseBudget(cfg.increases_per_second, cfg.burst) if cfg else None
        self.objects: dict[str, dict[str, Any]] = {}
        self.states: dict[str, str] = {}
        self.raised: dict[str, GuardState] = {}
        """The replayed states that record an admitted increase (``raised``): the brake's evidence."""

    # facts ------------------------------------------------------------------------------------------------------
    def _node_facts(self, event: Mapping[str, Any]) -> None:
        obj = event.get("responseObject")
        if not isinstance(obj, dict) and event.get("verb") in ("create", "update"):
            obj = event.get("requestObject")
        if not isinstance(obj, dict) or obj.get("kind") != "Node":
            return
        meta = obj.get("metadata") or {}
        name = meta.get("name") or (event.get("objectRef") or {}).get("name")
        if not name:
            return
        info = dict(self.cluster.nodes.get(name) or {})
        info["labels"] = dict(meta.get("labels") or {})
        version = ((obj.get("status") or {}).get("nodeInfo") or {}).get("kubeletVersion")
        if version:
            info["kubeletVersion"] = version
        self.cluster.nodes[str(name)] = info

    def _csidriver_facts(self, event: Mapping[str, Any]) -> None:
        obj = event.get("responseObject") or event.get("requestObject")
        if not isinstance(obj, dict) or obj.get("kind") != "CSIDriver":
            return
        name = (obj.get("metadata") or {}).get("name")
        period = (obj.get("spec") or {}).get("nodeAllocatableUpdatePeriodSeconds")
        if name and isinstance(period, int | float):
            self.cluster.driver_periods[str(name)] = float(period)
        elif name:
            self.cluster.driver_periods.pop(str(name), None)

    def _attach_facts(self, event: Mapping[str, Any], now: datetime) -> None:
        self.cluster.known_attach_errors = True
        obj = event.get("responseObject")
        if not isinstance(obj, dict):
            obj = event.get("requestObject") if event.get("verb") == "update" else None
        if not isinstance(obj, dict) or obj.get("kind") != "VolumeAttachment":
            return
        spec = obj.get("spec") or {}
        error = (obj.get("status") or {}).get("attachError")
        node, driver = spec.get("nodeName"), spec.get("attacher")
        if not isinstance(error, dict) or not node or not driver:
            return
        try:
            when = parse_time(str(error.get("time"))) if error.get("time") else now
        except ValueError:
            when = now
        code = error.get("errorCode")
        name = str((obj.get("metadata") or {}).get("name") or "")
        key = (str(node), str(driver))
        kept_for = max(self.policy.evidence_within, self.policy.brake.lookback, self.policy.brake.quiet_period)
        horizon = now - timedelta(seconds=kept_for + 3600)
        kept = [e for e in self.cluster.attach_error_list.get(key, []) if e.time >= horizon]
        if not any(e.volume_attachment == name and e.time == when for e in kept):
            kept.append(AttachError(code=int(code) if isinstance(code, int) else None, time=when,
                                    volume_attachment=name, message=str(error.get("message") or "")))
        self.cluster.attach_error_list[key] = kept

    # csinodes ---------------------------------------------------------------------------------------------------
    def process(self, event: Mapping[str, Any]) -> None:
        """Replay one audit event (already known to be a ``ResponseComplete`` event)."""
        ref = event.get("objectRef") or {}
        resource = ref.get("resource")
        now = _event_time(event)
        if now is None:
            self.summary.unreadable += 1
            return
        if resource in FACT_RESOURCES and (resource != "nodes" or not ref.get("apiGroup")):
            self.summary.cluster_facts[resource] += 1
            if event.get("level") in ("Request", "RequestResponse"):
                self.summary.fact_objects[resource] += 1
        if resource == "nodes" and not ref.get("apiGroup"):
            self._node_facts(event)
        elif resource == "csidrivers":
            self._csidriver_facts(event)
        elif resource == "volumeattachments":
            self._attach_facts(event, now)
            self._leader_pass(now)  # the evidence as it comes: "would the brake have engaged" needs no later write
        elif resource == "csinodes" and not ref.get("subresource"):
            self._csinode(event, now)
        else:  # another API group's "nodes", a subresource
            self.summary.other_resources += 1

    def _csinode(self, event: Mapping[str, Any], now: datetime) -> None:
        verb = str(event.get("verb") or "")
        if verb not in ("create", "update", "patch", "delete"):
            self.summary.reads += 1
            return
        self.summary.csinode_writes += 1
        name = str((event.get("objectRef") or {}).get("name") or "")
        if not name:  # a create's objectRef may lack the name; the object has it
            for key in ("responseObject", "requestObject"):
                obj = event.get(key)
                if isinstance(obj, dict) and (obj.get("metadata") or {}).get("name"):
                    name = str(obj["metadata"]["name"])
                    break
        code = int((event.get("responseStatus") or {}).get("code") or 200)
        succeeded = 200 <= code < 300
        dry_run = "dryRun=All" in str(event.get("requestURI") or "")
        persisted = succeeded and not dry_run
        level = event.get("level")
        if level not in ("Request", "RequestResponse"):
            self.summary.metadata_level += 1
            if persisted:
                self.objects.pop(name, None)
            return
        request_obj = _strip(event.get("requestObject"))
        response_obj = _strip(event.get("responseObject"))
        if verb == "delete":
            self.summary.not_called += 1
            if persisted:
                self.objects.pop(name, None)
                self.states.pop(name, None)
                self.raised.pop(name, None)
            return
        if verb == "create":
            # A CREATE reaches the guard (the never-refused entry): judged on the ceilings, without a state.
            created = response_obj if isinstance(response_obj, dict) else request_obj
            if not isinstance(request_obj, dict):
                self.summary.not_called += 1
            elif not succeeded and code != 403:
                self.summary.failed_in_cluster += 1
            else:
                self._judge(event, name, None, request_obj, verb, now, dry_run, persisted)
            if persisted and isinstance(created, dict):
                self.objects[name] = created
                self.states.pop(name, None)
                self.raised.pop(name, None)
            return
        old = self.objects.get(name)
        new: Any = None
        if verb == "update":
            new = request_obj
        elif isinstance(response_obj, dict) and response_obj.get("kind") == "CSINode":
            new = response_obj
        elif old is not None and isinstance(request_obj, list):
            try:
                new = jsonpatch.apply_patch(copy.deepcopy(old), request_obj)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, TypeError, ValueError):
                new = None
        elif old is not None and isinstance(request_obj, dict):
            new = _merge(old, request_obj)
        if not isinstance(new, dict):
            self.summary.unreadable += 1
            if persisted:
                self.objects.pop(name, None)
            return
        stored_after = response_obj if isinstance(response_obj, dict) else new
        if old is None:
            self.summary.no_previous_version += 1
            if persisted:
                self.objects[name] = stored_after
            return
        if not succeeded and code != 403:
            self.summary.failed_in_cluster += 1
            return
        self._judge(event, name, old, new, verb, now, dry_run, persisted)
        if persisted:
            self.objects[name] = stored_after

    def _leader_pass(self, now: datetime) -> None:
        """The audit leader's brake decision at ``now`` (:func:`webhook.admission.brake.decide_brakes`) over the
        replayed states (the increases the guard would have admitted) and the log's attach errors, taken before
        every judged write and after every VolumeAttachment event, where the live leader takes it at the start of
        every audit pass (so up to one audit interval later). A brake that engages or releases
        is counted in the summary and written to ``audit_sink`` as the leader's audit record."""
        nodes = set(self.objects) | set(self.raised) | {n for n, _ in self.cluster.attach_error_list}
        current = self.cluster.brakes
        updated = decide_brakes(
            self.policy.brake,
            current,
            [(n, self.raised.get(n)) for n in sorted(nodes)],
            self.cluster.attach_errors,
            now,
        )
        if updated == current:
            return
        self.cluster.brakes = updated
        for driver, brake in sorted(updated.items()):
            before = current.get(driver)
            if before is not None and before.engaged == brake.engaged:
                continue
            self.summary.add_brake(brake, now)
            if self.audit_sink is not None:
                record = brake_audit_record(
                    brake,
                    now=now,
                    policy_hash=self.policy.hash,
                    policy_generation=1,
                    quiet_period=self.policy.brake.quiet_period,
                )
                self.audit_sink([record])

    def _remember_state(self, name: str, stored: Mapping[str, Any] | None, state: str) -> None:
        """Keep the replayed state ``state`` of ``name``, and its verified form when it records an increase."""
        self.states[name] = state
        uid = str(((stored or {}).get("metadata") or {}).get("uid") or "")
        decoded: GuardState | None = decode_state(state, uid, self.keys).state
        if decoded is not None and any(e.raised is not None for e in decoded.entries.values()):
            self.raised[name] = decoded
        else:
            self.raised.pop(name, None)

    def _judge(self, event: Mapping[str, Any], name: str, old: Mapping[str, Any] | None, new: Mapping[str, Any],
               verb: str, now: datetime, dry_run: bool, persisted: bool) -> None:
        """Judge one write through :func:`webhook.simulation.chain.admit_write`; ``old`` None is a CREATE (sent as the
        client sent it: the state model applies to UPDATEs only, a CREATE carries no state of its own). The brakes
        are decided first (:meth:`_leader_pass`)."""
        self._leader_pass(now)
        user = event.get("impersonatedUser") or event.get("user") or {}
        username = str(user.get("username") or "")
        groups = [str(g) for g in user.get("groups") or ()]
        audit_id = str(event.get("auditID") or "")
        state = self.states.get(name)
        old_in = _with_state(old, state) if old is not None else None
        new_in = _with_state(new, state) if old is not None else copy.deepcopy(dict(new))
        outcome = admit_write(
            old_in,
            new_in,
            policy=self.policy,
            cluster=self.cluster,
            keys=self.keys,
            now=now,
            uid=audit_id or f"replay-{self.summary.csinode_writes}",
            username=username,
            groups=groups,
            operation="UPDATE" if old is not None else "CREATE",
            dry_run=dry_run,
            budget=self.budget,
        )
        if not outcome.called:
            self.summary.not_called += 1
            return
        self.summary.judged += 1
        self.summary.by_decision[outcome.decision.value] += 1
        decision: AdmissionDecision | None = outcome.mutate
        if outcome.validate is not None and not outcome.allowed and outcome.validate.fired_rules:
            decision = outcome.validate
        if persisted and outcome.allowed and outcome.written:
            new_state = _state_of(outcome.stored)
            if new_state is not None:
                self._remember_state(name, outcome.stored, new_state)
        if self.audit_sink is not None:
            for mode, d in ((Mode.MUTATE, outcome.mutate), (Mode.VALIDATE, outcome.validate)):
                if d is not None and outcome.request is not None:
                    self.audit_sink(build_records(d, outcome.request, endpoint=mode, now=now,
                                                  policy_hash=self.policy.hash, policy_generation=1,
                                                  latency_seconds=0.0))
        assert decision is not None
        for o in decision.outcomes:
            if o.result == "violation":
                effective = o.effective.value if o.effective else "none"
                self.summary.by_rule.setdefault(o.rule, Counter())[effective] += 1
        time_text = format_time(now)
        message = outcome.message.split("\n")[0] if outcome.message else ""
        changes = decision.changes
        if not changes:
            row = Row(time_text, name, None, None, None, None, outcome.decision.value, outcome.fired_rules,
                      username, verb, audit_id, dry_run, message)
            self.on_row(row)
            return
        for c in changes:
            final = c.final
            registered = c.change.registration and c.change.old is None
            row = Row(
                time=time_text,
                node=name,
                driver=c.change.driver,
                old="registered" if registered else _count(c.before),
                new=_count(c.change.new),
                final=_count(final),
                decision=outcome.decision.value,
                rules=tuple(dict.fromkeys(o.rule for o in decision.outcomes
                                          if o.result == "violation" and o.driver in (c.change.driver, None))),
                user=username,
                verb=verb,
                audit_id=audit_id,
                dry_run=dry_run,
                message=message,
            )
            self.summary.add_row(row)
            self.on_row(row)


def _count(value: int | None) -> int | str:
    return format_count(value) if value is None else value


def replay(
    paths: Sequence[Path],
    policy: Policy,
    on_row: Callable[[Row], None],
    *,
    on_problem: Callable[[Problem], None] | None = None,
    progress: Progress | None = None,
    cluster: StaticClusterView | None = None,
    audit_sink: Callable[[list[dict[str, Any]]], None] | None = None,
    reorder_window: float = 300.0,
    max_buffered: int = 100_000,
) -> Summary:
    """Replay audit log ``paths`` through ``policy``; rows go to ``on_row`` in time order. Returns the summary.

    Never raises for bad input: unreadable files and lines go to ``on_problem`` and the summary.
    """
    unique: dict[Path, Path] = {}
    for p in paths:  # a file given twice is read once
        unique.setdefault(p.resolve(), p)
    paths = list(unique.values())
    summary = Summary(files=[str(p) for p in paths])
    progress = progress or Progress()

    def problem(p: Problem) -> None:
        summary.add_problem(p)
        if on_problem is not None:
            on_problem(p)

    replayer = Replayer(policy, on_row, cluster=cluster, audit_sink=audit_sink, summary=summary)
    heap: list[_Queued] = []
    seq = itertools.count()
    newest = ""
    last_released = ""

    def release(item: _Queued) -> None:
        nonlocal last_released
        if item.time < last_released:
            summary.late += 1
        else:
            last_released = item.time
        replayer.process(item.event)

    def window_edge() -> str:
        try:
            return format_time(parse_time(newest) - timedelta(seconds=reorder_window))
        except ValueError:
            return ""

    recent: dict[int, None] = {}  # (auditID, stage) of the last events, oldest first
    scans = [scan_lines(path, i, summary, progress, problem) for i, path in enumerate(order_files(paths))]
    for item in heapq.merge(*scans):
        if item.key is not None:
            if item.key in recent:
                summary.duplicates += 1
                continue
            recent[item.key] = None
            if len(recent) > max_buffered:
                del recent[next(iter(recent))]
        event = item.event
        if event is None:  # a JSON object line about another resource: counted, not parsed
            summary.events += 1
            summary.other_resources += 1
            continue
        if event.get("stage") not in JUDGED_STAGES:
            summary.events += 1
            summary.other_stages += 1
            continue
        ref = event.get("objectRef") or {}
        if ref.get("resource") not in ("csinodes", *FACT_RESOURCES):
            summary.events += 1
            summary.other_resources += 1
            continue
        when = _event_time(event)
        if when is None:
            problem(Problem(item.source, item.line, "audit event without a usable requestReceivedTimestamp"))
            continue
        summary.events += 1
        stamp = format_time(when)
        for key in ("requestObject", "responseObject"):
            if key in event:
                event[key] = _strip(event[key])
        if summary.first_event is None or stamp < summary.first_event:
            summary.first_event = stamp
        if summary.last_event is None or stamp > summary.last_event:
            summary.last_event = stamp
        if stamp < newest:
            summary.reordered += 1
        newest = max(newest, stamp)
        heapq.heappush(heap, _Queued(stamp, next(seq), event, item.source, item.line))
        edge = window_edge()
        while heap and (heap[0].time <= edge or len(heap) > max_buffered):
            release(heapq.heappop(heap))
    while heap:
        release(heapq.heappop(heap))
    progress.close()
    return summary
