"""Driver and kubelet version comparison, as Kubernetes and CSI drivers tag versions.

``v1.37.0``, ``1.37``, ``v1.34.2-eks-1a2b3c`` all parse: a leading ``v`` is dropped, missing minor/patch are 0,
and what follows ``-`` is a semver pre-release, as k8s.io/apimachinery/pkg/util/version ParseSemantic treats it
(so ``v1.34.2-eks-1a2b3c`` sorts below ``v1.34.2`` and above ``v1.34.1``). Build metadata (``+...``) is ignored.
"""

from __future__ import annotations

import functools

import semver


class VersionError(ValueError):
    """A version string that does not parse as a (Kubernetes-style) semantic version."""


@functools.lru_cache(maxsize=1024)
def parse_version(text: str) -> semver.Version:
    """Parse ``text`` into a :class:`semver.Version`; raises :class:`VersionError` when it cannot."""
    raw = text.strip()
    if raw[:1] in ("v", "V"):
        raw = raw[1:]
    try:
        return semver.Version.parse(raw, optional_minor_and_patch=True).replace(build=None)
    except (ValueError, TypeError) as exc:
        raise VersionError(f"not a semantic version: {text!r}") from exc


def compare_versions(a: str, b: str) -> int:
    """-1, 0 or 1 as ``a`` is older than, equal to or newer than ``b``; raises :class:`VersionError`."""
    return parse_version(a).compare(parse_version(b))


def is_valid_version(text: str) -> bool:
    """True when ``text`` parses with :func:`parse_version`."""
    try:
        parse_version(text)
    except VersionError:
        return False
    return True
