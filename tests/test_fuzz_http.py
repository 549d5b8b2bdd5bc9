"""Fuzzing the HTTP endpoints (hypothesis): every answer is an AdmissionReview or a 4xx JSON error, never a 5xx.

In process through the Flask app that ``serve`` runs in each worker (fast, many inputs), then a short run
against the real server over TLS (gunicorn's request parsing, keep-alive, the whole stack). The audit log of
both must hold nothing but whole JSON records.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.reviews import BENCH_KEY
from tests.conftest import RunningServer
from tests.fuzzing import FUZZ, bodies, check_http_answer, request_uid
from webhook.admission.cluster import UnknownClusterView
from webhook.admission.state import StateKeys
from webhook.serving.app import Runtime, create_app
from webhook.serving.audit_writer import AuditWriter
from webhook.serving.live_policy import PolicyStore

PATHS = ["/mutate?timeout=10s", "/validate?timeout=10s", "/mutate", "/healthz", "/readyz", "/nothing-here",
         "/mutate/../validate", "/%ff", "/validate?timeout=10s&timeout=x"]
CONTENT_TYPES = ["application/json", "application/json; charset=utf-8", "APPLICATION/JSON", "text/plain", "",
                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/json; x"]
METHODS = ["POST", "POST", "POST", "GET", "PUT", "DELETE", "PATCH", "OPTIONS"]


@pytest.fixture(scope="module")
def client() -> Iterator[tuple[FlaskClient, Path]]:
    """The worker's Flask app with the bundled policy, an offline cluster view and a file audit log."""
    directory = Path(tempfile.mkdtemp(prefix="fuzz-http-"))
    audit = directory / "audit.log"
    runtime = Runtime(policies=PolicyStore(None), cluster=UnknownClusterView(), keys=StateKeys([BENCH_KEY]),
                      audit=AuditWriter(str(audit)), max_body_bytes=64 * 1024)
    yield create_app(runtime).test_client(), audit


@FUZZ
@given(bodies(), st.sampled_from(PATHS), st.sampled_from(CONTENT_TYPES), st.sampled_from(METHODS))
def test_the_app_answers_any_request_with_a_review_or_a_json_4xx(
    client: tuple[FlaskClient, Path], body: bytes, path: str, content_type: str, method: str
) -> None:
    flask_client, _ = client
    headers = {"Content-Type": content_type} if content_type else {}
    answer = flask_client.open(path, method=method, data=body, headers=headers)
    check_http_answer(answer.status_code, answer.content_type or "", answer.data, path=path,
                      uid=request_uid(body))


def test_the_audit_log_of_the_fuzzed_app_is_whole_json_lines(client: tuple[FlaskClient, Path]) -> None:
    flask_client, audit = client
    flask_client.post("/validate", data=b"{}", headers={"Content-Type": "application/json"})
    for line in audit.read_text().splitlines():
        json.loads(line)


def test_the_served_endpoint_answers_fuzzed_requests_with_a_review_or_a_json_4xx(server_factory: Any) -> None:
    server: RunningServer = server_factory("--max-body-bytes", "65536")
    pool = server.client()
    sample = st.tuples(bodies(), st.sampled_from(PATHS), st.sampled_from(CONTENT_TYPES), st.sampled_from(METHODS))

    @FUZZ
    @given(sample)
    def one(request: tuple[bytes, str, str, str]) -> None:
        body, path, content_type, method = request
        headers = {"Content-Type": content_type} if content_type else {}
        answer = pool.request(method, path, body=body, headers=headers)
        check_http_answer(answer.status, answer.headers.get("Content-Type", ""), answer.data, path=path,
                          uid=request_uid(body))

    one()
    assert server.get("/healthz").status == 200
    log = server.stderr_path.read_text()
    assert "Traceback" not in log and "evaluation failed" not in log
    for line in server.audit_log.read_text().splitlines():
        json.loads(line)


@pytest.mark.parametrize("path", ["/mutate", "/validate", "/healthz"])
def test_options_gets_a_json_405_not_flasks_automatic_answer(client: tuple[FlaskClient, Path], path: str) -> None:
    answer = client[0].options(path)
    assert answer.status_code == 405 and answer.json == {"error": answer.json["error"], "code": 405}
