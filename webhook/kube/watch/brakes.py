"""The watch cache's side of the brakes' record (:mod:`webhook.kube.brakes` writes it): the parser that keeps the
ConfigMap :data:`~webhook.admission.brake.BRAKES_OBJECT` only with a record that verifies under the state key, and
an approver's release request found on it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from webhook.admission.brake import (
    BRAKES_OBJECT,
    RECORD_KEY,
    RELEASE_ANNOTATION,
    ReleaseRequest,
    decode_brakes,
    parse_release_request,
)
from webhook.admission.cluster import Brake
from webhook.admission.state import StateKeys


class BrakeBook(NamedTuple):
    """The brakes' ConfigMap as read: ``brakes`` by driver (empty when it holds no verified record), ``release``
    an approver's pending request (None: none), ``resource_version`` the object's."""

    brakes: Mapping[str, Brake]
    release: ReleaseRequest | None
    resource_version: str


def make_brakes_parser(keys: StateKeys) -> Callable[[Mapping[str, Any]], BrakeBook | None]:
    """``parse(configmap) -> BrakeBook | None`` for the watch cache: None for any other ConfigMap; a record that does
    not verify (edited, forged) reads as no brakes at all."""

    def parse(obj: Mapping[str, Any]) -> BrakeBook | None:
        meta = obj.get("metadata")
        if not isinstance(meta, Mapping) or meta.get("name") != BRAKES_OBJECT:
            return None
        data = obj.get("data")
        value = data.get(RECORD_KEY) if isinstance(data, Mapping) else None
        brakes = decode_brakes(value if isinstance(value, str) else None, keys) or {}
        annotations = meta.get("annotations")
        raw = annotations.get(RELEASE_ANNOTATION) if isinstance(annotations, Mapping) else None
        version = meta.get("resourceVersion")
        return BrakeBook(
            brakes,
            parse_release_request(raw if isinstance(raw, str) else None),
            version if isinstance(version, str) else "",
        )

    return parse
