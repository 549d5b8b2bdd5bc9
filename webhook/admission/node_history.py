"""What the guard trusted about a node, kept by node name where only the guard writes: the node's history record.

The signed state on the CSINode (:mod:`webhook.admission.state`) is keyed by the object's UID: a node that deletes
and re-creates its own CSINode (kubelet does so on a Node UID change, kubernetes#137199; a node's credentials
can do it at will) would start from nothing -- no pins, no last accepted counts, no freezes or corrections. So the
audit leader copies the newest verified state it sees on each CSINode into a record of its own, one ConfigMap per
node in the guard's namespace (:mod:`webhook.kube.node_history` writes it; only the guard's ServiceAccount may),
and every replica reads those records through its watch cache (``ClusterView.retained_state``). When a CSINode
carries no usable state (a CREATE, a new UID, a removed or replayed state), classify judges it from the node's
retained history: a registration is then a change from the count before, clamped, never refused.

The record (ConfigMap ``data.record``) binds the node's name to the CSINode UID and the state annotation value the
guard wrote for it (which is itself signed and bound to that UID)::

    {"v": 1, "node": "node-a", "uid": "<CSINode metadata.uid>", "nodeUID": "<Node uid or ''>",
     "state": "<csinode-guard.io/state value>", "savedAt": "2026-12-04T19:00:00.000Z",
     "sig": "<base64url HMAC-SHA256 of the document without sig>"}

Bounded: a record holds one state (itself bounded by the state's own limits), one record per node name, records of
nodes whose CSINode is gone are deleted after :data:`RETENTION_SECONDS`, and at most :data:`MAX_RECORDS` exist (past
that, no new node gets one: its CSINode's own state still applies). Pure: no I/O.
"""

from __future__ import annotations

import hashlib
from typing import Any

from webhook.admission.cluster import RetainedState
from webhook.admission.signed_records import open_record, seal_record
from webhook.admission.state import GuardState, StateKeys, decode_state, format_time, parse_time

HISTORY_LABEL = "csinode-guard.io/node-history"
"""The label (value ``"true"``) on every history ConfigMap: the guard's watch selects by it."""
RECORD_KEY = "record"
NAME_PREFIX = "csinode-guard-history-"
FORMAT_VERSION = 1
RETENTION_SECONDS = 30 * 24 * 3600.0
"""A record of a node with no CSINode is kept 30 days after it was last saved (a node that comes back within that
time is judged from it)."""
MAX_RECORDS = 20_000
"""At most this many records (one per node name): past it, a new node gets none."""
MAX_RECORD_BYTES = 300 * 1024


def history_object_name(node: str) -> str:
    """The ConfigMap name of ``node``'s record: ``csinode-guard-history-<node>``, or with a SHA-256 of the name
    when that would exceed 253 characters (a DNS subdomain, like the node name)."""
    name = NAME_PREFIX + node
    if len(name) <= 253:
        return name
    return NAME_PREFIX + hashlib.sha256(node.encode("utf-8")).hexdigest()


def retained_guard_state(retained: RetainedState, keys: StateKeys) -> GuardState | None:
    """The retained :class:`GuardState` (verified again, for its CSINode UID), None when unusable."""
    return decode_state(retained.state, retained.uid, keys).state


def encode_history(retained: RetainedState, keys: StateKeys) -> str:
    """The signed ``data.record`` value for ``retained`` (deterministic)."""
    doc: dict[str, Any] = {"v": FORMAT_VERSION, "node": retained.node, "uid": retained.uid,
                           "nodeUID": retained.node_uid, "state": retained.state,
                           "savedAt": format_time(retained.saved_at)}
    return seal_record(doc, keys)


HISTORY_FIELDS = frozenset({"v", "node", "uid", "nodeUID", "state", "savedAt"})
"""The fields of a history record besides its signature."""


def decode_history(value: str | None, node: str, keys: StateKeys) -> RetainedState | None:
    """The verified record of ``node``, or None when absent, malformed, too long, for another node, or not signed
    by a state key. Never raises."""
    doc = open_record(value, keys, version=FORMAT_VERSION, fields=HISTORY_FIELDS, max_bytes=MAX_RECORD_BYTES)
    if doc is None or doc["node"] != node:
        return None
    if not all(isinstance(doc[k], str) for k in ("uid", "nodeUID", "state", "savedAt")):
        return None
    try:
        saved = parse_time(doc["savedAt"])
    except ValueError:
        return None
    return RetainedState(node, doc["uid"], doc["nodeUID"], doc["state"], saved)
