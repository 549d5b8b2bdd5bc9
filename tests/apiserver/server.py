"""A threaded HTTP server that speaks the Kubernetes API's JSON wire format, for tests of real API clients.

It is a registry of objects per resource with list (paged), watch (chunked streams of JSON events), get, create,
update (PUT), patch (merge, strategic-as-merge, JSON patch) and delete, a global resourceVersion like etcd's, an
event history per resource for watches that resume from a resourceVersion, and fault injection:

* :meth:`FakeApiServer.inject_gone` -- an ERROR event with a 410 ``Status`` on the open watches (what the
  apiserver sends for "too old resource version"), or an HTTP 410 answer to the next watch request;
* :meth:`FakeApiServer.drop_watches` -- abort open watch connections mid-stream (no terminating chunk);
* :meth:`FakeApiServer.set_offline` -- close every new connection for a resource without an answer;
* :meth:`FakeApiServer.hang` / :meth:`FakeApiServer.release` -- requests for a resource block until released;
* :meth:`FakeApiServer.fail_next` -- answer the next requests with an error ``Status``;
* :meth:`FakeApiServer.compact` -- forget the event history, so a watch from an older resourceVersion gets 410;
* :meth:`FakeApiServer.send_bookmark` / ``bookmark_interval`` -- BOOKMARK events for ``allowWatchBookmarks``.

Every request is recorded (:attr:`FakeApiServer.requests`). Wire semantics follow "Kubernetes API Concepts"
(kubernetes.io/docs/reference/using-api/api-concepts/): list items carry no ``kind``/``apiVersion``; a watch
without ``resourceVersion`` (or ``0``) starts with synthetic ADDED events; a watch with a label or field selector
turns a MODIFIED event into ADDED / DELETED when the object enters / leaves the selection.
"""

from __future__ import annotations

import base64
import bisect
import contextlib
import copy
import dataclasses
import itertools
import json
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from .resources import BUILTIN_RESOURCES, Resource
from .selectors import SelectorError, parse_field_selector, parse_label_selector

JSON = dict[str, Any]

_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


def status_object(code: int, message: str, reason: str | None = None) -> JSON:
    """A ``meta/v1 Status`` of failure."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason or _REASONS.get(code, "Unknown"),
        "code": code,
    }


class ApiError(Exception):
    """An error answered as a ``Status``."""

    def __init__(self, code: int, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.status = status_object(code, message, reason)
        self.code = code


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the server saw it. ``query`` keeps the last value of each parameter; ``headers`` has
    lower-case names; ``body`` is the decoded body of a POST, PUT or PATCH (None until read, or without one)."""

    method: str
    path: str
    query: Mapping[str, str]
    resource: str | None
    namespace: str | None
    name: str | None
    watch: bool
    time: float
    headers: Mapping[str, str] = field(default_factory=dict)
    body: Any = None


@dataclass
class _Event:
    rv: int
    type: str
    obj: JSON
    old: JSON | None = None


@dataclass(eq=False)
class _Watch:
    resource: str
    query: Mapping[str, str]
    gone: bool = False
    drop: bool = False
    bookmark: bool = False
    lines: list[bytes] = field(default_factory=list)


@dataclass
class _Failure:
    code: int
    message: str
    count: int
    watch_only: bool
    method: str | None = None


@dataclass
class _Collection:
    resource: Resource
    objects: dict[tuple[str, str], JSON] = field(default_factory=dict)
    history: list[_Event] = field(default_factory=list)
    compacted_rv: int = 0
    watches: set[_Watch] = field(default_factory=set)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (``null`` deletes)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiError(422, f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def json_patch(document: Any, operations: list[Any]) -> Any:
    """RFC 6902 JSON patch: add, remove, replace, test, move, copy."""
    doc = copy.deepcopy(document)

    def parent(parts: list[str]) -> tuple[Any, str]:
        node = doc
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) else node[part]
        return node, parts[-1]

    def get(parts: list[str]) -> Any:
        node = doc
        for part in parts:
            node = node[int(part)] if isinstance(node, list) else node[part]
        return node

    for op in operations:
        try:
            kind, parts = op["op"], _pointer(op["path"])
            if kind == "test":
                if get(parts) != op["value"]:
                    raise ApiError(422, f"test failed at {op['path']}")
                continue
            if kind in ("move", "copy"):
                value = copy.deepcopy(get(_pointer(op["from"])))
                if kind == "move":
                    node, last = parent(_pointer(op["from"]))
                    del node[int(last) if isinstance(node, list) else last]
                kind = "add"
            else:
                value = op.get("value")
            if not parts:
                doc = value
                continue
            node, last = parent(parts)
            if kind == "add":
                if isinstance(node, list):
                    node.insert(len(node) if last == "-" else int(last), value)
                else:
                    node[last] = value
            elif kind == "replace":
                if isinstance(node, list):
                    node[int(last)] = value
                else:
                    if last not in node:
                        raise ApiError(422, f"replace of missing path {op.get('path')}")
                    node[last] = value
            elif kind == "remove":
                del node[int(last) if isinstance(node, list) else last]
            else:
                raise ApiError(422, f"unknown JSON patch op {kind!r}")
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise ApiError(422, f"JSON patch failed: {exc}") from exc
    return doc


class FakeApiServer:
    """A local Kubernetes API server for tests (HTTP, threaded). Use as a context manager or start()/stop().

    ``token``: the bearer token every request must carry (None: no authentication). ``bookmark_interval``:
    seconds between BOOKMARK events on watches that allow them (None: only :meth:`send_bookmark`).
    ``history_limit``: events kept per resource for resuming watches (None: unbounded until :meth:`compact`).
    """

    def __init__(
        self,
        resources: Iterable[Resource] = BUILTIN_RESOURCES,
        *,
        token: str | None = "test-token",
        bookmark_interval: float | None = None,
        history_limit: int | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        kubernetes_version: str = "v1.35.0",
    ) -> None:
        self.token = token
        self.bookmark_interval = bookmark_interval
        self.history_limit = history_limit
        self.kubernetes_version = kubernetes_version
        self._host, self._port = host, port
        self._cond = threading.Condition()
        self._rv = 1
        self._collections: dict[str, _Collection] = {}
        self._aliases: dict[str, str] = {}
        self._offline: set[str] = set()
        self._hung: set[str] = set()
        self._failures: dict[str, list[_Failure]] = {}
        self._snapshots: OrderedDict[str, tuple[int, list[JSON]]] = OrderedDict()
        self._snapshot_ids = itertools.count(1)
        self._stopping = False
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.requests: list[RecordedRequest] = []
        for resource in resources:
            self.register(resource)

    # --- lifecycle --------------------------------------------------------------------------------------------

    def start(self) -> FakeApiServer:
        """Listen and serve in a background thread."""
        handler = type("Handler", (_Handler,), {"api": self})
        httpd = ThreadingHTTPServer((self._host, self._port), handler)
        httpd.daemon_threads = True
        httpd.block_on_close = False
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; open watches and hanging requests end."""
        with self._cond:
            self._stopping = True
            self._hung.clear()
            self._cond.notify_all()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()

    def __enter__(self) -> FakeApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        """The TCP port served."""
        assert self._httpd is not None, "not started"
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://{self._host}:{self.port}"

    def kubeconfig(self, namespace: str = "default") -> JSON:
        """A kubeconfig (as a dict) for this server."""
        user: JSON = {"token": self.token} if self.token else {}
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": user}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}],
            "current-context": "fake",
            "preferences": {},
        }

    def write_kubeconfig(self, path: str | Path) -> str:
        """Write :meth:`kubeconfig` to ``path`` (JSON is valid YAML) and return the path."""
        Path(path).write_text(json.dumps(self.kubeconfig(), indent=2))
        return str(path)

    # --- registry ---------------------------------------------------------------------------------------------

    def register(self, resource: Resource) -> None:
        """Serve ``resource`` (e.g. a CRD's)."""
        with self._cond:
            self._collections.setdefault(resource.key, _Collection(resource))
            for alias in (resource.plural, resource.key, resource.kind, resource.kind.lower(), *resource.short_names):
                self._aliases.setdefault(alias, resource.key)

    def resource(self, name: str | Resource) -> Resource:
        """A registered resource by plural (``nodes``), ``plural.group``, kind (``Node``) or the Resource itself."""
        return self._collection(name).resource

    def _collection(self, name: str | Resource) -> _Collection:
        key = name.key if isinstance(name, Resource) else self._aliases.get(name, name)
        try:
            return self._collections[key]
        except KeyError:
            raise KeyError(f"resource {name!r} is not registered") from None

    def _find(self, group: str, version: str, plural: str) -> _Collection | None:
        key = f"{plural}.{group}" if group else plural
        collection = self._collections.get(key)
        if collection is None or collection.resource.version != version:
            return None
        return collection

    @property
    def resource_version(self) -> int:
        """The current (latest) resourceVersion."""
        return self._rv

    # --- object operations (also used by the HTTP handlers) ---------------------------------------------------

    def _locate(self, collection: _Collection, obj: JSON, namespace: str | None) -> tuple[str, str]:
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            prefix = meta.get("generateName")
            if not prefix:
                raise ApiError(422, "metadata.name: Required value", "Invalid")
            meta["name"] = prefix + uuid.uuid4().hex[:5]
        if collection.resource.namespaced:
            ns = namespace or meta.get("namespace") or "default"
            if namespace and meta.get("namespace") and meta["namespace"] != namespace:
                raise ApiError(400, "the namespace of the object does not match the namespace on the request")
            meta["namespace"] = ns
        else:
            meta.pop("namespace", None)
            ns = ""
        return ns, str(meta["name"])

    def _append(self, collection: _Collection, event: _Event) -> None:
        collection.history.append(event)
        if self.history_limit is not None and len(collection.history) > self.history_limit:
            dropped = collection.history[: len(collection.history) - self.history_limit]
            del collection.history[: len(dropped)]
            collection.compacted_rv = max(collection.compacted_rv, dropped[-1].rv)
        self._cond.notify_all()

    def create(
        self, resource: str | Resource, obj: JSON, namespace: str | None = None, *, dry_run: bool = False
    ) -> JSON:
        """Create ``obj`` (a copy is stored); 409 AlreadyExists when present. Returns the stored object."""
        collection = self._collection(resource)
        obj = copy.deepcopy(obj)
        with self._cond:
            key = self._locate(collection, obj, namespace)
            if key in collection.objects:
                raise ApiError(409, f'{collection.resource.plural} "{key[1]}" already exists', "AlreadyExists")
            meta = obj["metadata"]
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", _now())
            obj["apiVersion"] = collection.resource.api_version
            obj["kind"] = collection.resource.kind
            if dry_run:
                meta["resourceVersion"] = str(self._rv)
                return copy.deepcopy(obj)
            self._rv += 1
            meta["resourceVersion"] = str(self._rv)
            collection.objects[key] = obj
            self._append(collection, _Event(self._rv, "ADDED", obj))
            return copy.deepcopy(obj)

    def update(
        self, resource: str | Resource, obj: JSON, namespace: str | None = None, *, dry_run: bool = False
    ) -> JSON:
        """Replace an object (PUT). A ``metadata.resourceVersion`` in ``obj`` must match (else 409 Conflict)."""
        collection = self._collection(resource)
        obj = copy.deepcopy(obj)
        with self._cond:
            key = self._locate(collection, obj, namespace)
            current = collection.objects.get(key)
            if current is None:
                raise ApiError(404, f'{collection.resource.plural} "{key[1]}" not found', "NotFound")
            meta = obj["metadata"]
            sent_rv = meta.get("resourceVersion")
            if sent_rv and sent_rv != current["metadata"]["resourceVersion"]:
                raise ApiError(
                    409,
                    f'Operation cannot be fulfilled on {collection.resource.key} "{key[1]}": the object has been'
                    " modified; please apply your changes to the latest version and try again",
                    "Conflict",
                )
            for kept in ("uid", "creationTimestamp"):
                if kept in current["metadata"]:
                    meta[kept] = current["metadata"][kept]
            obj["apiVersion"] = collection.resource.api_version
            obj["kind"] = collection.resource.kind
            if dry_run:
                meta["resourceVersion"] = current["metadata"]["resourceVersion"]
                return copy.deepcopy(obj)
            self._rv += 1
            meta["resourceVersion"] = str(self._rv)
            collection.objects[key] = obj
            self._append(collection, _Event(self._rv, "MODIFIED", obj, current))
            return copy.deepcopy(obj)

    def apply(self, resource: str | Resource, obj: JSON, namespace: str | None = None) -> JSON:
        """Create or replace (ignoring resourceVersion): the test-side way to set an object's state."""
        collection = self._collection(resource)
        obj = copy.deepcopy(obj)
        obj.setdefault("metadata", {}).pop("resourceVersion", None)
        with self._cond:
            key = self._locate(collection, obj, namespace)
            exists = key in collection.objects
        return self.update(resource, obj, namespace) if exists else self.create(resource, obj, namespace)

    def patch(
        self,
        resource: str | Resource,
        name: str,
        patch: Any,
        namespace: str | None = None,
        *,
        content_type: str = "application/merge-patch+json",
        dry_run: bool = False,
    ) -> JSON:
        """Patch an object: merge patch (strategic merge is treated as merge), or JSON patch (a list)."""
        collection = self._collection(resource)
        with self._cond:
            current = self._get_locked(collection, name, namespace)
            if "json-patch" in content_type:
                if not isinstance(patch, list):
                    raise ApiError(400, "a JSON patch must be a list of operations")
                patched = json_patch(current, patch)
            else:
                patched = merge_patch(current, patch)
            patched.setdefault("metadata", {})["name"] = name
            patched["metadata"].pop("resourceVersion", None)
            return self.update(resource, patched, namespace, dry_run=dry_run)

    def delete(
        self, resource: str | Resource, name: str, namespace: str | None = None, *, dry_run: bool = False
    ) -> JSON:
        """Delete an object (404 when absent); returns it as it was deleted."""
        collection = self._collection(resource)
        with self._cond:
            current = self._get_locked(collection, name, namespace)
            key = (current["metadata"].get("namespace", ""), name)
            if dry_run:
                return copy.deepcopy(current)
            del collection.objects[key]
            self._rv += 1
            deleted = copy.deepcopy(current)
            deleted["metadata"]["resourceVersion"] = str(self._rv)
            self._append(collection, _Event(self._rv, "DELETED", deleted, current))
            return copy.deepcopy(deleted)

    def _get_locked(self, collection: _Collection, name: str, namespace: str | None) -> JSON:
        ns = (namespace or "default") if collection.resource.namespaced else ""
        obj = collection.objects.get((ns, name))
        if obj is None:
            raise ApiError(404, f'{collection.resource.plural} "{name}" not found', "NotFound")
        return obj

    def get(self, resource: str | Resource, name: str, namespace: str | None = None) -> JSON | None:
        """A copy of one object, or None."""
        collection = self._collection(resource)
        with self._cond:
            try:
                return copy.deepcopy(self._get_locked(collection, name, namespace))
            except ApiError:
                return None

    def list(self, resource: str | Resource, namespace: str | None = None) -> list[JSON]:
        """Copies of the objects of a resource (in one namespace, or all), ordered by namespace and name."""
        collection = self._collection(resource)
        with self._cond:
            items = [o for k, o in sorted(collection.objects.items()) if namespace is None or k[0] == namespace]
            return copy.deepcopy(items)

    def load(self, objects: Iterable[JSON], *, copy_objects: bool = True) -> int:
        """Create (or replace) many objects at once, each by its ``kind``; returns how many.

        ``copy_objects=False`` stores the dicts as given (fast, for benchmarks); do not modify them afterwards.
        """
        count = 0
        with self._cond:
            for given in objects:
                collection = self._collection(given["kind"])
                obj = copy.deepcopy(given) if copy_objects else given
                key = self._locate(collection, obj, None)
                meta = obj["metadata"]
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("creationTimestamp", _now())
                obj["apiVersion"] = collection.resource.api_version
                self._rv += 1
                meta["resourceVersion"] = str(self._rv)
                old = collection.objects.get(key)
                collection.objects[key] = obj
                self._append(collection, _Event(self._rv, "MODIFIED" if old else "ADDED", obj, old))
                count += 1
        return count

    def load_dir(self, directory: str | Path) -> list[JSON]:
        """Load every ``*.json`` file of ``directory`` (an object, or a ``List`` with ``items``); returns them."""
        objects: list[JSON] = []
        for path in sorted(Path(directory).glob("*.json")):
            data = json.loads(path.read_text())
            objects.extend(data["items"] if data.get("kind", "").endswith("List") and "items" in data else [data])
        self.load(objects)
        return objects

    def compact(self) -> None:
        """Forget every resource's event history (like an etcd compaction): a watch from a resourceVersion older
        than the current one gets an ERROR event with a 410 Status; open continue tokens expire."""
        with self._cond:
            for collection in self._collections.values():
                collection.history.clear()
                collection.compacted_rv = self._rv
            self._snapshots.clear()

    # --- fault injection --------------------------------------------------------------------------------------

    def inject_gone(self, resource: str | Resource, *, via: str = "event") -> None:
        """``via="event"``: every open watch of ``resource`` gets an ERROR event with a 410 Status and ends.
        ``via="http"``: the next watch request is answered HTTP 410."""
        collection = self._collection(resource)
        if via == "http":
            self.fail_next(resource, 410, watch_only=True, message="too old resource version")
            return
        with self._cond:
            for watch in collection.watches:
                watch.gone = True
            self._cond.notify_all()

    def drop_watches(self, resource: str | Resource) -> int:
        """Abort the open watch connections of ``resource`` mid-stream; returns how many."""
        collection = self._collection(resource)
        with self._cond:
            for watch in collection.watches:
                watch.drop = True
            self._cond.notify_all()
            return len(collection.watches)

    def inject_line(self, resource: str | Resource, line: bytes) -> None:
        """Write ``line`` (plus a newline) as is on the open watches of ``resource`` (e.g. a garbled event)."""
        collection = self._collection(resource)
        with self._cond:
            for watch in collection.watches:
                watch.lines.append(line)
            self._cond.notify_all()

    def send_bookmark(self, resource: str | Resource) -> None:
        """Send a BOOKMARK (current resourceVersion) on the open watches that allow bookmarks."""
        collection = self._collection(resource)
        with self._cond:
            for watch in collection.watches:
                watch.bookmark = True
            self._cond.notify_all()

    def set_offline(self, resource: str | Resource, offline: bool = True) -> None:
        """While offline, every request for ``resource`` has its connection closed without an answer."""
        key = self._collection(resource).resource.key
        with self._cond:
            (self._offline.add if offline else self._offline.discard)(key)

    def hang(self, resource: str | Resource) -> None:
        """Requests for ``resource`` block (no answer) until :meth:`release` or :meth:`stop`."""
        key = self._collection(resource).resource.key
        with self._cond:
            self._hung.add(key)

    def release(self, resource: str | Resource) -> None:
        """Let hanging requests for ``resource`` go on."""
        key = self._collection(resource).resource.key
        with self._cond:
            self._hung.discard(key)
            self._cond.notify_all()

    def release_all(self) -> None:
        """Let every hanging request go on."""
        with self._cond:
            self._hung.clear()
            self._cond.notify_all()

    def fail_next(
        self,
        resource: str | Resource,
        code: int,
        *,
        count: int = 1,
        watch_only: bool = False,
        message: str = "injected failure",
        method: str | None = None,
    ) -> None:
        """Answer the next ``count`` requests for ``resource`` (only watches with ``watch_only``, only requests of
        ``method`` such as ``"PUT"`` when given) with ``code``."""
        key = self._collection(resource).resource.key
        with self._cond:
            self._failures.setdefault(key, []).append(_Failure(code, message, count, watch_only, method))

    # --- observation ------------------------------------------------------------------------------------------

    def active_watches(self, resource: str | Resource) -> int:
        """Open watch streams of ``resource``."""
        with self._cond:
            return len(self._collection(resource).watches)

    def wait_for_watches(self, resource: str | Resource, count: int = 1, timeout: float = 5.0) -> bool:
        """Wait until ``resource`` has at least ``count`` open watches."""
        collection = self._collection(resource)
        with self._cond:
            return self._cond.wait_for(lambda: len(collection.watches) >= count, timeout)

    def requests_for(self, resource: str | Resource, *, watch: bool | None = None) -> list[RecordedRequest]:
        """Recorded requests for ``resource`` (only watches / only non-watches when ``watch`` is given)."""
        key = self._collection(resource).resource.key
        with self._cond:
            return [r for r in self.requests if r.resource == key and (watch is None or r.watch == watch)]

    # --- HTTP side --------------------------------------------------------------------------------------------

    def _record(self, request: RecordedRequest) -> None:
        with self._cond:
            self.requests.append(request)

    def _record_body(self, request: RecordedRequest, body: Any) -> None:
        """Replace the recorded ``request`` with a copy that carries its decoded ``body``."""
        with self._cond:
            for index in range(len(self.requests) - 1, -1, -1):
                if self.requests[index] is request:
                    self.requests[index] = dataclasses.replace(request, body=copy.deepcopy(body))
                    return

    def _gate(self, key: str, is_watch: bool, method: str | None = None) -> str | _Failure | None:
        """Apply faults: "offline", a failure to answer, or None. Blocks while the resource hangs."""
        with self._cond:
            while key in self._hung and not self._stopping:
                self._cond.wait(0.1)
            if self._stopping or key in self._offline:
                return "offline"
            for failure in self._failures.get(key, []):
                if (
                    failure.count > 0
                    and (is_watch or not failure.watch_only)
                    and (failure.method is None or failure.method == method)
                ):
                    failure.count -= 1
                    return failure
            return None

    def _list_page(self, collection: _Collection, namespace: str | None, query: Mapping[str, str]) -> JSON:
        resource = collection.resource
        limit = int(query.get("limit") or 0)
        token = query.get("continue")
        if token:
            try:
                state = json.loads(base64.urlsafe_b64decode(token.encode()))
                snapshot_id, offset = str(state["s"]), int(state["o"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ApiError(400, "invalid continue token") from exc
            with self._cond:
                snapshot = self._snapshots.get(snapshot_id)
            if snapshot is None:
                raise ApiError(
                    410,
                    "The provided continue parameter is too old to display a consistent list result. You can start"
                    " a new list without the continue parameter.",
                    "Expired",
                )
            rv, items = snapshot
        else:
            matches = _matcher(namespace, query)
            with self._cond:
                rv = self._rv
                items = [o for _, o in sorted(collection.objects.items()) if matches(o)]
            offset = 0
            snapshot_id = ""
        page = items[offset : offset + limit] if limit > 0 else items[offset:]
        next_offset = offset + len(page)
        meta: JSON = {"resourceVersion": str(rv)}
        if next_offset < len(items):
            if not snapshot_id:
                with self._cond:
                    snapshot_id = str(next(self._snapshot_ids))
                    self._snapshots[snapshot_id] = (rv, items)
                    while len(self._snapshots) > 32:
                        self._snapshots.popitem(last=False)
            meta["continue"] = base64.urlsafe_b64encode(
                json.dumps({"s": snapshot_id, "o": next_offset}).encode()
            ).decode()
            meta["remainingItemCount"] = len(items) - next_offset
        return {
            "kind": f"{resource.kind}List",
            "apiVersion": resource.api_version,
            "metadata": meta,
            "items": [{k: v for k, v in o.items() if k not in ("kind", "apiVersion")} for o in page],
        }

    def _discovery(self, path: str) -> JSON | None:
        resources = [c.resource for c in self._collections.values()]
        if path == "/version":
            major, minor = self.kubernetes_version.lstrip("v").split(".")[:2]
            return {"major": major, "minor": minor, "gitVersion": self.kubernetes_version, "platform": "linux/amd64"}
        if path == "/api":
            return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
        if path == "/apis":
            groups: dict[str, list[str]] = {}
            for r in resources:
                if r.group and r.version not in groups.setdefault(r.group, []):
                    groups[r.group].append(r.version)
            return {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [
                    {
                        "name": g,
                        "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in vs],
                        "preferredVersion": {"groupVersion": f"{g}/{vs[0]}", "version": vs[0]},
                    }
                    for g, vs in sorted(groups.items())
                ],
            }
        for prefix in {r.prefix for r in resources}:
            if path == prefix:
                return {
                    "kind": "APIResourceList",
                    "apiVersion": "v1",
                    "groupVersion": prefix.removeprefix("/api/").removeprefix("/apis/"),
                    "resources": [
                        {
                            "name": r.plural,
                            "singularName": r.kind.lower(),
                            "namespaced": r.namespaced,
                            "kind": r.kind,
                            "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
                        }
                        for r in resources
                        if r.prefix == prefix
                    ],
                }
        return None

    def _route(self, path: str) -> tuple[_Collection, str | None, str | None, str | None] | None:
        """(collection, namespace, name, subresource) of a resource path, or None."""
        parts = [p for p in path.split("/") if p]
        if len(parts) >= 2 and parts[0] == "api":
            group, version, rest = "", parts[1], parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            return None
        namespace = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            candidate = self._find(group, version, rest[2])
            if candidate is not None and candidate.resource.namespaced:
                namespace, rest = rest[1], rest[2:]
        if not rest or len(rest) > 3:
            return None
        collection = self._find(group, version, rest[0])
        if collection is None:
            return None
        name = rest[1] if len(rest) > 1 else None
        subresource = rest[2] if len(rest) > 2 else None
        return collection, namespace, name, subresource


def _matcher(namespace: str | None, query: Mapping[str, str]) -> Callable[[JSON], bool]:
    try:
        labels = parse_label_selector(query.get("labelSelector"))
        fields = parse_field_selector(query.get("fieldSelector"))
    except SelectorError as exc:
        raise ApiError(400, str(exc)) from exc

    def matches(obj: JSON) -> bool:
        if namespace is not None and obj.get("metadata", {}).get("namespace") != namespace:
            return False
        return labels(obj) and fields(obj)

    return matches


def _truthy(value: str | None) -> bool:
    return value in ("1", "true", "True")


class _Handler(BaseHTTPRequestHandler):
    api: FakeApiServer
    protocol_version = "HTTP/1.1"
    _recorded: RecordedRequest | None = None  # the request being served (its body is attached once read)
    _body_consumed = False

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes: without TCP_NODELAY, Nagle's algorithm and the client's
        # delayed ACK stall every response ~40 ms.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            super().finish()

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    # --- plumbing ---

    def _send_json(self, code: int, body: Any) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _abort(self) -> None:
        """Close the connection without a (complete) answer."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def _read_body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        self._body_consumed = True
        if not raw:
            return None
        try:
            body = json.loads(raw)
        except ValueError:
            try:
                import yaml  # noqa: PLC0415 - only for apply-patch+yaml bodies

                body = yaml.safe_load(raw)
            except Exception as exc:
                raise ApiError(400, f"cannot decode body: {exc}") from exc
        if self._recorded is not None:
            self.api._record_body(self._recorded, body)
        return body

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        api = self.api
        route = api._route(url.path)
        is_watch = method == "GET" and _truthy(query.get("watch"))
        collection, namespace, name, _subresource = route if route else (None, None, None, None)
        self._body_consumed = False
        self._recorded = RecordedRequest(
            method=method,
            path=url.path,
            query=query,
            resource=collection.resource.key if collection else None,
            namespace=namespace,
            name=name,
            watch=is_watch,
            time=time.monotonic(),
            headers={k.lower(): v for k, v in self.headers.items()},
        )
        api._record(self._recorded)
        try:
            if api.token and self.headers.get("Authorization") != f"Bearer {api.token}":
                raise ApiError(401, "Unauthorized")
            if collection is None:
                body = api._discovery(url.path) if method == "GET" else None
                if body is None:
                    raise ApiError(404, "the server could not find the requested resource")
                self._send_json(200, body)
                return
            gate = api._gate(collection.resource.key, is_watch, method)
            if gate == "offline":
                self._abort()
                return
            if isinstance(gate, _Failure):
                raise ApiError(gate.code, gate.message)
            dry_run = "dryRun" in query
            if method == "GET" and name is None:
                if is_watch:
                    self._watch(collection, namespace, query)
                else:
                    self._send_json(200, api._list_page(collection, namespace, query))
            elif method == "GET":
                with api._cond:
                    obj = copy.deepcopy(api._get_locked(collection, name or "", namespace))
                self._send_json(200, obj)
            elif method == "POST" and name is None:
                self._send_json(201, api.create(collection.resource, self._body_object(), namespace, dry_run=dry_run))
            elif method == "PUT" and name is not None:
                obj = self._body_object()
                if obj.get("metadata", {}).get("name", name) != name:
                    raise ApiError(400, "the name of the object does not match the name on the URL")
                obj.setdefault("metadata", {})["name"] = name
                self._send_json(200, api.update(collection.resource, obj, namespace, dry_run=dry_run))
            elif method == "PATCH" and name is not None:
                content_type = self.headers.get("Content-Type", "application/merge-patch+json")
                patched = api.patch(
                    collection.resource,
                    name,
                    self._read_body(),
                    namespace,
                    content_type=content_type,
                    dry_run=dry_run,
                )
                self._send_json(200, patched)
            elif method == "DELETE" and name is not None:
                deleted = api.delete(collection.resource, name, namespace, dry_run=dry_run)
                if collection.resource.delete_returns_object:
                    self._send_json(200, deleted)
                else:
                    self._send_json(
                        200,
                        {
                            "kind": "Status",
                            "apiVersion": "v1",
                            "metadata": {},
                            "status": "Success",
                            "details": {
                                "name": name,
                                "kind": collection.resource.plural,
                                "uid": deleted["metadata"].get("uid"),
                            },
                        },
                    )
            else:
                raise ApiError(405, f"{method} is not supported on {url.path}")
        except ApiError as exc:
            if not self._body_consumed:
                # A request answered before its body was read (auth, injected failure): drain the body, or the
                # next request on this keep-alive connection would start inside it.
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                self._body_consumed = True
            self._send_json(exc.code, exc.status)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _body_object(self) -> JSON:
        body = self._read_body()
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        return body

    # --- watch ---

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _event(self, event_type: str, obj: JSON) -> None:
        self._chunk(json.dumps({"type": event_type, "object": obj}, separators=(",", ":")).encode() + b"\n")

    def _watch(self, collection: _Collection, namespace: str | None, query: Mapping[str, str]) -> None:
        api = self.api
        matches = _matcher(namespace, query)
        bookmarks = _truthy(query.get("allowWatchBookmarks"))
        timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
        rv_param = query.get("resourceVersion") or ""
        watch = _Watch(collection.resource.key, query)
        initial: list[JSON] = []
        too_old = False
        with api._cond:
            if rv_param in ("", "0"):
                last = api._rv
                initial = [
                    o for _, o in sorted(collection.objects.items()) if matches(o)
                ]  # stored objects are never mutated
            else:
                try:
                    last = int(rv_param)
                except ValueError as exc:
                    raise ApiError(400, f"invalid resourceVersion {rv_param!r}") from exc
                too_old = last < collection.compacted_rv
            if not too_old:
                collection.watches.add(watch)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            if too_old:
                self._event(
                    "ERROR",
                    status_object(410, f"too old resource version: {last} ({collection.compacted_rv})", "Expired"),
                )
                self._chunk(b"")
                return
            for obj in initial:
                self._event("ADDED", obj)
            started = time.monotonic()
            next_bookmark = started + api.bookmark_interval if api.bookmark_interval else None
            while True:
                with api._cond:
                    pending = collection.history and collection.history[-1].rv > last
                    if not (pending or watch.drop or watch.gone or watch.bookmark or watch.lines or api._stopping):
                        api._cond.wait(0.05)
                    stopping = api._stopping
                    history = collection.history
                    start = bisect.bisect_right(history, last, key=lambda e: e.rv)
                    events = history[start:]
                    drop, gone, bookmark = watch.drop, watch.gone, watch.bookmark
                    lines, watch.lines = watch.lines, []
                    watch.bookmark = False
                    current = api._rv
                if drop or stopping:
                    self._abort()
                    return
                for line in lines:
                    self._chunk(line + b"\n")
                for event in events:
                    last = event.rv
                    translated = _translate(event, matches)
                    if translated is not None:
                        self._event(*translated)
                if gone:
                    self._event("ERROR", status_object(410, "too old resource version", "Expired"))
                    self._chunk(b"")
                    return
                now = time.monotonic()
                if next_bookmark is not None and now >= next_bookmark:
                    bookmark = True
                    next_bookmark = now + (api.bookmark_interval or 0)
                if bookmarks and bookmark:
                    last = max(last, current)
                    self._event(
                        "BOOKMARK",
                        {
                            "kind": collection.resource.kind,
                            "apiVersion": collection.resource.api_version,
                            "metadata": {"resourceVersion": str(last)},
                        },
                    )
                if timeout is not None and now - started >= timeout:
                    self._chunk(b"")
                    return
        except OSError:
            self.close_connection = True
        finally:
            with api._cond:
                collection.watches.discard(watch)
                api._cond.notify_all()


def _translate(event: _Event, matches: Callable[[JSON], bool]) -> tuple[str, JSON] | None:
    """The event a watcher with a selector sees (MODIFIED becomes ADDED/DELETED on entering/leaving it)."""
    if event.type == "MODIFIED":
        now_in, was_in = matches(event.obj), event.old is not None and matches(event.old)
        if now_in and was_in:
            return "MODIFIED", event.obj
        if now_in:
            return "ADDED", event.obj
        if was_in:
            return "DELETED", event.obj
        return None
    return (event.type, event.obj) if matches(event.obj) else None
