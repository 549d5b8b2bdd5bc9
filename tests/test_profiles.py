"""Driver ceiling profiles under policies/profiles.

Each profile gives the largest allocatable count a CSI driver's NodeGetInfo can report for an
instance type, transcribed from the driver's own table (see spec.source in each file). These
tests check the file shape and a sample of values against the source lines they came from.

Lookup order, as the policy loader is meant to do it: exact `ceilings` key, then the first
matching `patterns` glob (fnmatch), then `default`. With `caseInsensitive: true` the label
value and the keys/globs are lower-cased before comparing.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

import jsonschema
import pytest
import yaml

PROFILES_DIR = Path(__file__).resolve().parent.parent / "policies" / "profiles"
PROFILE_FILES = sorted(PROFILES_DIR.glob("*.yaml"))

SHA_OR_TAG = r"^(v[0-9]+\.[0-9]+\.[0-9]+.*|[0-9a-f]{40})$"

PROFILE_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "csinode-guard.io/v1alpha1"},
        "kind": {"const": "DriverProfile"},
        "metadata": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name"],
            "properties": {"name": {"type": "string", "minLength": 1}},
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["driver", "source", "nodeLabel", "caseInsensitive", "default", "ceilings"],
            "properties": {
                "driver": {"type": "string", "minLength": 1},
                "source": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["repository", "path", "version", "notes"],
                    "properties": {
                        "repository": {"type": "string", "pattern": "^https://github\\.com/[^/]+/[^/]+$"},
                        "path": {"type": "string", "minLength": 1},
                        "version": {"type": "string", "pattern": SHA_OR_TAG},
                        "notes": {"type": "string", "minLength": 1},
                    },
                },
                "nodeLabel": {"type": "string", "minLength": 1},
                "caseInsensitive": {"type": "boolean"},
                "default": {"type": "integer", "minimum": 1},
                "ceilings": {
                    "type": "object",
                    "minProperties": 1,
                    "propertyNames": {"minLength": 1},
                    "additionalProperties": {"type": "integer", "minimum": 1},
                },
                "patterns": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["match", "ceiling"],
                        "properties": {
                            "match": {"type": "string", "minLength": 1},
                            "ceiling": {"type": "integer", "minimum": 1},
                        },
                    },
                },
            },
        },
    },
}


def load(name: str) -> dict:
    with open(PROFILES_DIR / f"{name}.yaml", encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def ceiling(profile: dict, label: str) -> int:
    """Reference lookup: exact key, then first matching glob, then the default."""
    spec = profile["spec"]
    fold = (lambda s: s.lower()) if spec["caseInsensitive"] else (lambda s: s)
    value = fold(label)
    exact = {fold(k): v for k, v in spec["ceilings"].items()}
    if value in exact:
        return exact[value]
    for rule in spec.get("patterns") or []:
        if fnmatch.fnmatchcase(value, fold(rule["match"])):
            return rule["ceiling"]
    return spec["default"]


# ---------------------------------------------------------------- shape, every file


def test_the_three_driver_profiles_exist():
    assert {p.stem for p in PROFILE_FILES} >= {
        "ebs.csi.aws.com",
        "pd.csi.storage.gke.io",
        "disk.csi.azure.com",
    }


@pytest.mark.parametrize("path", PROFILE_FILES, ids=lambda p: p.stem)
def test_profile_matches_schema(path: Path):
    with open(path, encoding="utf-8") as fh:
        doc = yaml.safe_load(fh)
    jsonschema.validate(doc, PROFILE_SCHEMA)
    # bool is an int subclass in Python; the schema's "integer" must not let true/false through.
    spec = doc["spec"]
    values = [spec["default"], *spec["ceilings"].values(), *(r["ceiling"] for r in spec.get("patterns") or [])]
    assert all(type(v) is int for v in values)


@pytest.mark.parametrize("path", PROFILE_FILES, ids=lambda p: p.stem)
def test_name_is_file_stem_and_driver(path: Path):
    with open(path, encoding="utf-8") as fh:
        doc = yaml.safe_load(fh)
    assert doc["metadata"]["name"] == path.stem
    assert doc["spec"]["driver"] == path.stem


@pytest.mark.parametrize("path", PROFILE_FILES, ids=lambda p: p.stem)
def test_keys_unique_under_the_profiles_case_rule(path: Path):
    with open(path, encoding="utf-8") as fh:
        doc = yaml.safe_load(fh)
    spec = doc["spec"]
    keys = list(spec["ceilings"])
    if spec["caseInsensitive"]:
        assert all(k == k.lower() for k in keys), "case-insensitive profiles store lower-case keys"
        keys = [k.lower() for k in keys]
    assert len(keys) == len(set(keys))
    matches = [r["match"] for r in spec.get("patterns") or []]
    assert len(matches) == len(set(matches))


def test_duplicate_yaml_keys_would_not_go_unnoticed():
    # PyYAML keeps the last of two equal keys silently; count the raw key lines instead.
    for path in PROFILE_FILES:
        lines = path.read_text(encoding="utf-8").splitlines()
        start = lines.index("  ceilings:") + 1
        keys = []
        for line in lines[start:]:
            if not line.startswith("    ") or line.startswith("    -") or line.startswith("    #"):
                break
            keys.append(line.strip().split(":")[0])
        assert len(keys) == len(load(path.stem)["spec"]["ceilings"]), path.stem


# ---------------------------------------------------------------- EBS
# kubernetes-sigs/aws-ebs-csi-driver, pkg/cloud/limits/volume_limits_table.go @ 1a42de62,
# pkg/cloud/limits/volume_limits.go @ 03352d57.


@pytest.fixture(scope="module")
def ebs():
    return load("ebs.csi.aws.com")


def test_ebs_default_is_the_shared_nitro_fallback(ebs):
    # volume_limits.go, GetVolumeLimits: `// Default to shared limit of 27` / `return 27, util.AttachmentShared`
    assert ebs["spec"]["default"] == 27
    assert ceiling(ebs, "m6i.large") == 27  # Nitro type absent from the table: shared default
    assert ceiling(ebs, "no-such.type") == 27


@pytest.mark.parametrize(
    "instance_type, expected",
    [
        ("m7i.48xlarge", 128),  # `"m7i.48xlarge":        {128, "dedicated"},`
        ("c7a.32xlarge", 88),  # `"c7a.32xlarge":        {88, "dedicated"},`
        ("m7i.metal-24xl", 39),  # `"m7i.metal-24xl":      {39, "dedicated"},`
        ("c8gb.metal-48xl", 78),  # `"c8gb.metal-48xl":     {78, "dedicated"},`
        ("p5.48xlarge", 64),  # `"p5.48xlarge":         {64, "dedicated"},`
        ("hpc7a.96xlarge", 27),  # `"hpc7a.96xlarge":      {27, "dedicated"},`
        ("c5d.24xlarge", 23),  # `"c5d.24xlarge":        {23, "shared"},`
        ("d3.8xlarge", 3),  # `"d3.8xlarge":          {3, "shared"},`
        ("g5.48xlarge", 9),  # `"g5.48xlarge":         {9, "shared"},`
        ("mac-m4max.metal", 10),  # `"mac-m4max.metal":     {10, "shared"},`
        ("c5.metal", 31),  # `"c5.metal":            {31, "shared"},`
        ("x8i.metal-96xl", 79),  # `"x8i.metal-96xl":      {79, "shared"},` (dedicatedInstances -> dedicated)
    ],
)
def test_ebs_table_values(ebs, instance_type, expected):
    assert ceiling(ebs, instance_type) == expected


@pytest.mark.parametrize("instance_type", ["t2.micro", "m4.large", "c4.8xlarge", "x1e.32xlarge"])
def test_ebs_non_nitro_types_are_39(ebs, instance_type):
    # volume_limits.go: `if _, exists := nonNitroInstanceTypes[instanceType]; exists { return 39, ...`
    assert ceiling(ebs, instance_type) == 39


def test_ebs_table_size_and_largest_value(ebs):
    ceilings = ebs["spec"]["ceilings"]
    # 782 volumeLimits entries + 80 nonNitroInstanceTypes entries in the source tables.
    assert len(ceilings) == 862
    assert max(ceilings.values()) == 128
    assert not ebs["spec"].get("patterns")


def test_ebs_is_case_sensitive(ebs):
    assert ebs["spec"]["caseInsensitive"] is False
    assert ceiling(ebs, "M7I.48XLARGE") == 27


# ---------------------------------------------------------------- GCE PD
# kubernetes-sigs/gcp-compute-persistent-disk-csi-driver: pkg/gce-pd-csi-driver/node.go
# (`volumeLimitSmall int64 = 15`, `volumeLimitBig int64 = 127`, smallMachineTypes) and
# pkg/constants/constants.go @ 0b39ae29 (*MachineHyperdiskAttachLimitMap); expectations marked
# "node_test" are rows of TestNodeGetVolumeLimits in pkg/gce-pd-csi-driver/node_test.go.

# Copied from pkg/constants/constants.go: (Max vCPUs, Value).
GEN4_LIMITS = {
    "c4": [(2, 7), (4, 15), (24, 31), (48, 63), (96, 127)],  # C4MachineHyperdiskAttachLimitMap
    "c4d": [(2, 3), (4, 7), (8, 15), (96, 31), (192, 63), (384, 127)],  # C4DMachineHyperdiskAttachLimitMap
    "n4": [(8, 15), (80, 31)],  # N4MachineHyperdiskAttachLimitMap
    "n4d": [(8, 15), (96, 31)],  # N4DMachineHyperdiskAttachLimitMap
    "c4a": [(2, 7), (8, 15), (48, 31), (72, 63)],  # C4AMachineHyperdiskAttachLimitMap
    "n4a": [(8, 15), (64, 31)],  # N4AMachineHyperdiskAttachLimitMap
}


def map_number(vcpus: int, limit_map: list[tuple[int, int]]) -> int:
    """pkg/common/utils.go MapNumber: first bucket with vCPUs <= Max, else the last Value."""
    for maximum, value in limit_map:
        if vcpus <= maximum:
            return value
    return limit_map[-1][1]


@pytest.fixture(scope="module")
def gce():
    return load("pd.csi.storage.gke.io")


def test_gce_default_is_volume_limit_big(gce):
    # node.go: `volumeLimitBig       int64 = 127`
    assert gce["spec"]["default"] == 127


@pytest.mark.parametrize("machine_type", ["e2-micro", "e2-small", "e2-medium", "f1-micro", "g1-small"])
def test_gce_shared_core_types_are_15(gce, machine_type):
    # node.go: `smallMachineTypes := []string{"f1-micro", "g1-small", "e2-micro", "e2-small", "e2-medium"}`
    #          -> `return volumeLimitSmall, nil` (`volumeLimitSmall     int64 = 15`)
    assert ceiling(gce, machine_type) == 15


@pytest.mark.parametrize(
    "machine_type, expected",
    [
        ("n1-standard-1", 127),  # node_test: expVolumeLimit: volumeLimitBig
        ("custom-2-4096", 127),  # node_test
        ("c4-standard-192", 127),  # node_test
        ("c4-standard-48", 63),  # node_test
        ("c4-standard-2", 7),  # node_test
        ("c4a-standard-4", 15),  # node_test
        ("n4-standard-16", 31),  # node_test
        ("n4-micro", 127),  # node_test (unparsable, expectError, volumeLimitBig)
        ("n4-highcpu-4", 15),  # node_test
        ("n4-custom-8-12345-ext", 15),  # node_test
        ("n4-custom-16-12345", 31),  # node_test
        ("n4-highcpu-4xyz", 127),  # node_test ("invalid gen4 machine type")
        ("c3-standard-4", 127),  # node_test
        ("c3d-highmem-8-lssd", 127),  # node_test
        ("c4a-standard-32-lssd", 31),  # node_test
        ("c4d-standard-32", 31),  # node_test
        ("a4x-highgpu-1g", 63),  # node_test
        ("a4x-highgpu-2g", 127),  # node_test
        ("a4x-highgpu-2g-nolssd", 127),  # node_test
        ("a4x-highgpu-8g", 127),  # node_test
        ("a4x-max-1g", 63),  # node_test
        ("a4x-max-2g", 127),  # node_test
        ("a4x-medgpu-nolssd", 127),  # node_test
    ],
)
def test_gce_driver_unit_test_rows(gce, machine_type, expected):
    assert ceiling(gce, machine_type) == expected


@pytest.mark.parametrize("family", sorted(GEN4_LIMITS))
def test_gce_gen4_patterns_follow_the_vcpu_maps(gce, family):
    limit_map = GEN4_LIMITS[family]
    for vcpus in range(1, 401):
        want = map_number(vcpus, limit_map)
        for machine_type in (
            f"{family}-standard-{vcpus}",
            f"{family}-highmem-{vcpus}-lssd",
            f"{family}-standard-{vcpus}-metal",
            f"{family}-custom-{vcpus}-{vcpus * 4096}",
        ):
            assert ceiling(gce, machine_type) == want, machine_type


def test_gce_family_prefixes_do_not_leak(gce):
    # "c4-*" must not catch c4a/c4d, nor "n4-*" catch n4a/n4d (issue #2351 in the driver).
    assert ceiling(gce, "c4d-standard-2") == 3
    assert ceiling(gce, "c4a-standard-2") == 7
    assert ceiling(gce, "c4-standard-2") == 7
    assert ceiling(gce, "n4d-standard-96") == 31
    assert ceiling(gce, "n4a-standard-64") == 31
    assert ceiling(gce, "c3-standard-2") == 127


def test_gce_never_above_the_default(gce):
    spec = gce["spec"]
    assert max([*spec["ceilings"].values(), *(r["ceiling"] for r in spec["patterns"])]) <= spec["default"]


# ---------------------------------------------------------------- Azure Disk
# kubernetes-sigs/azuredisk-csi-driver, pkg/azuredisk/azure_dd_max_disk_count.go @ 005d9c47
# (maxDataDiskCountMap); nodeserver.go getMaxDataDiskCount does strings.ToUpper(instanceType)
# and returns defaultAzureVolumeLimit (16) for a size missing from the map.


@pytest.fixture(scope="module")
def azure():
    return load("disk.csi.azure.com")


def test_azure_default_and_case_rule(azure):
    assert azure["spec"]["default"] == 16
    assert azure["spec"]["caseInsensitive"] is True
    assert ceiling(azure, "Standard_Unknown_v99") == 16


@pytest.mark.parametrize(
    "vm_size, expected",
    [
        ("Standard_D2s_v3", 4),  # `"STANDARD_D2S_V3":            4,`
        ("Standard_D16ds_v6", 48),  # `"STANDARD_D16DS_V6":          48,`
        ("Standard_D4s_v6", 12),  # `"STANDARD_D4S_V6":            12,`
        ("Standard_E8-4ds_v5", 32),  # `"STANDARD_E8-4DS_V5":         32,`
        ("Standard_M416s_8_v2", 64),  # `"STANDARD_M416S_8_V2":        64,`
        ("Standard_HB120rs_v2", 8),  # `"STANDARD_HB120RS_V2":        8,`
        ("Standard_NV4ads_V710_v5", 2),  # `"STANDARD_NV4ADS_V710_V5":    2,`
        ("Standard_DC1s_v2", 1),  # `"STANDARD_DC1S_V2":           1,`
        ("Basic_A0", 1),  # `"BASIC_A0":                   1,`
        ("STANDARD_PB6S", 12),  # `"STANDARD_PB6S":              12,` (upper case, as the driver compares)
    ],
)
def test_azure_table_values(azure, vm_size, expected):
    assert ceiling(azure, vm_size) == expected


def test_azure_table_size_and_largest_value(azure):
    ceilings = azure["spec"]["ceilings"]
    assert len(ceilings) == 1204  # entries in maxDataDiskCountMap
    assert max(ceilings.values()) == 64
    assert not azure["spec"].get("patterns")
