"""A real Prometheus server for the suite: the monitoring overlay's rules loaded, guards scraped as the
Prometheus Operator would scrape them (job ``csinode-guard``, labels ``namespace`` and ``pod``).

The binary is Debian's ``prometheus`` (``ci/deploy-checks.sh install`` unpacks it into
``$CSINODE_GUARD_TOOLS_DIR``); it runs on loopback with a 1 s scrape and evaluation interval. Targets come from a
``file_sd`` file that :meth:`Prometheus.scrape` rewrites, so one server (one per pytest worker) serves every test:
a target removed gets staleness markers and leaves instant queries at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.k8s.controlplane import REPO, ControlPlaneUnavailable, free_port, wait_until

RULES = REPO / "deploy" / "overlays" / "monitoring" / "prometheusrule.yaml"
JOB = "csinode-guard"
"""The ServiceMonitor's job label (``jobLabel: app.kubernetes.io/name``), which the alerts select."""


def prometheus_binary() -> str:
    """``$PROMETHEUS``, ``prometheus`` on PATH, or the one in ``$CSINODE_GUARD_TOOLS_DIR`` (default
    ``~/.cache/csinode-guard/tools/bin``); else :class:`ControlPlaneUnavailable`."""
    tools = Path(os.environ.get("CSINODE_GUARD_TOOLS_DIR") or Path.home() / ".cache/csinode-guard/tools/bin")
    for candidate in (os.environ.get("PROMETHEUS"), shutil.which("prometheus"), str(tools / "prometheus")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise ControlPlaneUnavailable("no prometheus binary (run: ci/deploy-checks.sh install)")


def rule_groups() -> list[dict[str, Any]]:
    """The ``spec.groups`` of the overlay's PrometheusRule, as a Prometheus rules file holds them."""
    for doc in yaml.safe_load_all(RULES.read_text()):
        if doc and doc.get("kind") == "PrometheusRule":
            groups: list[dict[str, Any]] = doc["spec"]["groups"]
            return groups
    raise AssertionError(f"no PrometheusRule in {RULES}")


def alert_rules() -> dict[str, dict[str, Any]]:
    """``{alert name: rule}`` of the overlay."""
    return {r["alert"]: r for g in rule_groups() for r in g["rules"] if "alert" in r}


@dataclass
class Prometheus:
    """One ``prometheus`` process on 127.0.0.1:``port`` with its config, rules and TSDB under ``dir``."""

    dir: Path
    binary: str
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    _targets: dict[str, dict[str, Any]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> None:
        """Write the config (1 s scrape and evaluation) and the rules file, start, wait for ``/-/ready``."""
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups()}, sort_keys=False))
        self._write_targets()
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(self.dir / "rules.yaml")],
            "scrape_configs": [
                {
                    "job_name": JOB,
                    "file_sd_configs": [{"files": [str(self.dir / "targets.json")], "refresh_interval": "1s"}],
                }
            ],
        }
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        with (self.dir / "prometheus.log").open("ab") as log:
            self.process = subprocess.Popen(
                [
                    self.binary, f"--config.file={self.dir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.dir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=2h", "--web.enable-lifecycle",
                ],
                stdout=log, stderr=log, start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(self.dir / 'prometheus.log').read_text()[-2000:]}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as answer:
                if answer.status == 200:
                    return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("prometheus not ready")

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 10 s."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def _write_targets(self) -> None:
        groups = [{"targets": [t["address"]], "labels": t["labels"]} for t in self._targets.values()]
        temporary = self.dir / "targets.json.tmp"
        temporary.write_text(json.dumps(groups))
        temporary.replace(self.dir / "targets.json")

    @contextlib.contextmanager
    def scrape(self, address: str, *, namespace: str, pod: str, wait: bool = True) -> Iterator[None]:
        """Scrape ``http://ADDRESS/metrics`` with labels ``namespace``, ``pod`` while inside; with ``wait``,
        return once a scrape of it succeeded. On exit the target is removed (its series go stale)."""
        with self._lock:
            self._targets[pod] = {"address": address, "labels": {"namespace": namespace, "pod": pod}}
            self._write_targets()
        try:
            if wait:
                wait_until(lambda: self.query(f'up{{job="{JOB}", pod="{pod}"}} == 1'), timeout=30,
                           what=f"prometheus scraped {pod}")
            yield
        finally:
            with self._lock:
                self._targets.pop(pod, None)
                self._write_targets()
            wait_until(lambda: not self.query(f'up{{job="{JOB}", pod="{pod}"}}'), timeout=30,
                       what=f"prometheus dropped {pod}")

    def _get(self, path: str, **params: str) -> Any:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as answer:
            body = json.loads(answer.read())
        if body.get("status") != "success":
            raise AssertionError(f"prometheus {path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query: the vector's samples (``{"metric": {...}, "value": [ts, "v"]}``)."""
        data = self._get("/api/v1/query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """A range query: ``[{"metric": {...}, "values": [[ts, "v"], ...]}, ...]``."""
        data = self._get("/api/v1/query_range", query=expr, start=str(start), end=str(end), step=str(step))
        result: list[dict[str, Any]] = data["result"]
        return result

    def alerts(self) -> list[dict[str, Any]]:
        """Active alerts (pending and firing): ``{"labels", "state", "activeAt", "value", ...}``."""
        result: list[dict[str, Any]] = self._get("/api/v1/alerts")["alerts"]
        return result

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded rule with its health, state and last evaluation."""
        return [rule for group in self._get("/api/v1/rules")["groups"] for rule in group["rules"]]

    def wait_for_alert(self, name: str, timeout: float = 60, **labels: str) -> dict[str, Any]:
        """The active alert ``name`` whose labels include ``labels`` (AssertionError after ``timeout`` s)."""

        def found() -> dict[str, Any] | None:
            for alert in self.alerts():
                if alert["labels"].get("alertname") == name and labels.items() <= alert["labels"].items():
                    return alert
            return None

        result: dict[str, Any] = wait_until(found, timeout=timeout, interval=0.5, what=f"alert {name} {labels}")
        return result

    def wait_for_series(self, expr: str, timeout: float = 30) -> list[dict[str, Any]]:
        """The non-empty answer of ``expr`` (AssertionError after ``timeout`` s)."""
        result: list[dict[str, Any]] = wait_until(lambda: self.query(expr), timeout=timeout, interval=0.5,
                                                  what=f"data for {expr}")
        return result
