"""The guard's WSGI app behind granian, for the HTTP-front comparison in :mod:`benchmarks.apiserver` only.

``python -m benchmarks.granian_front --port P --cert-dir D --kubeconfig K --policy F --audit-log L``

granian (Rust, hyper, rustls) does the connection handling, TLS, HTTP/1.1 and HTTP/2 (offered through ALPN)
in native code and calls the same Flask app ``serve`` builds in each gunicorn worker
(:func:`webhook.serving.runtime.build_worker_app`: policy store, cluster view, audit writer, metrics, the
shared budget). Only the front differs, so a difference through the apiserver is the front's. This is a
measurement harness, not a supported way to serve: it has none of ``serve``'s checks at start, and granian
loads its certificate once (no hot reload).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

SETTINGS_ENV = "CSINODE_GUARD_BENCHMARK_GRANIAN"
"""JSON of the parsed arguments, handed from the launcher to each granian worker."""


def worker_app() -> Any:
    """granian's factory (called once in each worker process): the Flask app of one ``serve`` worker."""
    from webhook.admission import state_key  # noqa: PLC0415
    from webhook.admission.state import StateKeys  # noqa: PLC0415
    from webhook.serving.gctuning import settle_for_requests  # noqa: PLC0415
    from webhook.serving.runtime import build_worker_app  # noqa: PLC0415
    from webhook.serving.settings import Settings  # noqa: PLC0415

    given = json.loads(os.environ[SETTINGS_ENV])
    cert_dir = Path(given["cert_dir"])
    settings = Settings(
        host="127.0.0.1", port=given["port"], metrics_port=0, cert_dir=cert_dir, generate_certs=False,
        policy=Path(given["policy"]), policy_reload_interval=0.5, audit_log=given["audit_log"],
        state_key_file=cert_dir / "state.key", workers=given["workers"], threads=given["threads"],
        kubeconfig=given["kubeconfig"],
    )
    keys = StateKeys(state_key.ensure_state_key(settings.state_key_path))
    budget_dir = Path(given["budget_dir"]) if given["budget_dir"] else None
    app = build_worker_app(settings, keys, cert_dir / "tls.crt", budget_dir)
    settle_for_requests()
    return app


def pkcs8_key(key_file: Path, out: Path) -> Path:
    """``key_file`` (PEM, any private key format) rewritten as PKCS#8 PEM at ``out`` (granian reads only that)."""
    from cryptography.hazmat.primitives import serialization  # noqa: PLC0415

    key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    out.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
    out.chmod(0o600)
    return out


def main(argv: list[str] | None = None) -> int:
    """Start granian with ``--workers`` processes of ``--threads`` blocking threads each; runs until SIGTERM."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.granian_front", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--cert-dir", type=Path, required=True, help="tls.crt, tls.key, state.key")
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--policy", type=Path, required=True)
    parser.add_argument("--audit-log", required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--http", choices=("auto", "1", "2"), default="auto",
                        help="auto offers h2 and http/1.1 through ALPN")
    args = parser.parse_args(argv)

    from webhook.serving.logs import setup_logging  # noqa: PLC0415
    from webhook.serving.shared_budget import prepare_budget_dir  # noqa: PLC0415
    from webhook.serving.workers import prepare_metrics_dir  # noqa: PLC0415

    setup_logging("info")
    prepare_metrics_dir()
    given = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    budget_dir = prepare_budget_dir()
    given["budget_dir"] = str(budget_dir) if budget_dir else None
    os.environ[SETTINGS_ENV] = json.dumps(given)

    from granian.constants import HTTPModes, Interfaces, SSLProtocols  # noqa: PLC0415
    from granian.server import MPServer  # noqa: PLC0415

    MPServer(
        "benchmarks.granian_front:worker_app", address="127.0.0.1", port=args.port, interface=Interfaces.WSGI,
        workers=args.workers, blocking_threads=args.threads, http=HTTPModes(args.http), factory=True,
        ssl_cert=args.cert_dir / "tls.crt", ssl_key=pkcs8_key(args.cert_dir / "tls.key",
                                                             args.cert_dir / "tls.pkcs8.key"),
        ssl_protocol_min=SSLProtocols.tls12, log_access=False,
    ).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
