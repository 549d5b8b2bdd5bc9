"""List and watch requests for one collection, sent through a :class:`kubernetes.client.ApiClient`.

The ApiClient supplies what the cluster configuration decides (server URL, TLS, bearer token and its refresh,
exec credential plugins, proxies, the connection pool). The requests bypass the generated ``*Api`` classes: their
import alone costs ~25 MB of model classes, and their responses are validated into pydantic models we would throw
away. Responses are read raw (urllib3) and decoded with :mod:`json`.

Wire format (Kubernetes API concepts, "Efficient detection of changes" and "Retrieving large results sets in
chunks"): a list returns ``{"metadata": {"resourceVersion", "continue"}, "items": [...]}``; a watch
(``watch=true``) returns a chunked stream of ``{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": {...}}``
lines, an ERROR carrying a ``Status``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any, Protocol


class ApiStatusError(Exception):
    """The API server answered with an error ``Status`` (HTTP status or a watch ERROR event)."""

    def __init__(self, code: int, reason: str = "", message: str = "") -> None:
        """``code`` is the HTTP status code (``Status.code``), ``reason`` and ``message`` the Status's fields."""
        super().__init__(f"{code} {reason}: {message}".strip())
        self.code = code
        self.reason = reason
        self.message = message

    @classmethod
    def from_status(cls, status: object, default_code: int = 500) -> ApiStatusError:
        """Build from a decoded ``Status`` object; a 410 (Gone / Expired) becomes :class:`GoneError`."""
        fields: Mapping[str, Any] = status if isinstance(status, Mapping) else {}
        code = fields.get("code")
        code = code if isinstance(code, int) and not isinstance(code, bool) else default_code
        error_type = GoneError if code == 410 else ApiStatusError
        return error_type(code, str(fields.get("reason") or ""), str(fields.get("message") or ""))


class GoneError(ApiStatusError):
    """HTTP 410 Gone: the resourceVersion (or continue token) is too old; the client must re-list."""


class RawResponse(Protocol):
    """The part of ``urllib3.response.HTTPResponse`` the caches use."""

    status: int

    @property
    def data(self) -> bytes:
        """The whole body (reads it)."""
        ...

    def stream(self, amt: int | None = ..., decode_content: bool | None = ...) -> Iterator[bytes]:
        """Iterate the body as it arrives (one chunk at a time for chunked transfer encoding)."""
        ...

    def close(self) -> None:
        """Close the response and its connection."""
        ...


class CollectionClient:
    """GET list and watch requests of one collection path (``/api/v1/nodes``,
    ``/api/v1/namespaces/kube-system/pods``, ``/apis/storage.k8s.io/v1/volumeattachments``)."""

    def __init__(
        self, api_client: Any, path: str, label_selector: str | None = None, field_selector: str | None = None
    ) -> None:
        """``api_client`` is a ``kubernetes.client.ApiClient``; ``label_selector`` and ``field_selector`` are sent
        on every request."""
        self._api = api_client
        self.path = path
        self.label_selector = label_selector
        self.field_selector = field_selector

    def _get(self, query: list[tuple[str, str]], timeout: tuple[float, float]) -> RawResponse:
        if self.label_selector:
            query.append(("labelSelector", self.label_selector))
        if self.field_selector:
            query.append(("fieldSelector", self.field_selector))
        method, url, headers, body, post_params = self._api.param_serialize(
            method="GET",
            resource_path=self.path,
            query_params=query,
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        rest_response = self._api.call_api(
            method, url, header_params=headers, body=body, post_params=post_params, _request_timeout=timeout
        )
        response: RawResponse = rest_response.response
        if not 200 <= response.status <= 299:
            try:
                raw = response.data
            finally:
                response.close()
            raise ApiStatusError.from_status(_decode_status(raw), default_code=response.status)
        return response

    def list_page(self, limit: int, continue_token: str | None, timeout: tuple[float, float]) -> dict[str, Any]:
        """One page of a list (``limit``, ``continue``), decoded. Raises :class:`ApiStatusError`.

        No ``resourceVersion`` is sent: the read is consistent (served from the watch cache since Kubernetes
        1.31, ConsistentListFromCache) and honours ``limit``.
        """
        query = [("limit", str(limit))]
        if continue_token:
            query.append(("continue", continue_token))
        response = self._get(query, timeout)
        try:
            decoded = json.loads(response.data)
        finally:
            response.close()
        if not isinstance(decoded, dict):
            raise ValueError(f"list of {self.path}: not a JSON object")
        return decoded

    def watch(self, resource_version: str, timeout_seconds: int, timeout: tuple[float, float]) -> RawResponse:
        """Open a watch from ``resource_version`` with bookmarks; the caller reads and closes the stream."""
        query = [
            ("watch", "true"),
            ("allowWatchBookmarks", "true"),
            ("resourceVersion", resource_version),
            ("timeoutSeconds", str(timeout_seconds)),
        ]
        return self._get(query, timeout)


def _decode_status(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def iter_lines(response: RawResponse) -> Iterator[bytes]:
    """The newline-separated JSON documents of a watch stream, as they arrive."""
    buffer = bytearray()
    for chunk in response.stream(65536, decode_content=True):
        buffer += chunk
        start = 0
        while True:
            end = buffer.find(b"\n", start)
            if end < 0:
                break
            if end > start:
                yield bytes(buffer[start:end])
            start = end + 1
        if start:
            del buffer[:start]
    if buffer.strip():
        yield bytes(buffer)
