"""Driver and kubelet versions compare as Kubernetes and CSI drivers tag them (webhook.admission.versions)."""

from __future__ import annotations

import pytest

from webhook.admission.versions import VersionError, compare_versions, is_valid_version, parse_version


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("v1.37.0", (1, 37, 0, None), id="a leading v is dropped"),
        pytest.param("V2.1.0", (2, 1, 0, None), id="a leading capital V is dropped too"),
        pytest.param("1.37", (1, 37, 0, None), id="a missing patch is 0"),
        pytest.param("v2", (2, 0, 0, None), id="a missing minor and patch are 0"),
        pytest.param("v1.34.2-eks-1a2b3c", (1, 34, 2, None), id="a vendor suffix is a build of the release"),
        pytest.param("v1.37.0-eksbuild.1", (1, 37, 0, None), id="an EKS add-on build is a build of the release"),
        pytest.param("v1.31.1-gke.1200", (1, 31, 1, None), id="a GKE build is a build of the release"),
        pytest.param("v1.38.0-beta.1", (1, 38, 0, "beta.1"), id="a beta stays a pre-release"),
        pytest.param("v1.30.0-rc.1+build.7", (1, 30, 0, "rc.1"), id="build metadata is ignored"),
        pytest.param("  v1.2.3 ", (1, 2, 3, None), id="surrounding whitespace is ignored"),
    ],
)
def test_parse_version_reads_kubernetes_style_tags(text: str, expected: tuple[int, int, int, str | None]) -> None:
    parsed = parse_version(text)
    assert (parsed.major, parsed.minor, parsed.patch, parsed.prerelease) == expected
    assert parsed.build is None


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("", id="an empty string"),
        pytest.param("v", id="a lone v"),
        pytest.param("latest", id="a floating tag"),
        pytest.param("v1.2.3.4", id="four components"),
        pytest.param("01.2.3", id="a leading zero"),
        pytest.param("1.2.3-01", id="a numeric pre-release with a leading zero"),
        pytest.param("sha256:4f0c2e1d", id="an image digest"),
    ],
)
def test_parse_version_refuses_what_is_not_a_version(text: str) -> None:
    with pytest.raises(VersionError, match="not a semantic version"):
        parse_version(text)
    assert is_valid_version(text) is False


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        pytest.param("v1.37.0", "v1.37.0", 0, id="equal versions compare equal"),
        pytest.param("v1.37", "1.37.0", 0, id="a missing patch equals patch 0 and v does not matter"),
        pytest.param("v1.30.0", "v1.37.0", -1, id="an older minor is older"),
        pytest.param("v1.10.0", "v1.9.9", 1, id="components compare as numbers not as text"),
        pytest.param("v2.0.0", "v1.99.99", 1, id="a newer major wins over everything"),
        pytest.param("v1.34.2-eks-1a2b3c", "v1.34.2", 0, id="a vendor build equals its release"),
        pytest.param("v1.34.2-eks-ffff", "v1.34.2-eks-0000", 0, id="two vendor builds of one release are equal"),
        pytest.param("v1.37.0-eksbuild.1", "v1.37.0", 0, id="an add-on build meets a minVersion of its release"),
        pytest.param("v1.37.0-rc.1", "v1.37.0", -1, id="a release candidate sorts below its release"),
        pytest.param("v1.34.2-eks-1a2b3c", "v1.34.1", 1, id="a vendor build sorts above the previous patch"),
        pytest.param("v1.0.0-alpha.1", "v1.0.0-alpha.beta", -1, id="numeric pre-release parts sort first"),
        pytest.param("v1.2.3+build.1", "v1.2.3+build.2", 0, id="build metadata never orders versions"),
    ],
)
def test_compare_versions_orders_as_kubernetes_does(a: str, b: str, expected: int) -> None:
    assert compare_versions(a, b) == expected
    assert compare_versions(b, a) == -expected


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param("latest", "v1.0.0", id="the first is not a version"),
        pytest.param("v1.0.0", "main", id="the second is not a version"),
    ],
)
def test_compare_versions_raises_version_error_for_an_unparsable_side(a: str, b: str) -> None:
    with pytest.raises(VersionError):
        compare_versions(a, b)


def test_version_error_is_a_value_error() -> None:
    assert issubclass(VersionError, ValueError)
