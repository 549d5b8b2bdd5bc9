"""The Kubernetes API calls of the operator commands (``register``, ``unregister``, ``restore``, ``preflight``,
``status``).

A request is a plain value (:class:`ApiRequest`: method, path, query, JSON body) built by pure functions; a
:class:`KubeClient` only sends it, through a ``kubernetes.client.ApiClient``, which supplies what the cluster
configuration decides (server, TLS, bearer token and its refresh, exec credential plugins, proxies).

Objects travel as JSON dicts, not as the client's generated models: a CSINode is read and written back whole
(GET, then PUT with its ``resourceVersion``, as kubelet does), and a round trip through models would drop every
field this client version does not know. Errors carry the apiserver's ``Status`` (:class:`KubeApiError`), whose
``message`` is what an operator needs to read -- for a write the guard refuses, the guard's own denial.

The admission path never comes here; its cluster reads live in :mod:`webhook.kube.watch`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

import orjson
import urllib3

from webhook import __version__

JSON = dict[str, Any]

DRY_RUN_ALL: Final = "All"
"""The only ``dryRun`` value the API defines: run every stage (admission webhooks included), persist nothing."""

DEFAULT_TIMEOUT: Final = (5.0, 30.0)
"""(connect, read) seconds per request."""


@dataclass(frozen=True)
class ApiResource:
    """One API resource: ``group`` ("" for core), ``version``, ``plural``, its ``kind``, and ``namespaced``."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = False

    @property
    def api_version(self) -> str:
        """``v1`` or ``group/version``."""
        return f"{self.group}/{self.version}" if self.group else self.version

    def collection_path(self, namespace: str | None = None) -> str:
        """``/apis/<group>/<version>/<plural>`` (``/api/v1/<plural>`` for the core group); with ``namespace``
        (namespaced resources only) ``.../namespaces/<namespace>/<plural>``; without it, all namespaces."""
        prefix = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if namespace is not None and self.namespaced:
            return f"{prefix}/namespaces/{namespace}/{self.plural}"
        return f"{prefix}/{self.plural}"

    def object_path(self, name: str, namespace: str | None = None) -> str:
        """The path of the object ``name`` (in ``namespace`` for a namespaced resource)."""
        return f"{self.collection_path(namespace)}/{name}"

    def describe(self, name: str) -> str:
        """``<plural>.<group>/<name>``, the way kubectl names an object in its output."""
        return f"{self.plural}.{self.group}/{name}" if self.group else f"{self.plural}/{name}"


CSINODES: Final = ApiResource("storage.k8s.io", "v1", "csinodes", "CSINode")
MUTATING_WEBHOOK_CONFIGURATIONS: Final = ApiResource(
    "admissionregistration.k8s.io", "v1", "mutatingwebhookconfigurations", "MutatingWebhookConfiguration"
)
VALIDATING_WEBHOOK_CONFIGURATIONS: Final = ApiResource(
    "admissionregistration.k8s.io", "v1", "validatingwebhookconfigurations", "ValidatingWebhookConfiguration"
)
NODES: Final = ApiResource("", "v1", "nodes", "Node")
NAMESPACES: Final = ApiResource("", "v1", "namespaces", "Namespace")
PODS: Final = ApiResource("", "v1", "pods", "Pod", namespaced=True)
SECRETS: Final = ApiResource("", "v1", "secrets", "Secret", namespaced=True)
CSIDRIVERS: Final = ApiResource("storage.k8s.io", "v1", "csidrivers", "CSIDriver")
VOLUMEATTACHMENTS: Final = ApiResource("storage.k8s.io", "v1", "volumeattachments", "VolumeAttachment")
DEPLOYMENTS: Final = ApiResource("apps", "v1", "deployments", "Deployment", namespaced=True)
VALIDATING_ADMISSION_POLICIES: Final = ApiResource(
    "admissionregistration.k8s.io", "v1", "validatingadmissionpolicies", "ValidatingAdmissionPolicy"
)
VALIDATING_ADMISSION_POLICY_BINDINGS: Final = ApiResource(
    "admissionregistration.k8s.io", "v1", "validatingadmissionpolicybindings", "ValidatingAdmissionPolicyBinding"
)
LEASES: Final = ApiResource("coordination.k8s.io", "v1", "leases", "Lease", namespaced=True)
EVENTS: Final = ApiResource("events.k8s.io", "v1", "events", "Event", namespaced=True)
METADATA_ONLY: Final = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json"
"""``Accept`` of a LIST that needs only ``metadata`` (names, labels): the apiserver answers with a
PartialObjectMetadataList, without ``spec`` and ``status`` (a Node's images and conditions, several KB each)."""
LIST_PAGE_SIZE: Final = 500
"""Objects per LIST page (``limit``); the apiserver hands out a ``continue`` token for the rest."""
RESOURCES_BY_KIND: Final[Mapping[str, ApiResource]] = {
    r.kind: r for r in (CSINODES, MUTATING_WEBHOOK_CONFIGURATIONS, VALIDATING_WEBHOOK_CONFIGURATIONS)
}


@dataclass(frozen=True)
class ApiRequest:
    """One API request: method, path, query parameters (in order) and an optional JSON body."""

    method: str
    path: str
    query: tuple[tuple[str, str], ...] = ()
    body: Mapping[str, Any] | None = None
    accept: str = "application/json"


def _write_query(dry_run: bool, field_manager: str | None) -> tuple[tuple[str, str], ...]:
    query: list[tuple[str, str]] = []
    if dry_run:
        query.append(("dryRun", DRY_RUN_ALL))
    if field_manager:
        query.append(("fieldManager", field_manager))
    return tuple(query)


def get_request(resource: ApiResource, name: str, namespace: str | None = None) -> ApiRequest:
    """GET one object."""
    return ApiRequest("GET", resource.object_path(name, namespace))


def list_request(
    resource: ApiResource,
    *,
    namespace: str | None = None,
    label_selector: str | None = None,
    field_selector: str | None = None,
    limit: int = LIST_PAGE_SIZE,
    continue_token: str | None = None,
    metadata_only: bool = False,
) -> ApiRequest:
    """One page of a LIST (``limit`` objects; ``continue_token`` from the previous page's ``metadata.continue``);
    ``metadata_only`` asks for each object's ``metadata`` alone (:data:`METADATA_ONLY`)."""
    query: list[tuple[str, str]] = [("limit", str(limit))]
    if label_selector:
        query.append(("labelSelector", label_selector))
    if field_selector:
        query.append(("fieldSelector", field_selector))
    if continue_token:
        query.append(("continue", continue_token))
    return ApiRequest("GET", resource.collection_path(namespace), tuple(query),
                      accept=METADATA_ONLY if metadata_only else "application/json")


def create_request(
    resource: ApiResource, obj: Mapping[str, Any], *, dry_run: bool = False, field_manager: str | None = None
) -> ApiRequest:
    """POST ``obj`` to its collection (``dryRun=All`` when ``dry_run``)."""
    return ApiRequest("POST", resource.collection_path(), _write_query(dry_run, field_manager), obj)


def replace_request(
    resource: ApiResource, obj: Mapping[str, Any], *, dry_run: bool = False, field_manager: str | None = None
) -> ApiRequest:
    """PUT the whole ``obj``; its ``metadata.resourceVersion`` makes the write conditional (409 when stale)."""
    name = str(obj["metadata"]["name"])
    return ApiRequest("PUT", resource.object_path(name), _write_query(dry_run, field_manager), obj)


def delete_request(
    resource: ApiResource, name: str, *, dry_run: bool = False, namespace: str | None = None
) -> ApiRequest:
    """DELETE one object (in ``namespace`` for a namespaced resource)."""
    return ApiRequest("DELETE", resource.object_path(name, namespace), _write_query(dry_run, None))


class KubeApiError(Exception):
    """The apiserver answered with an error ``Status``: ``code`` (HTTP), ``reason`` and ``message``."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(f"{code} {reason}: {message}" if reason else f"{code}: {message}")
        self.code = code
        self.reason = reason
        self.message = message

    @property
    def not_found(self) -> bool:
        """HTTP 404 NotFound."""
        return self.code == 404

    @property
    def conflict(self) -> bool:
        """HTTP 409 Conflict: the object changed since it was read (not AlreadyExists)."""
        return self.code == 409 and self.reason != "AlreadyExists"

    @property
    def already_exists(self) -> bool:
        """HTTP 409 AlreadyExists (a create that lost a race)."""
        return self.code == 409 and self.reason == "AlreadyExists"


def parse_status(code: int, body: bytes) -> KubeApiError:
    """The error for an HTTP ``code`` and its body: the ``Status``'s reason and message when the body is one."""
    try:
        status = json.loads(body)
    except ValueError:
        status = None
    if isinstance(status, dict) and status.get("kind") == "Status":
        reason = str(status.get("reason") or "")
        message = str(status.get("message") or "") or reason
        return KubeApiError(code, reason, message)
    text = body.decode("utf-8", "replace").strip()
    return KubeApiError(code, "", text[:500] or "(empty response)")


class ApiUnreachableError(Exception):
    """The request got no HTTP answer (connection refused, TLS failure, timeout)."""


class ClusterNotConfiguredError(Exception):
    """Neither a kubeconfig nor an in-cluster service account to reach the cluster with."""


class ClusterConfigError(Exception):
    """A kubeconfig or in-cluster configuration that cannot be loaded: the client's
    ``kubernetes.config.ConfigException``, or the ``OSError``/``ValueError`` of an unreadable or malformed file,
    re-raised with the same message so that the commands need not import the client."""


SERVICE_ACCOUNT_TOKEN: Final = "/var/run/secrets/kubernetes.io/serviceaccount/token"
"""Where kubelet mounts a pod's service-account token (the in-cluster configuration reads it from here)."""


def in_pod() -> bool:
    """Whether this process runs in a pod that can reach its cluster: ``$KUBERNETES_SERVICE_HOST`` set (kubelet
    sets it in every container) and a service-account token mounted at :data:`SERVICE_ACCOUNT_TOKEN`."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and os.path.isfile(SERVICE_ACCOUNT_TOKEN)


def _forget_inherited_temp_files() -> None:
    """In a forked child (a gunicorn worker): drop the kubernetes client's record of the temporary files it wrote
    for a kubeconfig's ``*-data`` fields (CA, client certificate and key) in the parent. The client deletes every
    file in that record when the process exits (atexit), so without this the first worker to exit deleted the
    files the master and every other worker still opened each new apiserver connection with (``SSLError(
    FileNotFoundError)``: leases no longer renewed, watches unable to reconnect). The child writes its own files
    when it loads the configuration and deletes only those."""
    from kubernetes.config import kube_config  # noqa: PLC0415 - imported already: registered only after the import

    kube_config._temp_files = {}  # the client's module-level record: there is no API for it


_fork_hook_registered = False


def _register_fork_hook() -> None:
    global _fork_hook_registered  # noqa: PLW0603 - once per process
    if not _fork_hook_registered:
        os.register_at_fork(after_in_child=_forget_inherited_temp_files)
        _fork_hook_registered = True


def load_configuration(
    kubeconfig: str | None = None, context: str | None = None, *, home_fallback: bool = True,
    environment: bool = True,
) -> Any | None:
    """A ``kubernetes.client.Configuration`` for the cluster, or None when no source is configured.

    Order: ``kubeconfig`` (else, with ``environment``, ``$KUBECONFIG``; a ``:``-separated list is merged) with its
    ``context`` (default: the current one), then the in-cluster service account (token re-read as it rotates),
    then — with ``home_fallback``, the order kubectl uses — ``~/.kube/config``. Raises
    :class:`ClusterNotConfiguredError` for ``context`` without a kubeconfig, FileNotFoundError when none of the
    kubeconfig files exists, ``kubernetes.config.ConfigException`` (or PyYAML's error) for a broken source.
    """
    from kubernetes.client.configuration import Configuration  # noqa: PLC0415 - heavy; only when needed
    from kubernetes.config import incluster_config, kube_config  # noqa: PLC0415

    _register_fork_hook()
    load_kube_config: Callable[..., None] = kube_config.load_kube_config
    load_incluster_config: Callable[..., None] = incluster_config.load_incluster_config
    configuration = Configuration()
    path = kubeconfig or (os.environ.get("KUBECONFIG") if environment else None)
    home_config = os.path.expanduser("~/.kube/config")
    in_cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    if not path and not in_cluster and home_fallback and os.path.isfile(home_config):
        path = home_config
    if path:
        missing = [p for p in path.split(os.pathsep) if p and not os.path.exists(p)]
        if missing and len(missing) == len([p for p in path.split(os.pathsep) if p]):
            raise FileNotFoundError(f"kubeconfig {', '.join(missing)} does not exist")
        load_kube_config(
            config_file=path, context=context, client_configuration=configuration, persist_config=False
        )
    elif in_cluster:
        if context:
            raise ClusterNotConfiguredError("--context needs a kubeconfig (--kubeconfig or KUBECONFIG)")
        load_incluster_config(client_configuration=configuration)
    else:
        return None
    return configuration


def load_api_client(kubeconfig: str | None = None, context: str | None = None, *, environment: bool = True) -> Any:
    """A ``kubernetes.client.ApiClient`` for the operator commands, found as kubectl finds its cluster
    (:func:`load_configuration` with the ``~/.kube/config`` fallback), so that ``csinode-guard unregister``
    works in an emergency wherever kubectl does. Raises :class:`ClusterNotConfiguredError` when there is no
    source (or ``context`` without a kubeconfig) and :class:`ClusterConfigError`, with the client's message, for a
    source that cannot be read or loaded (not YAML, no current-context, a missing file, ...).
    """
    with _config_errors():
        return _api_client(kubeconfig, context, environment=environment)


def check_configuration(kubeconfig: str | None, *, environment: bool = True) -> None:
    """Load the cluster configuration the watch caches will use (``kubeconfig``, else ``$KUBECONFIG``, else the
    in-cluster service account; never ``~/.kube/config``), so that ``serve`` refuses to start on a broken one
    instead of each worker failing to boot. Raises :class:`ClusterConfigError` with the reason; no source at all
    is fine (the server then runs without cluster facts)."""
    with _config_errors():
        load_configuration(kubeconfig, home_fallback=False, environment=environment)


def describe_cluster(kubeconfig: str | None, *, environment: bool = True) -> tuple[str, str]:
    """(server URL, where it came from) of the cluster :func:`load_configuration` picks without the
    ``~/.kube/config`` fallback: ``("https://10.0.0.1:6443", "context kind-dev of kubeconfig /path")`` or
    ``(..., "the pod's service account")``; ``("", "none")`` when no source is configured. For a log line: raises
    :class:`ClusterConfigError` as :func:`check_configuration` does."""
    with _config_errors():
        configuration = load_configuration(kubeconfig, home_fallback=False, environment=environment)
    if configuration is None:
        return "", "none"
    path = kubeconfig or (os.environ.get("KUBECONFIG") if environment else None)
    if not path:
        return str(configuration.host), "the pod's service account"
    context = "its current context"
    with contextlib.suppress(Exception):  # the name is for the log line only
        from kubernetes.config import kube_config  # noqa: PLC0415

        list_contexts: Callable[..., Any] = kube_config.list_kube_config_contexts
        _, active = list_contexts(config_file=path.split(os.pathsep)[0])
        context = f"context {active['name']}"
    return str(configuration.host), f"{context} of kubeconfig {path}"


@contextlib.contextmanager
def _config_errors() -> Iterator[None]:
    """Re-raise what loading a cluster configuration raises as :class:`ClusterConfigError` (the client's
    ConfigException, a file that cannot be read, a kubeconfig that is not YAML)."""
    import yaml  # noqa: PLC0415 - the client reads kubeconfig files with PyYAML
    from kubernetes.config import ConfigException  # noqa: PLC0415 - heavy; only when a command needs it

    try:
        yield
    except (ConfigException, OSError, ValueError) as exc:
        raise ClusterConfigError(str(exc)) from exc
    except yaml.YAMLError as exc:  # the parser's message names the file, line and column
        raise ClusterConfigError(f"the kubeconfig is not valid YAML: {exc}") from exc


def _api_client(kubeconfig: str | None, context: str | None, *, environment: bool = True) -> Any:
    from kubernetes.client.api_client import ApiClient  # noqa: PLC0415 - heavy; only when a command needs it
    from urllib3.util import Retry  # noqa: PLC0415

    configuration = load_configuration(kubeconfig, context, environment=environment)
    if configuration is None:
        raise ClusterNotConfiguredError(
            "no cluster configured: pass --kubeconfig, set KUBECONFIG, create ~/.kube/config, or run inside a cluster"
        )
    # Retry connection failures only: a write whose answer was lost is not resent blindly.
    configuration.retries = Retry(total=2, connect=2, read=0, redirect=0, status=0, backoff_factor=0.2)
    api_client = ApiClient(configuration)
    api_client.user_agent = f"csinode-guard/{__version__}"
    return api_client


_WARNING = re.compile(r'(\d{3}) (\S+) "((?:[^"\\]|\\.)*)"')


def parse_warnings(values: Iterable[str]) -> list[str]:
    """The texts of HTTP ``Warning`` header values (RFC 7234: ``299 - "text"``), e.g. an admission webhook's
    warnings, which the apiserver sends this way; several may share one header value, comma-separated."""
    texts: list[str] = []
    for value in values:
        texts.extend(re.sub(r"\\(.)", r"\1", m.group(3)) for m in _WARNING.finditer(value))
    return texts


class KubeClient:
    """Sends :class:`ApiRequest` values through a ``kubernetes.client.ApiClient``; JSON in, JSON out.

    ``on_warning`` is called with the text of each warning the apiserver sends (HTTP ``Warning`` headers:
    deprecations, admission webhook warnings such as the guard's clamp notice).
    """

    def __init__(
        self,
        api_client: Any,
        timeout: tuple[float, float] = DEFAULT_TIMEOUT,
        on_warning: Callable[[str], None] | None = None,
    ) -> None:
        self._api = api_client
        self._timeout = timeout
        self._on_warning = on_warning

    def close(self) -> None:
        """Close the ApiClient's connection pool."""
        self._api.close()

    def __enter__(self) -> KubeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, request: ApiRequest) -> JSON:
        """Send ``request``; the decoded JSON answer. Raises :class:`KubeApiError` for an error status and
        :class:`ApiUnreachableError` when no answer came."""
        headers = {"Accept": request.accept}
        if request.body is not None:
            headers["Content-Type"] = "application/json"
        method, url, header_params, body, post_params = self._api.param_serialize(
            method=request.method,
            resource_path=request.path,
            query_params=list(request.query),
            header_params=headers,
            body=dict(request.body) if request.body is not None else None,
            auth_settings=["BearerToken"],
        )
        try:
            rest_response = self._api.call_api(
                method, url, header_params=header_params, body=body, post_params=post_params,
                _request_timeout=self._timeout,
            )
        except urllib3.exceptions.HTTPError as exc:
            raise ApiUnreachableError(f"{request.method} {url}: {exc}") from exc
        response = rest_response.response
        try:
            raw: bytes = response.data
        finally:
            response.close()
        if self._on_warning is not None:
            for text in parse_warnings(response.headers.getlist("Warning")):
                self._on_warning(text)
        if not 200 <= response.status <= 299:
            raise parse_status(int(response.status), raw)
        try:
            decoded = orjson.loads(raw) if raw else {}
        except ValueError as exc:
            raise KubeApiError(int(response.status), "", f"not a JSON answer: {exc}") from None
        if not isinstance(decoded, dict):
            raise KubeApiError(int(response.status), "", "not a JSON object")
        return decoded

    def get(self, resource: ApiResource, name: str, namespace: str | None = None) -> JSON:
        """The object ``name``; :class:`KubeApiError` with ``not_found`` when absent."""
        return self.send(get_request(resource, name, namespace))

    def get_path(self, path: str) -> JSON:
        """GET a non-resource path such as ``/version``; its JSON answer."""
        return self.send(ApiRequest("GET", path))

    def list_all(
        self,
        resource: ApiResource,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        limit: int = LIST_PAGE_SIZE,
        metadata_only: bool = False,
    ) -> list[JSON]:
        """Every object of ``resource`` (in ``namespace``, or all), read in pages of ``limit``: one LIST, never a
        call per object; ``metadata_only``: only each object's ``metadata``. Raises :class:`KubeApiError` (a
        ``410 Gone`` when the continue token expired mid-list)."""
        items: list[JSON] = []
        token: str | None = None
        while True:
            page = self.send(list_request(resource, namespace=namespace, label_selector=label_selector,
                                          field_selector=field_selector, limit=limit, continue_token=token,
                                          metadata_only=metadata_only))
            items.extend(i for i in page.get("items") or [] if isinstance(i, dict))
            token = str((page.get("metadata") or {}).get("continue") or "") or None
            if token is None:
                return items

    def create(
        self, resource: ApiResource, obj: Mapping[str, Any], *, dry_run: bool = False, field_manager: str | None = None
    ) -> JSON:
        """Create ``obj``; the object as stored (or as it would be, with ``dry_run``)."""
        return self.send(create_request(resource, obj, dry_run=dry_run, field_manager=field_manager))

    def replace(
        self, resource: ApiResource, obj: Mapping[str, Any], *, dry_run: bool = False, field_manager: str | None = None
    ) -> JSON:
        """Replace ``obj`` (PUT); the object as stored (or as it would be, with ``dry_run``)."""
        return self.send(replace_request(resource, obj, dry_run=dry_run, field_manager=field_manager))

    def delete(
        self, resource: ApiResource, name: str, *, dry_run: bool = False, namespace: str | None = None
    ) -> JSON:
        """Delete ``name`` (in ``namespace``); the answer (a ``Status`` or the deleted object)."""
        return self.send(delete_request(resource, name, dry_run=dry_run, namespace=namespace))
