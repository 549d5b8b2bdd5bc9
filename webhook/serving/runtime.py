"""Wiring for ``serve``: checks in the master, then one :class:`webhook.serving.app.Runtime` per worker process."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
from datetime import UTC, datetime
from typing import Any

from webhook.admission.policy import PolicyError
from webhook.serving.logs import setup_logging
from webhook.serving.settings import Settings

log = logging.getLogger("csinode_guard.runtime")


def run(settings: Settings) -> int:
    """Start the server described by ``settings``; returns the process exit code.

    Fails fast (exit code 2, one clear log line) on a broken policy, missing certificates with
    ``--no-generate-certs``, an unusable state key, or a cluster configuration that cannot be loaded (a
    kubeconfig that is missing, not YAML or without a current context); it never starts half-configured.

    It contacts a cluster only when told to: ``--kubeconfig``, or inside a pod (its service account), never
    because ``$KUBECONFIG`` names one (:func:`choose_cluster`); it logs which server and context it uses.
    """
    setup_logging(settings.log_level)
    settings = choose_cluster(settings)
    from webhook.admission import state_key  # noqa: PLC0415
    from webhook.admission.state import StateKeys  # noqa: PLC0415
    from webhook.kube.kubeapi import ClusterConfigError, describe_cluster  # noqa: PLC0415
    from webhook.serving import dev_certs, ssl_context, tls  # noqa: PLC0415
    from webhook.serving.cluster_certs import ClusterSecretsError  # noqa: PLC0415
    from webhook.serving.live_policy import PolicyStore  # noqa: PLC0415
    from webhook.serving.policy_metrics import PolicyCollector  # noqa: PLC0415
    from webhook.serving.shared_budget import prepare_budget_dir  # noqa: PLC0415
    from webhook.serving.workers import GuardApplication, gunicorn_options, start_metrics_server  # noqa: PLC0415

    policy_metrics = PolicyCollector()
    try:
        settings, cluster_policy_mirror = _cluster_policy_mirror(settings)
    except ClusterConfigError as exc:
        log.error("cannot start: %s", exc)
        return 2
    except PolicyError as exc:
        log.error("GuardPolicy refused, not starting: %s", exc)
        return 2
    except Exception as exc:  # the apiserver unreachable or refusing: nothing to judge with yet
        log.error("cannot read GuardPolicy %s: %s", settings.guard_policy, exc)
        return 2
    try:
        # The master's own store: it checks the policy before any worker starts, and from when_ready on it
        # watches the file for the policy metrics (once per replica; webhook.serving.policy_metrics).
        master_store = PolicyStore(settings.policy, interval=settings.policy_reload_interval,
                                   on_reload=policy_metrics.on_reload)
        initial = master_store.current()
    except PolicyError as exc:
        log.error("policy refused, not starting: %s", exc)
        return 2
    try:
        cluster_certs = _cluster_certificates(settings)  # before the files are read: it writes them
        cert_file, key_file = settings.cert_dir / "tls.crt", settings.cert_dir / "tls.key"
        if not (cert_file.exists() and key_file.exists()):
            if not settings.generate_certs:
                raise tls.CertificateError(f"{cert_file} or {key_file} is missing (--no-generate-certs)")
            names = list(dict.fromkeys([*tls.DEFAULT_DNS_NAMES, *settings.dns_names]))
            dev_certs.ensure_dev_certs(settings.cert_dir, names)
            log.warning("generated development certificates in %s (trust %s)", settings.cert_dir,
                        settings.cert_dir / "ca.crt")
        # With --client-ca the handshake verifies any certificate presented; /mutate and /validate then require
        # one, while /healthz and /readyz stay reachable for kubelet's probes, which present none.
        ssl_source = ssl_context.ReloadingSSLContext(
            cert_file, key_file, client_ca=settings.client_ca, client_cert_optional=True
        )
        key_path = settings.state_key_path
        if not key_path.exists() and (settings.state_key_file is not None or not settings.generate_certs):
            # Only the development default (<cert-dir>/state.key) is ever generated: a mistyped path must not
            # give each replica a key of its own.
            raise state_key.StateKeyError(
                f"state key file {key_path} does not exist: make one with `csinode-guard certs generate --cert-dir "
                f"{key_path.parent}` (writes {key_path.parent / 'state.key'}), or copy the cluster's: kubectl -n "
                f"csinode-guard get secret csinode-guard-state-key -o jsonpath='{{.data.key}}' | base64 -d > "
                f"{key_path}")
        keys = StateKeys(state_key.ensure_state_key(key_path))
        if not settings.offline:
            server, source = describe_cluster(settings.kubeconfig, environment=False)
            log.info("cluster: %s (%s)", server, source)
        _check_writable_audit_log(settings.audit_log)
        _check_port_free(settings.port, "HTTPS port", settings.host, reuse_port=settings.reuse_port)
        _check_port_free(settings.metrics_port, "metrics port")
    except (tls.CertificateError, state_key.StateKeyError, ClusterConfigError, OSError, ValueError,
            ClusterSecretsError) as exc:
        log.error("cannot start: %s", exc)
        return 2
    for problem in tls.certificate_problems(cert_file):
        log.error("serving certificate problem: %s", problem)
    budget_dir = prepare_budget_dir()  # before the fork: the workers share the cluster increase budget
    log.info(
        "csinode-guard serving https://%s:%d (policy %s, hash %s; certificates in %s; audit log %s)",
        settings.host, settings.port, initial.policy.source, initial.policy.hash, settings.cert_dir,
        settings.audit_log,
    )

    def when_ready(_server: Any) -> None:
        policy_metrics.store = master_store
        master_store.start()
        if cluster_policy_mirror is not None:
            _start_cluster_policy(settings, cluster_policy_mirror, master_store)
        if cluster_certs is not None:
            cluster_certs.start()
        start_metrics_server(settings.metrics_port, cert_file, [policy_metrics])

    def ssl_hook(_conf: Any, _default: Any) -> Any:
        return ssl_source.context()

    def app_factory() -> Any:  # in a worker, after the fork: master_store is the master's as of the fork
        return build_worker_app(settings, keys, cert_file, budget_dir, fallback=master_store.current())

    options = gunicorn_options(settings, cert_file, key_file, ssl_hook, when_ready)
    GuardApplication(settings, app_factory, options).run()
    return 0


def choose_cluster(settings: Settings) -> Settings:
    """``settings``, made offline unless it names a cluster: ``--kubeconfig``, or running in a pod
    (:func:`webhook.kube.kubeapi.in_pod`). ``$KUBECONFIG`` alone is no instruction to ``serve``: a quick start from
    an operator's shell must not join (take the audit Lease of, write Events in) whatever cluster it names."""
    from webhook.kube.kubeapi import in_pod  # noqa: PLC0415

    if settings.offline or settings.kubeconfig or in_pod():
        return settings
    named = " ($KUBECONFIG is not read by serve: pass --kubeconfig \"$KUBECONFIG\" to use it)" \
        if os.environ.get("KUBECONFIG") else ""
    log.warning("no cluster: serve contacts one only with --kubeconfig or inside a pod%s; running offline, "
                "every cluster fact unknown", named)
    return dataclasses.replace(settings, offline=True)


def _cluster_policy_mirror(settings: Settings) -> tuple[Settings, Any]:
    """Without ``--policy``, and with a cluster: GuardPolicy ``settings.guard_policy`` read into a mirror file
    (:mod:`webhook.serving.cluster_policy`), and ``settings`` with ``policy`` pointing at it; else ``settings``
    unchanged and None (the bundled default, or the file given). Raises ``PolicyError`` for a GuardPolicy the
    guard refuses and the API's errors when it cannot be read."""
    if settings.policy is not None or settings.offline:
        return settings, None
    import dataclasses  # noqa: PLC0415

    from webhook.kube.guardpolicy import serving_api_client  # noqa: PLC0415
    from webhook.kube.kubeapi import KubeClient, check_configuration  # noqa: PLC0415
    from webhook.serving.cluster_policy import initial_mirror  # noqa: PLC0415

    check_configuration(settings.kubeconfig)  # ClusterConfigError: a kubeconfig that cannot be loaded
    api_client = serving_api_client(settings.kubeconfig)
    if api_client is None:
        log.info("no cluster configured: serving the bundled default policy")
        return settings, None
    mirror = initial_mirror(KubeClient(api_client), settings.guard_policy)
    atexit.register(_remove_tree, mirror.path.parent, os.getpid())
    return dataclasses.replace(settings, policy=mirror.path), (mirror, api_client)


def _in_creator(stop: Any, creator: int) -> None:
    """Run ``stop()`` when this is process ``creator`` (an atexit handler a forked child inherits does nothing)."""
    if os.getpid() == creator:
        stop()


def _remove_tree(path: Any, creator: int) -> None:
    import shutil  # noqa: PLC0415

    if os.getpid() == creator:
        shutil.rmtree(path, ignore_errors=True)


def _start_cluster_policy(settings: Settings, state: Any, master_store: Any) -> None:
    """In the master: follow the GuardPolicy into the mirror, report, write its status as the leader."""
    from webhook.kube.kubeapi import KubeClient  # noqa: PLC0415
    from webhook.kube.watch.settings import CacheSettings  # noqa: PLC0415
    from webhook.serving.cluster_policy import ClusterPolicy  # noqa: PLC0415

    mirror, api_client = state
    follower = ClusterPolicy(
        KubeClient(api_client), api_client, settings.guard_policy, mirror,
        served_hash=lambda: str(master_store.current().policy.hash),
        namespace=settings.audit.lease_namespace,
        status_lease=f"{settings.audit.lease_name}-policy-status",
        interval=settings.policy_reload_interval or 5.0,
        recreate_after=settings.guard_policy_recreate_after,
        cache_settings=CacheSettings(max_staleness=settings.max_staleness),
    )
    follower.start()
    # In the master only: gunicorn forks the workers after when_ready, so they inherit this handler (and the
    # follower's client, with the master's open TLS connections). A worker that exited used to run it: it gave up
    # the master's status Lease, ended the master's report Lease (the replica then looked gone from
    # status.replicas) and wrote on the master's TLS connections (which then failed with a bad record MAC).
    atexit.register(_in_creator, follower.stop, os.getpid())


def _cluster_certificates(settings: Settings) -> Any:
    """With ``--tls-secret``/``--state-key-secret``: the files made or copied from the Secrets and the caBundle
    filled in (:mod:`webhook.serving.cluster_certs`), and the object that keeps them current; else None."""
    if not (settings.tls_secret or settings.state_key_secret):
        return None
    from webhook.kube.kubeapi import ClusterNotConfiguredError, KubeClient, load_api_client  # noqa: PLC0415
    from webhook.serving.cluster_certs import (  # noqa: PLC0415
        ClusterCertificates,
        ClusterSecretsError,
        SecretNames,
        default_namespace,
    )

    if settings.offline:
        raise ClusterSecretsError("--tls-secret and --state-key-secret need the Kubernetes API: --kubeconfig or a "
                                  "pod's service account (not --offline)")
    try:
        client = KubeClient(load_api_client(settings.kubeconfig, environment=False))
    except ClusterNotConfiguredError as exc:
        raise ClusterSecretsError(str(exc)) from exc
    names = SecretNames(
        namespace=settings.namespace or default_namespace(),
        cert_dir=settings.cert_dir,
        state_key_file=settings.state_key_path,
        tls_secret=settings.tls_secret,
        state_key_secret=settings.state_key_secret,
        webhook_configuration=settings.inject_ca_bundle,
        dns_names=settings.dns_names,
        validation=settings.validation,
    )
    certificates = ClusterCertificates(names, client, interval=settings.cluster_sync_interval)
    certificates.bootstrap()
    return certificates


def _check_writable_audit_log(path: str) -> None:
    from webhook.serving.audit_writer import AUDIT_LOG_MODE  # noqa: PLC0415

    if path == "-":
        return
    try:
        # The mode the workers' AuditWriter asks for: this check is what creates the file.
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, AUDIT_LOG_MODE))
    except OSError as exc:
        raise OSError(f"audit log {path} cannot be opened for appending: {exc.strerror or exc}") from None


def _check_port_free(port: int, what: str, host: str = "0.0.0.0", *, reuse_port: bool = False) -> None:
    """Raise OSError "<what> <port> is not free" when ``host:port`` cannot be bound (with SO_REUSEADDR, as
    gunicorn and the metrics server bind, so a connection in TIME_WAIT does not count; with ``reuse_port`` also
    SO_REUSEPORT, as ``--reuse-port`` binds, so the port is free when only such sockets of this user hold it);
    port 0 is disabled."""
    if port <= 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            where = f" on {host}" if what == "HTTPS port" else ""
            raise OSError(f"{what} {port}{where} is not free: {exc.strerror or exc}") from None


def build_worker_app(settings: Settings, keys: Any, cert_file: Any, budget_dir: Any = None,
                     fallback: Any = None) -> Any:
    """Build one worker's Flask app: policy store (hot reload), cluster view, audit writer, metrics. ``fallback``
    (a :class:`webhook.serving.live_policy.PolicySnapshot`: what the master serves) is served when the policy file
    cannot be loaded as this worker starts."""
    setup_logging(settings.log_level)
    from webhook.serving import metrics, tls  # noqa: PLC0415
    from webhook.serving.app import Runtime, create_app  # noqa: PLC0415
    from webhook.serving.audit_writer import AuditHooks, AuditWriter  # noqa: PLC0415
    from webhook.serving.live_policy import PolicySnapshot, PolicyStore  # noqa: PLC0415

    policy_listeners: list[Any] = []  # told of every new policy (the cluster view's pod version sources)

    def on_reload(result: str, snapshot: PolicySnapshot) -> None:
        # Reloads are counted and the policy metrics published by the master (webhook.serving.policy_metrics).
        if result == "success":
            for listener in policy_listeners:
                listener(snapshot.policy)

    store = PolicyStore(settings.policy, interval=settings.policy_reload_interval, on_reload=on_reload,
                        fallback=fallback)
    cluster, readiness, on_policy, observe_count = build_cluster(settings, store.current().policy, keys)
    readiness = _with_key_check(readiness, cluster)
    if on_policy is not None:
        policy_listeners.append(on_policy)
    store.start()

    def certificate_problems() -> list[str]:
        problems = tls.certificate_problems(cert_file, now=datetime.now(UTC))
        for p in problems:
            log.error("serving certificate: %s", p)
        return problems

    certificate_problems()
    metrics.batch_updates()  # per-request samples reach the metric files once a second, off the request path
    metrics.AUDIT_STALLED.set(0)
    metrics.start_late_answer_series()
    audit = AuditWriter(settings.audit_log, hooks=AuditHooks(
        failure=lambda _reason: metrics.AUDIT_FAILURES.inc(),
        timeout=metrics.AUDIT_TIMEOUTS.inc,
        stalled=lambda flag: metrics.AUDIT_STALLED.set(1 if flag else 0),
        reopened=lambda reason: metrics.AUDIT_REOPENS.labels(reason).inc(),
        orphaned=metrics.AUDIT_ORPHANED.inc,
    ))
    runtime = Runtime(
        policies=store,
        cluster=cluster,
        keys=keys,
        audit=audit,
        max_body_bytes=settings.max_body_bytes,
        connection_max_age=settings.connection_max_age,
        answer_budget=settings.answer_budget,
        readiness=readiness,
        certificate_problems=certificate_problems,
        cert_file=cert_file,
        observe_count=observe_count,
        known_driver=_known_driver(store, cluster),
        require_client_cert=settings.client_ca is not None,
        budget_dir=budget_dir,
    )
    from webhook.serving.audit_loop import build_audit_loop  # noqa: PLC0415

    audit_loop = build_audit_loop(settings.audit, cluster, store, keys, audit, budget_dir,
                                  known_driver=runtime.is_known_driver)
    from webhook.serving import stopping  # noqa: PLC0415

    if audit_loop is not None and not stopping.requested():  # a worker told to stop while booting starts none
        audit_loop.start()
        atexit.register(audit_loop.stop)  # gives the Lease up, so that another replica takes over at once
        stopping.on_stop(audit_loop.stop)  # at SIGTERM already, not after the connections drained
    return create_app(runtime)


def _with_key_check(readiness: Any, cluster: Any) -> Any:
    """``readiness`` whose reason also says, while it is so, that the state key verifies none of the stored
    states (:mod:`webhook.serving.key_check`); readiness itself is unchanged (admission still serves)."""
    records = getattr(cluster, "csinode_records", None)
    fresh = getattr(cluster, "csinodes_fresh", None)
    if records is None or fresh is None:
        return readiness
    from webhook.serving.key_check import check_state_key  # noqa: PLC0415

    def ready() -> tuple[bool, str]:
        ok, reason = readiness()
        if fresh():
            check = check_state_key(r.decoded for r in records())
            if check.foreign:
                reason = f"{reason}; {check.describe()}"
        return ok, reason

    return ready


def _known_driver(store: Any, cluster: Any) -> Any:
    """``known(driver)``: the policy in force names it, or the cluster's CSIDriver cache holds it."""
    has_csidriver = getattr(cluster, "has_csidriver", None)

    def known(driver: str) -> bool:
        if driver in store.current().policy.drivers:
            return True
        return bool(has_csidriver(driver)) if has_csidriver is not None else False

    return known


def build_cluster(settings: Settings, policy: Any, keys: Any = None) -> tuple[Any, Any, Any, Any]:
    """This worker's cluster view (watch caches filled by the kubernetes client, never called per request).

    Returns (view, readiness() -> (ready, reason), on_policy(policy) for hot reload or None,
    observe_count(driver, count, node) or None). Offline (``--offline``, or neither a kubeconfig nor an
    in-cluster service account): a view that knows nothing; the rules then follow the design's asymmetry.
    """
    from webhook.admission.cluster import UnknownClusterView  # noqa: PLC0415

    if settings.offline:
        log.info("offline: no cluster lookups; increases are judged on what the request carries")
        return UnknownClusterView(), (lambda: (True, "offline")), None, None
    from webhook.kube.watch import build_cluster_view  # noqa: PLC0415

    view, caches = build_cluster_view(
        settings.kubeconfig, policy.pod_version_sources(), settings.max_staleness, settings.cache_sync_timeout,
        state_keys=keys,  # the CSINode watch: the audit, one cluster budget, the newest state per object
        history_namespace=settings.audit.lease_namespace,  # the nodes' history records, in the guard's namespace
        pending_pods=True,  # Pods Pending on volume limits: a metric next to the nodes held below their report
        environment=False,  # run() chose the cluster: --kubeconfig or the pod's service account
    )

    def on_policy(new_policy: Any) -> None:
        caches.set_pod_sources(new_policy.pod_version_sources())

    observe = getattr(caches, "observe_headroom", None)
    return view, caches.readiness, on_policy, observe
