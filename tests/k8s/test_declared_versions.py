"""Self-declared driver versions, through the real apiserver: with ``versionSource: annotation`` only the
principals the policy names (``spec.versionReporters``, writers, justifiers) declare a version in
``csinode-guard.io/driver-versions``; the node's own kubelet can write that annotation, so its change of it is
refused like a justification from a stranger, whatever it declares (an older version, ``v9.9.9``, or none).
A reporter's declaration is recorded in the signed state with who set it, and only that counts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.k8s.controlplane import ADMIN_USER, ControlPlane, Guard, counts, fast_policy, unique

EBS = "ebs.csi.aws.com"
STATE = "csinode-guard.io/state"
VERSIONS = "csinode-guard.io/driver-versions"


def declared(csinode: dict[str, Any]) -> dict[str, Any]:
    """The state's ``declared`` map: driver -> {version, by, at}."""
    state: dict[str, Any] = json.loads(csinode["metadata"]["annotations"][STATE])
    return dict(state.get("declared") or {})


def test_the_node_cannot_declare_its_own_driver_version_and_a_reporters_declaration_counts(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    cp = control_plane
    guard: Guard = guard_factory(fast_policy(tmp_path / "policy.yaml", reporter=ADMIN_USER))
    node = unique("declare")
    cp.create_node(node)
    cp.kubelet(node, "init")
    cp.kubectl("annotate", "csinode", node, f"{VERSIONS}={json.dumps({EBS: 'v1.37.0'})}")
    cp.kubelet(node, "install", "--driver", EBS, "--node-id", "i-declare", "--max-volumes", "25")
    stored = cp.get_csinode(node)
    assert declared(stored)[EBS]["version"] == "v1.37.0"
    assert declared(stored)[EBS]["by"] == ADMIN_USER
    annotation = stored["metadata"]["annotations"][VERSIONS]

    # The node's own identity declaring a newer version, an older one, or removing the annotation: refused.
    for version in ("v9.9.9", "v1.30.0"):
        refused = cp.replace_count(node, EBS, 25, annotations={VERSIONS: json.dumps({EBS: version})}, check=False)
        assert refused.returncode != 0, f"the node declared {version} itself"
        assert "[writer-identity]" in refused.stderr and VERSIONS in refused.stderr, refused.stderr
    removed = cp.kubectl("annotate", "csinode", node, f"{VERSIONS}-", kubeconfig=cp.node_kubeconfig(node),
                         check=False)
    assert removed.returncode != 0, "the node removed the declared versions itself"
    assert "[writer-identity]" in removed.stderr, removed.stderr
    after = cp.get_csinode(node)
    assert after["metadata"]["annotations"][VERSIONS] == annotation
    assert declared(after) == declared(stored)

    # The reporter declares the rollback: recorded with who set it. The node's next increase is held at the
    # stored count (an older driver than the last accepted change freezes increases).
    cp.kubectl("annotate", "--overwrite", "csinode", node, f"{VERSIONS}={json.dumps({EBS: 'v1.30.0'})}")
    rolled = cp.get_csinode(node)
    assert (declared(rolled)[EBS]["version"], declared(rolled)[EBS]["by"]) == ("v1.30.0", ADMIN_USER)
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "26")  # succeeds: held, not refused
    assert counts(cp.get_csinode(node)) == {EBS: 25}
    [held] = [r for r in guard.decisions()
              if r.get("node") == node and r.get("endpoint") == "mutate" and r.get("new") == 26]
    assert (held["decision"], held["final"], held["writerVersion"]) == ("clamp", 25, "v1.30.0"), held
    assert any(o["rule"] == "writer-version" and o["result"] == "violation" for o in held["rules"]), held
