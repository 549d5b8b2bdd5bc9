"""Server settings: one frozen dataclass, filled by ``csinode-guard serve`` from flags or environment."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from webhook.serving.audit_settings import AuditSettings


@dataclass(frozen=True)
class Settings:
    """Everything ``serve`` needs. Times are seconds; sizes bytes.

    Each field is a ``serve`` flag (``--cert-dir``) and an environment variable (``CSINODE_GUARD_CERT_DIR``).
    """

    host: str = "0.0.0.0"
    """Address to listen on for HTTPS."""
    port: int = 8443
    """HTTPS port for /mutate, /validate, /healthz, /readyz."""
    reuse_port: bool = False
    """Bind the HTTPS port with ``SO_REUSEPORT``: several ``serve`` processes (of the same user) listen on one
    address and the kernel spreads new connections over them."""
    metrics_port: int = 9090
    """Plain-HTTP port for /metrics (0 disables)."""
    cert_dir: Path = Path("certs")
    """Directory with tls.crt, tls.key (and ca.crt); dev certificates are generated here when missing."""
    dns_names: tuple[str, ...] = ()
    """Extra DNS names for generated serving certificates (e.g. csinode-guard.csinode-guard.svc)."""
    generate_certs: bool = True
    """Generate a dev CA and serving certificate in cert_dir when missing."""
    client_ca: Path | None = None
    """When set, require TLS client certificates signed by this CA (the apiserver's webhook client cert)."""
    policy: Path | None = None
    """Policy YAML; None = the bundled default."""
    guard_policy: str = "default"
    """Without ``policy``: the GuardPolicy (cluster-scoped custom resource) served from the cluster
    (:mod:`webhook.serving.cluster_policy`); with no cluster (offline, nothing configured) the bundled default."""
    guard_policy_recreate_after: float = 60.0
    """Seconds a deleted GuardPolicy (the one served) stays gone before the status writer creates it again with
    the policy the guard serves; 0: never (:class:`webhook.serving.cluster_policy.ClusterPolicy`)."""
    policy_reload_interval: float = 5.0
    """How often the policy file is checked for changes (hot reload), in seconds; 0 disables."""
    audit_log: str = "-"
    """Audit log path, or "-" for standard output."""
    state_key_file: Path | None = None
    """HMAC key file for the state annotation; None = <cert_dir>/state.key (generated for development)."""
    workers: int = 2
    """gunicorn worker processes."""
    threads: int = 8
    """Threads per worker (gthread)."""
    keepalive: float = 75.0
    """Idle keep-alive timeout in seconds (longer than the apiserver's idle connection timeout)."""
    connection_max_age: float = 60.0
    """Seconds after which a keep-alive connection is closed after its next response, so that the
    apiserver's few long-lived connections keep spreading over the worker processes."""
    max_body_bytes: int = 3 * 1024 * 1024
    """Largest accepted AdmissionReview body; larger ones get 413 without being read."""
    answer_budget: float = 2.0
    """Seconds, from the first byte of a request, within which the guard judges it in full; past them it answers
    with what it already knows to be safe (:mod:`webhook.admission.evaluation.hurried`). Never more than 40 % of
    the apiserver's ``timeout`` (the registered ``timeoutSeconds``, 5 s)."""
    request_timeout: float = 30.0
    """Seconds a worker may take per request before gunicorn restarts it."""
    kubeconfig: str | None = None
    """Kubeconfig for cluster lookups; in-cluster config is used when running in a pod; neither = offline."""
    offline: bool = False
    """Never contact the Kubernetes API (decisions use only what the AdmissionReview carries)."""
    max_staleness: float = 120.0
    """A cache whose watch has been down longer than this (seconds) counts as unknown."""
    cache_sync_timeout: float = 30.0
    """/readyz turns ready in degraded mode after this many seconds without a full cache sync."""
    log_level: str = "info"
    """Log level: debug, info, warning, error."""
    tls_secret: str | None = None
    """Secret (in ``namespace``) that holds the serving certificate; made when absent, copied into cert_dir,
    renewed before expiry (:mod:`webhook.serving.cluster_certs`). None: cert_dir is all there is."""
    state_key_secret: str | None = None
    """Secret (in ``namespace``) that holds the state key; made when absent, copied to the state key file."""
    inject_ca_bundle: str | None = None
    """Name of the Mutating- and ValidatingWebhookConfiguration whose caBundle the guard keeps current."""
    cluster_sync_interval: float = 30.0
    """Seconds between two checks of the serving certificate Secret, the caBundle and the validation mode."""
    validation: str = "auto"
    """How the guard keeps that ValidatingWebhookConfiguration: ``auto`` (one call unless another mutator
    matches CSINodes), ``webhook`` (two calls) or ``cel`` (one call)."""
    namespace: str | None = None
    """The guard's namespace for those Secrets; None: the pod's own (its service account's), else csinode-guard."""
    audit: AuditSettings = field(default_factory=AuditSettings)
    """The background audit and reconciler (:mod:`webhook.serving.audit_loop`)."""
    extra: dict[str, str] = field(default_factory=dict)
    """Reserved for forward-compatible options."""

    @property
    def state_key_path(self) -> Path:
        """The effective state key file."""
        return self.state_key_file or (self.cert_dir / "state.key")
