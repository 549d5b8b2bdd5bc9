"""Helm for the tests: ``helm template`` and ``helm lint`` of ``charts/csinode-guard``.

The binary is Helm v3.19.4's own client-side engine (``template``, ``lint``, ``version``) shipped as
``../shared/k8s/bin/helm.xz`` next to the checkout (its README, section "helm"): unpacked once into
``~/.cache/csinode-guard/helm/<sha256>/helm`` and checked against ``bin/SHA256SUMS`` before it is used (a
mismatch is an error, never a silent fallback). ``$HELM`` names a helm binary to use instead (any Helm 3 with
``template`` and ``lint``). Without either, :class:`HelmUnavailable` says what is missing: the tests skip on it,
unless ``CSINODE_GUARD_REQUIRE_K8S=1`` (set by ``.ci/run``, as for the control plane) makes that a failure.
"""

from __future__ import annotations

import hashlib
import lzma
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "csinode-guard"
SHARED_K8S = REPO.parent / "shared" / "k8s"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "csinode-guard" / "helm"
REQUIRE_ENV = "CSINODE_GUARD_REQUIRE_K8S"


class HelmUnavailable(Exception):  # noqa: N818 - a reason, not an error: the tests skip on it
    """No helm binary was found; the message says where it was looked for."""


def _expected_sha256(sums: Path) -> str:
    """The sha256 ``bin/SHA256SUMS`` lists for ``helm`` (the uncompressed binary)."""
    for line in sums.read_text("utf-8").splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].lstrip("*") == "helm":
            return fields[0]
    raise HelmUnavailable(f"{sums} lists no helm")


def helm_binary() -> str:
    """Path of a helm binary: ``$HELM``, else ``../shared/k8s/bin/helm.xz`` unpacked and sha256-checked.

    Raises :class:`HelmUnavailable` when neither exists, and AssertionError when the unpacked binary does not
    match ``SHA256SUMS`` (a corrupt or substituted file)."""
    explicit = os.environ.get("HELM")
    if explicit:
        return explicit
    packed = SHARED_K8S / "bin" / "helm.xz"
    sums = SHARED_K8S / "bin" / "SHA256SUMS"
    if not packed.is_file() or not sums.is_file():
        raise HelmUnavailable(f"no $HELM and no {packed} (with bin/SHA256SUMS)")
    expected = _expected_sha256(sums)
    target = CACHE / expected / "helm"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        data = lzma.decompress(packed.read_bytes())
        with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as part:
            part.write(data)
        os.chmod(part.name, 0o755)
        os.replace(part.name, target)  # atomic: parallel test processes never run a half-written binary
    actual = hashlib.sha256(target.read_bytes()).hexdigest()
    assert actual == expected, f"{target}: sha256 {actual}, {sums} says {expected}"
    return str(target)


def run_helm(helm: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``helm ARGS...``; with ``check`` a non-zero exit raises AssertionError with helm's message."""
    result = subprocess.run([helm, *args], capture_output=True, text=True, timeout=120, check=False)
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} -> {result.returncode}:\n{result.stderr}{result.stdout}")
    return result


def template(helm: str, *values: str, namespace: str = "csinode-guard", release: str = "csinode-guard") -> list[Any]:
    """``helm template RELEASE charts/csinode-guard -n NAMESPACE VALUES...`` parsed into objects; ``values`` are
    helm's own flags (``--set``, ``--set-file``, ``-f``)."""
    out = run_helm(helm, "template", release, str(CHART), "-n", namespace, *values).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc is not None]


def require_helm() -> str:
    """:func:`helm_binary` for a fixture: the test is skipped when helm is absent, and fails instead with
    ``CSINODE_GUARD_REQUIRE_K8S=1`` (as CI sets it)."""
    import pytest  # noqa: PLC0415 - only fixtures call this

    try:
        return helm_binary()
    except HelmUnavailable as exc:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"helm unavailable: {exc} ({REQUIRE_ENV}=1)", pytrace=False)
        pytest.skip(f"helm unavailable: {exc}")
