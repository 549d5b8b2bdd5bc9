"""``csinode-guard serve``: run the webhook under gunicorn over TLS on its embedded default or a policy."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import click

from webhook.serving.audit_settings import AuditSettings
from webhook.serving.settings import Settings

log = logging.getLogger("csinode_guard.serve")


def _env(name: str) -> str:
    return f"CSINODE_GUARD_{name}"


@click.command()
@click.option("--host", default="0.0.0.0", show_default=True, envvar=_env("HOST"), help="Listen address.")
@click.option("--port", default=8443, show_default=True, type=click.IntRange(1, 65535), envvar=_env("PORT"),
              help="HTTPS port.")
@click.option("--reuse-port", is_flag=True, envvar=_env("REUSE_PORT"),
              help="Bind the HTTPS port with SO_REUSEPORT, so that several serve processes of the same user share "
              "one address and the kernel spreads new connections over them (each needs its own --metrics-port "
              "and --audit-log).")
@click.option("--metrics-port", default=9090, show_default=True, type=click.IntRange(0, 65535),
              envvar=_env("METRICS_PORT"), help="Plain-HTTP port for /metrics (0 disables).")
@click.option("--cert-dir", default="certs", show_default=True, type=click.Path(path_type=Path),
              envvar=_env("CERT_DIR"), help="tls.crt/tls.key (and ca.crt); dev certificates are generated here "
              "when missing.")
@click.option("--dns-name", "dns_names", multiple=True, envvar=_env("DNS_NAME"),
              help="DNS name for generated certificates (repeatable), e.g. csinode-guard.csinode-guard.svc.")
@click.option("--generate-certs/--no-generate-certs", default=True, show_default=True,
              envvar=_env("GENERATE_CERTS"), help="Generate dev certificates when missing.")
@click.option("--client-ca", type=click.Path(path_type=Path), envvar=_env("CLIENT_CA"),
              help="Require client certificates signed by this CA (the apiserver's webhook client cert).")
@click.option("--policy", type=click.Path(path_type=Path), envvar=_env("POLICY"),
              help="Policy YAML file, reloaded when it changes (default: the cluster's GuardPolicy, see "
              "--guard-policy; offline or with no cluster configured, the bundled policies/default.yaml).")
@click.option("--guard-policy", default="default", show_default=True, envvar=_env("GUARD_POLICY"), metavar="NAME",
              help="Without --policy: serve this GuardPolicy (csinode-guard.io, cluster-scoped) from the cluster, "
              "followed by a watch; the bundled default while none exists (docs/guardpolicy.md).")
@click.option("--guard-policy-recreate-after", default=60.0, show_default=True, type=click.FloatRange(0),
              envvar=_env("GUARD_POLICY_RECREATE_AFTER"), metavar="SECONDS",
              help="Seconds a deleted GuardPolicy stays gone before the guard creates it again with the policy it "
              "serves, or one that could not be created at start (the CRD applied later) is created from the "
              "bundled default (0: never). Longer than a guard's shutdown, so that an uninstall that deletes the "
              "guard and its GuardPolicy together leaves none behind (docs/guardpolicy.md).")
@click.option("--policy-reload-interval", default=5.0, show_default=True, type=click.FloatRange(0),
              envvar=_env("POLICY_RELOAD_INTERVAL"), help="Seconds between policy file checks (0 disables).")
@click.option("--audit-log", default="-", show_default=True, envvar=_env("AUDIT_LOG"),
              help="Audit log file, '-' for standard output.")
@click.option("--state-key-file", type=click.Path(path_type=Path), envvar=_env("STATE_KEY_FILE"),
              help="HMAC key file for the state annotation (one key per line, first signs); default "
              "<cert-dir>/state.key, generated for development when missing.")
@click.option("--workers", default=2, show_default=True, type=click.IntRange(1, 64), envvar=_env("WORKERS"),
              help="gunicorn worker processes.")
@click.option("--threads", default=8, show_default=True, type=click.IntRange(1, 256), envvar=_env("THREADS"),
              help="Threads per worker.")
@click.option("--max-body-bytes", default=3 * 1024 * 1024, show_default=True, type=click.IntRange(1024),
              envvar=_env("MAX_BODY_BYTES"), help="Larger AdmissionReview bodies get 413.")
@click.option("--answer-budget", default=2.0, show_default=True, type=click.FloatRange(0),
              envvar=_env("ANSWER_BUDGET"), help="Seconds from a review's first byte within which it is judged in "
              "full; past them the answer is the ceilings for registrations and the stored count for increases "
              "(never more than 40 % of the apiserver's timeout; 0: always that answer, for tests).")
@click.option("--connection-max-age", default=60.0, show_default=True, type=click.FloatRange(0),
              envvar=_env("CONNECTION_MAX_AGE"), help="Seconds before a keep-alive connection is closed after "
              "its next response (spreads the apiserver's connections over workers; 0 disables).")
@click.option("--kubeconfig", envvar=_env("KUBECONFIG"),
              help="Kubeconfig of the cluster to guard. Without it serve contacts no cluster, unless it runs in a "
              "pod (its service account); $KUBECONFIG is not read: pass --kubeconfig \"$KUBECONFIG\".")
@click.option("--offline", is_flag=True, envvar=_env("OFFLINE"), help="Do not contact the Kubernetes API.")
@click.option("--max-staleness", default=120.0, show_default=True, type=click.FloatRange(1),
              envvar=_env("MAX_STALENESS"),
              help="Seconds a cache may go without its watch before it counts as unknown.")
@click.option("--cache-sync-timeout", default=30.0, show_default=True, type=click.FloatRange(0),
              envvar=_env("CACHE_SYNC_TIMEOUT"), help="Seconds until /readyz reports ready in degraded mode.")
@click.option("--tls-secret", envvar=_env("TLS_SECRET"),
              help="Keep the serving certificate in this Secret: made (with its CA) when absent, copied into "
              "--cert-dir, renewed 30 days before expiry; replicas agree on one (deploy/: csinode-guard-tls).")
@click.option("--state-key-secret", envvar=_env("STATE_KEY_SECRET"),
              help="Keep the state key in this Secret (key 'key'): one random key made when absent, copied to "
              "--state-key-file (deploy/: csinode-guard-state-key).")
@click.option("--inject-ca-bundle", envvar=_env("INJECT_CA_BUNDLE"), metavar="NAME",
              help="Keep caBundle of the Mutating- and ValidatingWebhookConfiguration NAME on the --tls-secret "
              "CA (deploy/: csinode-guard).")
@click.option("--cluster-sync-interval", default=30.0, show_default=True, type=click.FloatRange(0.1),
              envvar=_env("CLUSTER_SYNC_INTERVAL"),
              help="Seconds between two checks of the --tls-secret, the caBundle and the validation mode.")
@click.option("--validation", type=click.Choice(("auto", "webhook", "cel")), default="auto", show_default=True,
              envvar=_env("VALIDATION"),
              help="With --inject-ca-bundle: keep the ValidatingWebhookConfiguration in one-call mode (cel) unless "
              "another mutating webhook or MutatingAdmissionPolicy matches CSINodes (auto, re-checked every 30 s), "
              "or always in webhook (two calls) or cel (docs/registration.md, One call).")
@click.option("--namespace", envvar=["CSINODE_GUARD_NAMESPACE", "POD_NAMESPACE"],
              help="Namespace of those Secrets (default: the pod's own, else csinode-guard).")
@click.option("--audit/--no-audit", "audit_enabled", default=True, show_default=True, envvar=_env("AUDIT"),
              help="Judge every stored CSINode in the background (one replica, holding the audit Lease).")
@click.option("--audit-interval", default=60.0, show_default=True, type=click.FloatRange(0),
              envvar=_env("AUDIT_INTERVAL"), help="Seconds between audit passes (also at start, after a re-list of "
              "the CSINode watch and after a policy reload; 0: only then).")
@click.option("--reconcile-dry-run", is_flag=True, envvar=_env("RECONCILE_DRY_RUN"),
              help="With spec.reconcile: clamp, send each repair as a server-side dry run (judged, not stored).")
@click.option("--reconcile-rate", default=10.0, show_default=True, type=click.FloatRange(0.01),
              envvar=_env("RECONCILE_RATE"), help="Repair writes per second at most.")
@click.option("--reconcile-burst", default=20, show_default=True, type=click.IntRange(1),
              envvar=_env("RECONCILE_BURST"), help="Repair writes at once at most.")
@click.option("--lease-namespace", default="csinode-guard", show_default=True,
              envvar=[_env("LEASE_NAMESPACE"), "POD_NAMESPACE"], help="Namespace of the audit Lease.")
@click.option("--lease-name", default="csinode-guard-audit", show_default=True, envvar=_env("LEASE_NAME"),
              help="Name of the audit Lease (coordination.k8s.io/v1).")
@click.option("--lease-duration", default=15.0, show_default=True, type=click.FloatRange(2),
              envvar=_env("LEASE_DURATION"), help="Seconds after which a leader that stopped renewing is replaced "
              "(it stops acting after two thirds of it).")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]), envvar=_env("LOG_LEVEL"))
def serve(**kwargs: Any) -> None:
    """Serve /mutate, /validate, /healthz and /readyz over TLS, and /metrics on plain HTTP.

    With no options it runs on the bundled policy with self-generated development certificates in ./certs
    (the CA to trust is certs/ca.crt), and contacts no cluster: only --kubeconfig, or running in a pod, makes it
    watch one (it then logs the server and context).
    """
    settings = Settings(
        host=kwargs["host"],
        port=kwargs["port"],
        reuse_port=kwargs["reuse_port"],
        metrics_port=kwargs["metrics_port"],
        cert_dir=kwargs["cert_dir"],
        dns_names=tuple(kwargs["dns_names"]),
        generate_certs=kwargs["generate_certs"],
        client_ca=kwargs["client_ca"],
        policy=kwargs["policy"],
        guard_policy=kwargs["guard_policy"],
        guard_policy_recreate_after=kwargs["guard_policy_recreate_after"],
        policy_reload_interval=kwargs["policy_reload_interval"],
        audit_log=kwargs["audit_log"],
        state_key_file=kwargs["state_key_file"],
        workers=kwargs["workers"],
        threads=kwargs["threads"],
        max_body_bytes=kwargs["max_body_bytes"],
        connection_max_age=kwargs["connection_max_age"],
        answer_budget=kwargs["answer_budget"],
        kubeconfig=kwargs["kubeconfig"],
        offline=kwargs["offline"],
        max_staleness=kwargs["max_staleness"],
        cache_sync_timeout=kwargs["cache_sync_timeout"],
        log_level=kwargs["log_level"],
        tls_secret=kwargs["tls_secret"] or None,
        state_key_secret=kwargs["state_key_secret"] or None,
        inject_ca_bundle=kwargs["inject_ca_bundle"] or None,
        validation=kwargs["validation"],
        cluster_sync_interval=kwargs["cluster_sync_interval"],
        namespace=kwargs["namespace"] or None,
        audit=AuditSettings(
            enabled=kwargs["audit_enabled"],
            interval=kwargs["audit_interval"],
            dry_run=kwargs["reconcile_dry_run"],
            repair_rate=kwargs["reconcile_rate"],
            repair_burst=kwargs["reconcile_burst"],
            lease_namespace=kwargs["lease_namespace"],
            lease_name=kwargs["lease_name"],
            lease_duration=kwargs["lease_duration"],
            renew_deadline=kwargs["lease_duration"] * 2 / 3,
            retry_period=min(2.0, kwargs["lease_duration"] / 5),
        ),
    )
    from webhook.serving.workers import prepare_metrics_dir  # noqa: PLC0415

    prepare_metrics_dir()  # before anything imports prometheus_client
    from webhook.serving.runtime import run  # noqa: PLC0415

    sys.exit(run(settings))


for _param in serve.params:  # every flag's environment variable shows in --help
    if isinstance(_param, click.Option):
        _param.show_envvar = True


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    serve()
