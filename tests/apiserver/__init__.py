"""A local Kubernetes API server for tests: the real ``kubernetes`` client (or any HTTP client) talks to it.

Typical use::

    with FakeApiServer() as server:
        server.load_dir("tests/data/cluster")
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        ...                                   # point the code under test at kubeconfig
        server.inject_gone("volumeattachments")   # or drop_watches / set_offline / hang / fail_next / compact

See :mod:`tests.apiserver.server` for the wire semantics and every fault it can inject.
"""

from .resources import BUILTIN_RESOURCES, Resource
from .selectors import parse_field_selector, parse_label_selector
from .server import ApiError, FakeApiServer, RecordedRequest, json_patch, merge_patch, status_object

__all__ = [
    "BUILTIN_RESOURCES",
    "ApiError",
    "FakeApiServer",
    "RecordedRequest",
    "Resource",
    "json_patch",
    "merge_patch",
    "parse_field_selector",
    "parse_label_selector",
    "status_object",
]
