"""Record the AdmissionReviews the real kube-apiserver sends the guard, into ``tests/data/apiserver``.

``python -m tests.k8s.record_reviews [OUTDIR]`` starts a control plane (as tests/k8s does), runs the guard with
``CSINODE_GUARD_RECORD_REVIEWS_DIR`` (webhook/serving/app.py: every received review is written with its answer) on
the default policy with change-rate's ``minInterval`` at 2s and the fixed test key ``OUTDIR/state.key``, and
drives the story of tests/test_e2e.py with ``kubelet-csinode`` (kubelet's own code, as system:node:<node>) and
kubectl writes as the node. Each step's reviews are saved as ``<step>[-<try>]-<endpoint>.json``
(``{"review": ..., "answer": ...}``).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tests.k8s.controlplane import REPO, fast_policy, running_control_plane, running_guard

NODE = "ip-10-0-1-23.ec2.internal"
EBS = "ebs.csi.aws.com"
OUT = REPO / "tests" / "data" / "apiserver"


def main(out: Path = OUT) -> None:
    """Record the story's reviews into ``out`` (replacing the ``*.json`` there)."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="csinode-guard-record-") as tmp:
        work = Path(tmp)
        with running_control_plane(work / "cluster") as cp:
            record = work / "recorded"
            guard_dir = work / "guard"
            (guard_dir / "certs").mkdir(parents=True)
            shutil.copyfile(out / "state.key", guard_dir / "certs" / "state.key")
            with running_guard(cp, guard_dir, fast_policy(work / "policy.yaml"), name="csinode-guard",
                               extra_env={"CSINODE_GUARD_RECORD_REVIEWS_DIR": str(record)}) as guard:
                cp.create_node(NODE)
                cp.kubelet(NODE, "install", "--driver", "efs.csi.aws.com", "--node-id", "fs-0123456789abcdef0")
                record.mkdir(exist_ok=True)
                for p in record.iterdir():  # the registration probes
                    p.unlink()

                def step(name: str, write: Callable[[], object]) -> None:
                    before = set(record.iterdir())
                    write()
                    time.sleep(0.3)
                    new = sorted(set(record.iterdir()) - before)
                    seen: dict[str, int] = {}
                    for path in new:
                        endpoint = path.stem.rsplit("-", 1)[1]
                        seen[endpoint] = seen.get(endpoint, 0) + 1
                        suffix = f"-{seen[endpoint]}" if len(new) > 2 else ""
                        shutil.copyfile(path, out / f"{name}{suffix}-{endpoint}.json")
                    print(f"{name}: {len(new)} review(s)", file=sys.stderr)

                step("register-25", lambda: cp.kubelet(NODE, "install", "--driver", EBS, "--node-id",
                                                      "i-0a1b2c3d4e5f60718", "--max-volumes", "25"))
                step("eni-25-to-23", lambda: cp.kubelet(NODE, "update", "--driver", EBS, "--max-volumes", "23"))
                step("too-fast-24", lambda: cp.kubelet(NODE, "update", "--driver", EBS, "--max-volumes", "24",
                                                      check=False))
                time.sleep(2.2)
                step("report-39", lambda: cp.kubelet(NODE, "update", "--driver", EBS, "--max-volumes", "39"))
                time.sleep(2.2)
                step("unbounded", lambda: cp.kubelet(NODE, "update", "--driver", EBS, "--max-volumes", "0"))
                assert guard.decisions()


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
