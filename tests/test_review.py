"""AdmissionReview v1 on the wire: parsing requests and building responses (webhook.admission.review)."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import pytest
from kube import EBS, KUBELET, NODE, NODE_GROUPS, base_csinode, kubelet_update, review

from webhook.admission.review import (
    API_VERSION,
    KIND,
    MAX_WARNING_LENGTH,
    AdmissionResponse,
    MalformedReviewError,
    NotJSONError,
    ReviewError,
    UnsupportedVersionError,
    build_response,
    check_review,
    clean_warning,
    parse_review,
    peek_uid,
)
from webhook.serving.app import REVIEW_ERROR_STATUS, review_error_status

UID = "705ab4f5-6393-11e8-b7cc-42010a800002"


def kubelet_put(**kwargs: Any) -> dict[str, Any]:
    stored = kubelet_update(base_csinode(), EBS, 25)
    return review(stored, kubelet_update(stored, EBS, 23), uid=UID, **kwargs)


def edited(change: Callable[[dict[str, Any]], object]) -> str:
    doc = kubelet_put()
    change(doc)
    return json.dumps(doc)


# -- parse_review --------------------------------------------------------------------------------------------------


def test_parse_review_reads_a_kubelet_put_as_the_apiserver_sends_it() -> None:
    body = kubelet_put()

    request = parse_review(json.dumps(body).encode())

    assert request.uid == UID
    assert request.operation == "UPDATE"
    assert (request.group, request.version, request.resource, request.sub_resource) == (
        "storage.k8s.io",
        "v1",
        "csinodes",
        "",
    )
    assert request.name == NODE
    assert request.username == KUBELET
    assert request.groups == tuple(NODE_GROUPS)
    assert request.dry_run is False
    assert request.object == body["request"]["object"]
    assert request.old_object == body["request"]["oldObject"]
    assert request.is_csinode is True
    assert request.api_version == API_VERSION


def test_parse_review_accepts_text_as_well_as_bytes() -> None:
    body = json.dumps(kubelet_put())
    assert parse_review(body) == parse_review(body.encode())


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param(json.dumps(kubelet_put(dry_run=True)), True, id="dryRun true is read"),
        pytest.param(edited(lambda d: d["request"].pop("dryRun")), False, id="an absent dryRun is false"),
    ],
)
def test_parse_review_reads_the_dry_run_flag(body: str, expected: bool) -> None:
    assert parse_review(body).dry_run is expected


@pytest.mark.parametrize(
    ("body", "operation", "has_old", "has_new"),
    [
        pytest.param(
            json.dumps(review(None, base_csinode(), operation="CREATE")), "CREATE", False, True, id="a CREATE"
        ),
        pytest.param(
            json.dumps(review(base_csinode(), None, operation="DELETE", user="system:serviceaccount:kube-system:gc")),
            "DELETE",
            True,
            False,
            id="a DELETE",
        ),
    ],
)
def test_parse_review_accepts_null_objects(body: str, operation: str, has_old: bool, has_new: bool) -> None:
    request = parse_review(body)
    assert request.operation == operation
    assert (request.old_object is not None, request.object is not None) == (has_old, has_new)


def test_parse_review_tolerates_a_request_without_user_info() -> None:
    request = parse_review(edited(lambda d: d["request"].pop("userInfo")))
    assert (request.username, request.groups) == ("", ())


@pytest.mark.parametrize(
    ("body", "message"),
    [
        pytest.param(b"", r"^body is not JSON", id="an empty body"),
        pytest.param(b"{not json", r"^body is not JSON", id="a body that is not JSON"),
        pytest.param(b"\xff\xfe\xfa", r"^body is not JSON", id="bytes that are not text"),
        pytest.param("[" * 100_000, r"^body is not JSON", id="JSON nested too deep"),
        pytest.param("[]", r"must be a JSON object", id="a JSON list"),
        pytest.param("null", r"must be a JSON object", id="JSON null"),
        pytest.param(
            edited(lambda d: d.update(apiVersion="admission.k8s.io/v1beta1")),
            r"expected apiVersion 'admission\.k8s\.io/v1' and kind 'AdmissionReview', got 'admission\.k8s\.io/v1beta1'",
            id="an AdmissionReview v1beta1",
        ),
        pytest.param(
            edited(lambda d: d.update(kind="ConversionReview")),
            r"got 'admission\.k8s\.io/v1' and 'ConversionReview'",
            id="another kind of review",
        ),
        pytest.param(edited(lambda d: d.pop("request")), r"^AdmissionReview has no request$", id="no request"),
        pytest.param(
            edited(lambda d: d.update(request=[1])), r"^AdmissionReview has no request$", id="a request that is a list"
        ),
        pytest.param(
            edited(lambda d: d["request"].pop("uid")), r"^request\.uid must be a str$", id="a request without uid"
        ),
        pytest.param(
            edited(lambda d: d["request"].update(uid="")), r"^request\.uid must not be empty$", id="an empty uid"
        ),
        pytest.param(
            edited(lambda d: d["request"].pop("operation")),
            r"^request\.operation must be a str$",
            id="a request without operation",
        ),
        pytest.param(
            edited(lambda d: d["request"].pop("resource")),
            r"^request\.resource must be a dict$",
            id="a request without resource",
        ),
        pytest.param(
            edited(lambda d: d["request"].update(userInfo="kubelet")),
            r"^request\.userInfo must be an object$",
            id="userInfo that is a string",
        ),
        pytest.param(
            edited(lambda d: d["request"]["userInfo"].update(groups="system:nodes")),
            r"^request\.userInfo\.groups must be a list of strings$",
            id="groups that are a string",
        ),
        pytest.param(
            edited(lambda d: d["request"]["userInfo"].update(groups=["system:nodes", 7])),
            r"^request\.userInfo\.groups must be a list of strings$",
            id="groups with a number",
        ),
        pytest.param(
            edited(lambda d: d["request"].update(object="csinode")),
            r"^request\.object must be an object or null$",
            id="an object that is a string",
        ),
        pytest.param(
            edited(lambda d: d["request"].update(oldObject=[])),
            r"^request\.oldObject must be an object or null$",
            id="an oldObject that is a list",
        ),
        pytest.param(
            edited(lambda d: d["request"].update(dryRun="false")),
            r"^request\.dryRun must be a boolean$",
            id="dryRun that is a string",
        ),
    ],
)
def test_parse_review_refuses_an_unusable_body_with_http_400(body: str | bytes, message: str) -> None:
    with pytest.raises(ReviewError, match=message) as caught:
        parse_review(body)
    assert review_error_status(caught.value) == 400
    assert caught.value.message == str(caught.value)


@pytest.mark.parametrize(
    ("body", "error"),
    [
        pytest.param(b"{not json", NotJSONError, id="a body that is not JSON is NotJSONError"),
        pytest.param(b"\xff\xfe\xfa", NotJSONError, id="bytes that are not text are NotJSONError"),
        pytest.param(edited(lambda d: d.update(apiVersion="admission.k8s.io/v1beta1")), UnsupportedVersionError,
                     id="an AdmissionReview v1beta1 is UnsupportedVersionError"),
        pytest.param(edited(lambda d: d.update(kind="ConversionReview")), UnsupportedVersionError,
                     id="another kind of review is UnsupportedVersionError"),
        pytest.param("[]", MalformedReviewError, id="a JSON list is MalformedReviewError"),
        pytest.param(edited(lambda d: d.pop("request")), MalformedReviewError, id="no request is MalformedReviewError"),
        pytest.param(edited(lambda d: d["request"]["userInfo"].update(groups="system:nodes")), MalformedReviewError,
                     id="groups that are a string are MalformedReviewError"),
        pytest.param(edited(lambda d: d["request"]["resource"].update(group=1)), MalformedReviewError,
                     id="a resource group that is a number is MalformedReviewError"),
    ],
)
def test_each_way_a_body_is_unusable_has_its_error_type_and_the_server_answers_each_400(
    body: str | bytes, error: type[ReviewError]
) -> None:
    with pytest.raises(ReviewError) as caught:
        parse_review(body)
    assert type(caught.value) is error
    assert review_error_status(caught.value) == 400
    assert REVIEW_ERROR_STATUS[error] == 400


def test_the_first_fault_of_a_body_with_several_is_the_one_reported() -> None:
    def two_faults(d: dict[str, Any]) -> None:
        d["request"]["resource"]["group"] = 1
        d["request"]["object"] = "csinode"

    with pytest.raises(MalformedReviewError, match=r"^request\.object must be an object or null$"):
        parse_review(edited(two_faults))


def test_check_review_gives_the_checked_body_itself_typed() -> None:
    doc = kubelet_put()
    assert check_review(doc) is doc


def test_parse_review_error_messages_do_not_echo_long_input() -> None:
    body = edited(lambda d: d.update(apiVersion="x" * 10_000))
    with pytest.raises(ReviewError) as caught:
        parse_review(body)
    assert len(caught.value.message) < 300


@pytest.mark.parametrize(
    ("resource", "sub_resource", "is_csinode"),
    [
        pytest.param({"group": "storage.k8s.io", "version": "v1", "resource": "csinodes"}, None, True, id="csinodes"),
        pytest.param(
            {"group": "storage.k8s.io", "version": "v1", "resource": "csinodes"}, "status", False, id="a subresource"
        ),
        pytest.param(
            {"group": "storage.k8s.io", "version": "v1beta1", "resource": "csinodes"}, None, False, id="v1beta1"
        ),
        pytest.param(
            {"group": "storage.k8s.io", "version": "v1", "resource": "csidrivers"},
            None,
            False,
            id="another storage resource",
        ),
        pytest.param({"group": "", "version": "v1", "resource": "nodes"}, None, False, id="core nodes"),
    ],
)
def test_is_csinode_is_true_only_for_storage_v1_csinodes(
    resource: dict[str, str], sub_resource: str | None, is_csinode: bool
) -> None:
    def change(d: dict[str, Any]) -> None:
        d["request"]["resource"] = resource
        if sub_resource:
            d["request"]["subResource"] = sub_resource

    request = parse_review(edited(change))
    assert request.is_csinode is is_csinode
    assert request.sub_resource == (sub_resource or "")


@pytest.mark.parametrize(
    ("body", "uid"),
    [
        pytest.param(json.dumps(kubelet_put()), UID, id="a complete review"),
        pytest.param(edited(lambda d: d["request"].pop("operation")), UID, id="a review that fails to parse"),
        pytest.param('{"request": {"uid": 7}}', None, id="a uid that is not a string"),
        pytest.param("{not json", None, id="a body that is not JSON"),
        pytest.param("[]", None, id="a JSON list"),
    ],
)
def test_peek_uid_finds_the_uid_for_error_logs_and_never_raises(body: str, uid: str | None) -> None:
    assert peek_uid(body) == uid


# -- warnings ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("a short warning", "a short warning", id="a short line is kept"),
        pytest.param("two\nlines", "two lines", id="newlines become spaces"),
        pytest.param("  tabs\tand   spaces \r\n", "tabs and spaces", id="whitespace runs collapse"),
        pytest.param("x" * 256, "x" * 256, id="exactly 256 characters are kept"),
        pytest.param("x" * 300, "x" * 253 + "...", id="longer lines are cut to 256 with an ellipsis"),
    ],
)
def test_clean_warning(text: str, expected: str) -> None:
    assert clean_warning(text) == expected
    assert len(clean_warning(text)) <= MAX_WARNING_LENGTH


# -- build_response ------------------------------------------------------------------------------------------------


def test_build_response_for_a_plain_allow_has_only_uid_and_allowed() -> None:
    doc = build_response(UID, AdmissionResponse(allowed=True), allow_patch=True)

    assert doc == {"apiVersion": API_VERSION, "kind": KIND, "response": {"uid": UID, "allowed": True}}


def test_build_response_for_a_denial_carries_the_status() -> None:
    response = AdmissionResponse(
        allowed=False,
        status_code=403,
        reason="Forbidden",
        message="[count-ceiling] n/d: 25 -> 39: why; how\n[change-rate] n/d: 25 -> 39: why; how",
        audit_annotations={"decision": "deny", "rules": "count-ceiling,change-rate"},
    )

    doc = build_response(UID, response, allow_patch=True)

    assert doc["apiVersion"] == "admission.k8s.io/v1"
    assert doc["kind"] == "AdmissionReview"
    assert doc["response"] == {
        "uid": UID,
        "allowed": False,
        "status": {"code": 403, "reason": "Forbidden", "message": response.message},
        "auditAnnotations": {"decision": "deny", "rules": "count-ceiling,change-rate"},
    }


PATCH = ({"op": "add", "path": "/spec/drivers/1/allocatable/count", "value": 27},)


def test_build_response_encodes_the_patch_as_base64_json_patch_for_mutate() -> None:
    doc = build_response(UID, AdmissionResponse(allowed=True, patch=PATCH), allow_patch=True)

    body = doc["response"]
    assert set(body) == {"uid", "allowed", "patchType", "patch"}
    assert body["patchType"] == "JSONPatch"
    assert json.loads(base64.b64decode(body["patch"])) == list(PATCH)


@pytest.mark.parametrize(
    "response",
    [
        pytest.param(AdmissionResponse(allowed=True, patch=PATCH), id="an allowed response with a patch"),
        pytest.param(
            AdmissionResponse(allowed=False, status_code=403, reason="Forbidden", message="m", patch=PATCH),
            id="a denied response with a patch",
        ),
    ],
)
def test_build_response_for_validate_never_returns_a_patch(response: AdmissionResponse) -> None:
    body = build_response(UID, response, allow_patch=False)["response"]
    assert "patch" not in body
    assert "patchType" not in body


def test_build_response_never_patches_a_denial() -> None:
    response = AdmissionResponse(allowed=False, status_code=403, reason="Forbidden", message="m", patch=PATCH)
    body = build_response(UID, response, allow_patch=True)["response"]
    assert "patch" not in body
    assert "patchType" not in body


def test_build_response_leaves_out_an_empty_patch() -> None:
    body = build_response(UID, AdmissionResponse(allowed=True, patch=()), allow_patch=True)["response"]
    assert "patch" not in body
    assert "patchType" not in body


def test_build_response_cleans_and_deduplicates_warnings_in_order() -> None:
    response = AdmissionResponse(
        allowed=True, warnings=("second\nline", "first", "second line", "", "   ", "x" * 400, "first")
    )

    body = build_response(UID, response, allow_patch=True)["response"]

    assert body["warnings"] == ["second line", "first", "x" * 253 + "..."]
    assert all(len(w) <= 256 and "\n" not in w for w in body["warnings"])


def test_build_response_leaves_out_warnings_that_clean_to_nothing() -> None:
    body = build_response(UID, AdmissionResponse(allowed=True, warnings=("", " \n ")), allow_patch=True)["response"]
    assert "warnings" not in body


def test_build_response_refuses_an_audit_annotation_key_with_a_slash() -> None:
    response = AdmissionResponse(allowed=True, audit_annotations={"csinode-guard.io/decision": "allow"})
    with pytest.raises(ValueError, match="must not contain '/'"):
        build_response(UID, response, allow_patch=True)


def test_build_response_round_trips_through_json() -> None:
    response = AdmissionResponse(allowed=True, warnings=("w",), patch=PATCH, audit_annotations={"decision": "clamp"})
    doc = build_response(UID, response, allow_patch=True)
    assert json.loads(json.dumps(doc)) == doc
