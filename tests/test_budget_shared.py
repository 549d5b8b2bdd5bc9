"""change-rate's clusterBudget is the replica's, not each gunicorn worker's.

``increasesPerSecond: 0.001, burst: 3``: twenty nodes' kubelets raise their EBS count for the first time, each
over a connection of its own (they spread over both workers), several at once. The replica admits exactly
three, whatever worker answers, and a retry is refused on every worker.
"""

from __future__ import annotations

import base64
import copy
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import REPO, RunningServer
from tests.kube import EBS, NODE_GROUPS, base_csinode, kubelet_update, review

NODES = 20


def budget_policy(tmp_path: Path) -> Path:
    doc = yaml.safe_load((REPO / "policies" / "default.yaml").read_text())
    doc["spec"]["rules"]["change-rate"]["clusterBudget"] = {"increasesPerSecond": 0.001, "burst": 3}
    path = tmp_path / "budget.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def first_increase(index: int) -> dict[str, Any]:
    """Node ``index``'s kubelet raising its EBS count from 20 to 22 (no state yet: its first judged write)."""
    name = f"ip-10-0-2-{index}.ec2.internal"
    old = copy.deepcopy(base_csinode())
    old["metadata"]["name"] = name
    old = kubelet_update(old, EBS, 20)
    return review(old, kubelet_update(old, EBS, 22), user=f"system:node:{name}", groups=NODE_GROUPS)


def admitted(server: RunningServer, body: dict[str, Any]) -> bool:
    """True when one /mutate over a fresh connection admits the raised count (neither refused nor clamped)."""
    pool = server.client()
    try:
        answer = pool.request("POST", "/mutate?timeout=10s", body=json.dumps(body).encode(),
                              headers={"Content-Type": "application/json"})
        assert answer.status == 200, answer.data[:300]
        response = json.loads(answer.data)["response"]
    finally:
        pool.close()
    if not response["allowed"]:
        return False
    operations = json.loads(base64.b64decode(response["patch"])) if response.get("patch") else []
    return not any(op["path"].endswith("/allocatable/count") and op.get("value") == 20 for op in operations)


def test_the_cluster_budget_is_shared_by_the_workers_of_a_replica(server_factory: Any, tmp_path: Path) -> None:
    server = server_factory("--policy", str(budget_policy(tmp_path)), workers=2,
                            env={"CSINODE_GUARD_BENCHMARK_NOOP": "1"})
    reviews = [first_increase(i) for i in range(NODES)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda body: admitted(server, body), reviews))
    assert sum(results) == 3, results
    # Retries of every write, each over a fresh connection: the budget is used up on every worker.
    retries = [admitted(server, reviews[i]) for i in range(NODES) for _ in range(2)]
    assert not any(retries), retries
    # The fresh connections did land on both workers.
    assert len(_workers(server)) == 2


def _workers(server: RunningServer, tries: int = 400) -> set[int]:
    """Worker pids answering fresh connections (POST /noop, the benchmark endpoint), until both have answered.

    The kernel hands each new connection to whichever worker accepts first; on a busy machine one worker can win
    dozens in a row, so this asks up to ``tries`` times (it stops at the second pid)."""
    pids = set()
    for i in range(tries):
        pool = server.client()
        try:
            answer = pool.request("POST", "/noop", body=json.dumps(first_increase(i)).encode(),
                                  headers={"Content-Type": "application/json"})
            pids.add(int(json.loads(answer.data)["worker"]))
        finally:
            pool.close()
        if len(pids) == 2:
            break
    return pids
