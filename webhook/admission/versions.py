"""Driver and kubelet version comparison, as Kubernetes and CSI drivers tag versions.

``v1.37.0``, ``1.37``, ``v1.34.2-eks-1a2b3c`` all parse: a leading ``v`` is dropped, missing minor/patch are 0.

What follows ``-`` is one of two things. A real pre-release (``-alpha.1``, ``-beta.2``, ``-rc.1``, ``-pre``,
``-dev``) sorts below its release, as SemVer and k8s.io/apimachinery/pkg/util/version do. A vendor build suffix
(``-eks-1a2b3c`` on EKS kubelets, ``-eksbuild.1`` on EKS add-ons, ``-gke.1200`` on GKE) is a build *of* that
release: it compares equal to the release and to other builds of it. Strict SemVer would put
``v1.37.0-eksbuild.1`` below ``minVersion: v1.37.0`` and call a new EKS build with a lower hash a version
rollback, both false alarms that would freeze counts. Build metadata (``+...``) is ignored.
"""

from __future__ import annotations

import functools

import semver


class VersionError(ValueError):
    """A version string that does not parse as a (Kubernetes-style) semantic version."""


MAX_VERSION_LENGTH = 128
"""Characters a version string may have (``v1.34.2-eks-1a2b3c`` has 18): a longer one is not a version, and
the remembered results below must not keep request-sized strings (bounded in count *and* bytes)."""


def parse_version(text: str) -> semver.Version:
    """Parse ``text`` into a :class:`semver.Version`; raises :class:`VersionError` when it cannot (also for
    more than :data:`MAX_VERSION_LENGTH` characters)."""
    if len(text) > MAX_VERSION_LENGTH:
        raise VersionError(f"not a semantic version: longer than {MAX_VERSION_LENGTH} characters")
    return _parse_version(text)


@functools.lru_cache(maxsize=1024)
def _parse_version(text: str) -> semver.Version:
    raw = text.strip()
    if raw[:1] in ("v", "V"):
        raw = raw[1:]
    try:
        parsed = semver.Version.parse(raw, optional_minor_and_patch=True).replace(build=None)
    except (ValueError, TypeError) as exc:
        raise VersionError(f"not a semantic version: {text!r}") from exc
    if parsed.prerelease and not is_prerelease_tag(parsed.prerelease):
        return parsed.replace(prerelease=None)
    return parsed


PRERELEASE_TAGS = ("alpha", "beta", "rc", "pre", "dev", "snapshot")


def is_prerelease_tag(prerelease: str) -> bool:
    """True when a ``-suffix`` is a real pre-release (alpha, beta, rc, pre, dev, snapshot), not a vendor build."""
    first = prerelease.lower().replace("-", ".").split(".", 1)[0]
    return first.startswith(PRERELEASE_TAGS)


def compare_versions(a: str, b: str) -> int:
    """-1, 0 or 1 as ``a`` is older than, equal to or newer than ``b``; raises :class:`VersionError`.

    Remembered per pair (a cluster runs a handful of driver versions; every review compares them again).
    """
    if len(a) > MAX_VERSION_LENGTH or len(b) > MAX_VERSION_LENGTH:
        raise VersionError(f"not a semantic version: longer than {MAX_VERSION_LENGTH} characters")
    return _compare_versions(a, b)


@functools.lru_cache(maxsize=4096)
def _compare_versions(a: str, b: str) -> int:
    return parse_version(a).compare(parse_version(b))


def is_valid_version(text: str) -> bool:
    """True when ``text`` parses with :func:`parse_version`."""
    try:
        parse_version(text)
    except VersionError:
        return False
    return True
