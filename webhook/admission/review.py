"""AdmissionReview ``admission.k8s.io/v1`` on the wire: parse a request, build a response.

This is the only module that knows the envelope, typed end to end: :func:`check_review` gives the body as an
:class:`AdmissionReviewRequest`, :func:`parse_review` the :class:`AdmissionRequest` judged from it, and
:func:`build_response` the :class:`AdmissionReviewResponse` answer. Field names keep Kubernetes' camelCase
(``userInfo``, ``oldObject``, ``dryRun``). A body that is not a usable AdmissionReview raises a
:class:`ReviewError` saying which way (:class:`NotJSONError`, :class:`UnsupportedVersionError`,
:class:`MalformedReviewError`); the HTTP status it is answered with is the server's choice
(``webhook.serving.app.REVIEW_ERROR_STATUS``).

Source: k8s.io/api/admission/v1 types.go and the dynamic admission control docs (the response must echo ``uid``,
``apiVersion: admission.k8s.io/v1`` and ``kind: AdmissionReview``; a patch is a base64-encoded JSONPatch with
``patchType: JSONPatch``; warnings are at most 256 characters, no newlines; audit annotation keys are qualified
by the apiserver with the webhook name, so they must not contain ``/``).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal, NamedTuple, NotRequired, TypedDict, cast

try:
    import orjson
except ImportError:  # pragma: no cover - orjson is a dependency; json alone gives the same results, slower
    orjson = None  # type: ignore[assignment]

API_VERSION = "admission.k8s.io/v1"
KIND = "AdmissionReview"
MAX_WARNING_LENGTH = 256
MAX_WARNINGS = 32
"""Warnings an answer carries at most; the last one counts the rest (kube-apiserver truncates long lists too)."""


class ReviewError(ValueError):
    """The HTTP body is not a usable AdmissionReview v1 (the apiserver's problem, not the writer's); ``message``
    says why, without echoing long input. The subclasses say which way; the server maps each to an HTTP status.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotJSONError(ReviewError):
    """The body is not JSON (or not UTF-8 text, or holds an integer over Python's 4300-digit limit)."""


class UnsupportedVersionError(ReviewError):
    """The body is JSON but not an ``admission.k8s.io/v1`` ``AdmissionReview`` (v1beta1, another kind)."""


class MalformedReviewError(ReviewError):
    """An AdmissionReview v1 that cannot be judged: not an object, no ``request``, or a request field of the
    wrong type (an empty ``uid``, ``userInfo.groups`` not a list of strings, ``object`` not an object...)."""


class GroupVersionKind(TypedDict):
    """``kind`` of an AdmissionRequest: ``{"group": "storage.k8s.io", "version": "v1", "kind": "CSINode"}``."""

    group: str
    version: str
    kind: str


class GroupVersionResource(TypedDict):
    """``resource`` of an AdmissionRequest: ``{"group": "storage.k8s.io", "version": "v1", "resource": ...}``
    (a field absent or null reads as ``""``)."""

    group: NotRequired[str | None]
    version: NotRequired[str | None]
    resource: NotRequired[str | None]


class UserInfo(TypedDict, total=False):
    """``request.userInfo`` (authentication.k8s.io/v1 UserInfo); ``uid`` and ``extra`` are not read."""

    username: str | None
    uid: Any
    groups: list[str] | None
    extra: Any


class AdmissionRequestWire(TypedDict):
    """``request`` of an AdmissionReview as the apiserver sends it, as far as :func:`check_review` checks it
    (``kind``, ``namespace`` and ``options`` are not read: ``resource`` says what is judged)."""

    uid: str
    kind: NotRequired[Any]
    resource: GroupVersionResource
    operation: str
    userInfo: NotRequired[UserInfo | None]
    name: NotRequired[str | None]
    namespace: NotRequired[Any]
    subResource: NotRequired[str | None]
    object: NotRequired[dict[str, Any] | None]
    oldObject: NotRequired[dict[str, Any] | None]
    dryRun: NotRequired[bool]
    options: NotRequired[Any]


class AdmissionReviewRequest(TypedDict):
    """The AdmissionReview the apiserver POSTs: ``apiVersion: admission.k8s.io/v1``, ``kind: AdmissionReview``."""

    apiVersion: str
    kind: str
    request: AdmissionRequestWire


class StatusWire(TypedDict):
    """``response.status`` of a refusal (the fields of meta/v1 Status the apiserver reads)."""

    code: int
    reason: str
    message: str


class AdmissionResponseWire(TypedDict):
    """``response`` of an AdmissionReview answer: ``status`` only when not allowed, ``patchType``/``patch`` (base64
    RFC 6902 JSONPatch) only from /mutate, the others only when not empty."""

    uid: str
    allowed: bool
    status: NotRequired[StatusWire]
    warnings: NotRequired[list[str]]
    auditAnnotations: NotRequired[dict[str, str]]
    patchType: NotRequired[Literal["JSONPatch"]]
    patch: NotRequired[str]


class AdmissionReviewResponse(TypedDict):
    """The AdmissionReview the webhook answers with: echoes ``apiVersion``/``kind``, the request's uid inside."""

    apiVersion: str
    kind: str
    response: AdmissionResponseWire


class AdmissionRequest(NamedTuple):
    """A parsed AdmissionRequest (an immutable named tuple). ``object``/``old_object`` are the raw JSON objects
    (dicts) or None.

    ``operation`` is ``CREATE``/``UPDATE``/``DELETE``/``CONNECT``; ``dry_run`` is the apiserver's ``dryRun``
    flag (nothing is persisted), which is unrelated to the ``dryrun`` enforcement action.
    """

    uid: str
    operation: str
    group: str
    version: str
    resource: str
    sub_resource: str
    name: str
    username: str
    groups: tuple[str, ...]
    dry_run: bool
    object: Mapping[str, Any] | None
    old_object: Mapping[str, Any] | None
    api_version: str = API_VERSION

    @property
    def is_csinode(self) -> bool:
        """True for ``storage.k8s.io/v1 csinodes`` without a subresource."""
        return (
            self.group == "storage.k8s.io"
            and self.version == "v1"
            and self.resource == "csinodes"
            and not self.sub_resource
        )


_RESOURCE_TEXTS = ("group", "version", "resource")
_REQUEST_TEXTS = ("subResource", "name")


def decode_json(body: bytes | str) -> Any:
    """``json.loads(body)``, about three times faster (orjson), with two documented differences.

    Everything orjson refuses (NaN, 1e400, lone surrogates, a byte order mark, UTF-16/32 text, nesting deeper
    than 1024) goes to ``json``, which then accepts or refuses it as it always did. Where orjson accepts a body,
    it gives what ``json`` gives except: an integer literal beyond 64 bits becomes a float (no Kubernetes object
    holds one: API integers are int32 or int64, and the apiserver serializes typed objects; a float
    ``allocatable.count`` is refused as not a CSINode), and nesting between the interpreter's recursion limit
    (about 1,000 levels) and 1024 is decoded where ``json`` raises RecursionError.
    """
    if orjson is not None and not isinstance(body, str):
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            pass
    return json.loads(body)


def check_review(doc: Any) -> AdmissionReviewRequest:
    """``doc`` (decoded JSON) as the :class:`AdmissionReviewRequest` it is, once checked.

    Raises :class:`UnsupportedVersionError` when it is not an ``admission.k8s.io/v1`` ``AdmissionReview``, and
    :class:`MalformedReviewError` when it is not an object, has no ``request``, or a request without ``uid``/
    ``operation``/``resource`` or with a field of another type than its :class:`AdmissionRequestWire` type.
    Objects are not validated here; ``webhook.admission.csinode`` does that.
    """
    if not isinstance(doc, dict):
        raise MalformedReviewError("body must be a JSON object (an AdmissionReview)")
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != KIND:
        raise UnsupportedVersionError(
            f"expected apiVersion {API_VERSION!r} and kind {KIND!r}, got "
            f"{str(doc.get('apiVersion'))[:64]!r} and {str(doc.get('kind'))[:64]!r}"
        )
    # The checks are written out (no helper calls, no generators): this runs for every review.
    request = doc.get("request")
    if not isinstance(request, dict):
        raise MalformedReviewError("AdmissionReview has no request")
    uid = request.get("uid")
    if not isinstance(uid, str):
        raise MalformedReviewError("request.uid must be a str")
    if not uid:
        raise MalformedReviewError("request.uid must not be empty")
    if not isinstance(request.get("operation"), str):
        raise MalformedReviewError("request.operation must be a str")
    resource = request.get("resource")
    if not isinstance(resource, dict):
        raise MalformedReviewError("request.resource must be a dict")
    user = request.get("userInfo") or {}
    if not isinstance(user, dict):
        raise MalformedReviewError("request.userInfo must be an object")
    groups = user.get("groups") or []
    if type(groups) is not list:
        raise MalformedReviewError("request.userInfo.groups must be a list of strings")
    for group in groups:
        if type(group) is not str:
            raise MalformedReviewError("request.userInfo.groups must be a list of strings")
    obj = request.get("object")
    old = request.get("oldObject")
    if obj is not None and type(obj) is not dict:
        raise MalformedReviewError("request.object must be an object or null")
    if old is not None and type(old) is not dict:
        raise MalformedReviewError("request.oldObject must be an object or null")
    if not isinstance(request.get("dryRun", False), bool):
        raise MalformedReviewError("request.dryRun must be a boolean")
    # Optional strings: absent or null read as "".
    for key in _RESOURCE_TEXTS:
        value = resource.get(key)
        if value is not None and type(value) is not str:
            raise MalformedReviewError(f"request.resource.{key} must be a string")
    for key in _REQUEST_TEXTS:
        value = request.get(key)
        if value is not None and type(value) is not str:
            raise MalformedReviewError(f"request.{key} must be a string")
    value = user.get("username")
    if value is not None and type(value) is not str:
        raise MalformedReviewError("request.userInfo.username must be a string")
    return cast(AdmissionReviewRequest, doc)


def parse_review(body: bytes | str) -> AdmissionRequest:
    """Parse the bytes of an HTTP body into an :class:`AdmissionRequest`.

    Raises :class:`NotJSONError` when the body is not JSON, and what :func:`check_review` raises when it is not a
    usable AdmissionReview v1 (all :class:`ReviewError`, answered with HTTP 400).
    """
    try:
        doc = decode_json(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, an integer over 4300 digits
        raise NotJSONError(f"body is not JSON: {exc}") from None
    request = check_review(doc)["request"]
    resource = request["resource"]
    user = request.get("userInfo") or {}
    return AdmissionRequest(
        uid=request["uid"],
        operation=request["operation"],
        group=resource.get("group") or "",
        version=resource.get("version") or "",
        resource=resource.get("resource") or "",
        sub_resource=request.get("subResource") or "",
        name=request.get("name") or "",
        username=user.get("username") or "",
        groups=tuple(user.get("groups") or ()),
        dry_run=request.get("dryRun", False),
        object=request.get("object"),
        old_object=request.get("oldObject"),
    )


def peek_uid(body: bytes | str) -> str | None:
    """Best-effort ``request.uid`` of a body that failed :func:`parse_review`, for error logs; never raises."""
    try:
        doc = json.loads(body)
        uid = doc["request"]["uid"]
        return uid if isinstance(uid, str) else None
    except Exception:
        return None


def clean_warning(text: str) -> str:
    """Make ``text`` a valid AdmissionResponse warning: one line, at most 256 characters."""
    line = " ".join(text.split())
    if len(line) > MAX_WARNING_LENGTH:
        line = line[: MAX_WARNING_LENGTH - 3] + "..."
    return line


class AdmissionResponse(NamedTuple):
    """What the webhook answers, before it is put in the envelope.

    ``status_code``/``reason``/``message`` fill ``response.status`` when not allowed (403 Forbidden for a
    policy denial, 400 BadRequest for an unusable request). ``patch`` is a list of RFC 6902 operations, only
    for /mutate. ``audit_annotations`` keys must not contain ``/``.
    """

    allowed: bool
    status_code: int = 200
    reason: str = ""
    message: str = ""
    warnings: Sequence[str] = ()
    patch: Sequence[Mapping[str, Any]] = ()
    audit_annotations: Mapping[str, str] = MappingProxyType({})


def dumps_compact(value: Any) -> bytes:
    """Compact JSON bytes (orjson; ``json`` for what orjson refuses: lone surrogates, integers beyond 64 bits).

    Used for the patch and, by the server, for every HTTP answer.
    """
    if orjson is not None:
        try:
            return orjson.dumps(value)
        except orjson.JSONEncodeError:
            pass
    return json.dumps(value, separators=(",", ":")).encode()


def build_response(uid: str, response: AdmissionResponse, *, allow_patch: bool) -> AdmissionReviewResponse:
    """Build the AdmissionReview JSON document answering request ``uid``.

    Always echoes ``apiVersion``, ``kind`` and ``response.uid``. ``patch``/``patchType`` are present only when
    ``allow_patch`` (the /mutate endpoint) and the patch is not empty; a validating webhook must not return a
    patch. Warnings are cleaned to one line of at most 256 characters, de-duplicated in order, and at most
    ``MAX_WARNINGS`` (the last then counts the others).
    """
    body: AdmissionResponseWire = {"uid": uid, "allowed": response.allowed}
    if not response.allowed:
        body["status"] = {
            "code": response.status_code,
            "reason": response.reason,
            "message": response.message,
        }
    warnings: list[str] = []
    seen: set[str] = set()
    for w in response.warnings:
        cleaned = clean_warning(w)
        if cleaned and cleaned not in seen:
            seen.add(cleaned)
            warnings.append(cleaned)
    if len(warnings) > MAX_WARNINGS:
        rest = len(warnings) - MAX_WARNINGS + 1
        warnings[MAX_WARNINGS - 1 :] = [f"... and {rest} more warnings (the audit log has each)"]
    if warnings:
        body["warnings"] = warnings
    if response.audit_annotations:
        for key in response.audit_annotations:
            if "/" in key:
                raise ValueError(f"audit annotation key {key!r} must not contain '/'")
        body["auditAnnotations"] = dict(response.audit_annotations)
    if allow_patch and response.allowed and response.patch:
        raw = dumps_compact(list(response.patch))
        body["patchType"] = "JSONPatch"
        body["patch"] = base64.b64encode(raw).decode("ascii")
    return {"apiVersion": API_VERSION, "kind": KIND, "response": body}
