"""``csinode-guard certs``: create and rotate the TLS certificates (``webhook.serving.dev_certs``,
``.cert_rotation``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import click
from cryptography import x509

from webhook.serving import cert_rotation, dev_certs, tls

_CERT_DIR_OPTION = click.option(
    "--cert-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("certs"),
    show_default=True,
    envvar="CSINODE_GUARD_CERT_DIR",
    show_envvar=True,
    help="Directory with ca.crt, ca.key, tls.crt, tls.key and ca-bundle.crt.",
)
_DNS_NAME_OPTION = click.option(
    "--dns-name",
    "dns_names",
    multiple=True,
    metavar="NAME",
    help="DNS name for the serving certificate; repeat for several. Replaces the names derived from "
    "--service/--namespace. localhost and 127.0.0.1 are always included.",
)
_IP_OPTION = click.option(
    "--ip-address",
    "ip_addresses",
    multiple=True,
    metavar="IP",
    help="IP address for the serving certificate; repeat for several (127.0.0.1 is always included).",
)
_SERVICE_OPTION = click.option(
    "--service",
    metavar="NAME",
    help=f"Service name the DNS names are derived from (default {tls.DEFAULT_SERVICE}).",
)
_NAMESPACE_OPTION = click.option(
    "--namespace",
    metavar="NAMESPACE",
    help=f"Namespace of that Service (default {tls.DEFAULT_NAMESPACE}).",
)
_VALID_DAYS_OPTION = click.option(
    "--valid-days",
    type=click.IntRange(min=1),
    default=365,
    show_default=True,
    help="Validity of the serving certificate in days (never beyond the CA's).",
)


@click.group()
def certs() -> None:
    """Create and rotate the webhook's TLS certificates (development and manual operation).

    \b
    Files in --cert-dir:
      ca.crt, ca.key   the CA that signs the serving certificate
      tls.crt, tls.key the serving certificate (what the server loads)
      ca-bundle.crt    what goes into the webhook configurations' caBundle
      state.key        the HMAC key of the guard's signed state (certs generate; serve --state-key-file)
    Private keys are written with mode 0600; every file is replaced atomically.
    A running server picks up a new tls.crt/tls.key within its check interval, without a restart.
    """


@certs.command()
@_CERT_DIR_OPTION
@_DNS_NAME_OPTION
@_IP_OPTION
@_SERVICE_OPTION
@_NAMESPACE_OPTION
@_VALID_DAYS_OPTION
@click.option("--force", is_flag=True, help="Replace an existing CA and serving certificate with new ones.")
def generate(
    *,
    cert_dir: Path,
    dns_names: tuple[str, ...],
    ip_addresses: tuple[str, ...],
    service: str | None,
    namespace: str | None,
    valid_days: int,
    force: bool,
) -> None:
    """Create a CA, a serving certificate and a state key (state.key) in --cert-dir, where missing.

    Existing files are kept (the state key even with --force); the serving certificate is reissued from the
    existing CA when it is missing, expired, or lacks one of the requested names. Without --dns-name the names
    are those of Service csinode-guard in namespace csinode-guard (<service>, <service>.<namespace>,
    <service>.<namespace>.svc, <service>.<namespace>.svc.cluster.local).

    \b
    Example:
      csinode-guard certs generate --cert-dir ./certs --namespace kube-system
    """
    names = _dns_names(dns_names, service, namespace) or list(tls.DEFAULT_DNS_NAMES)
    try:
        paths = dev_certs.ensure_dev_certs(
            cert_dir, names, ip_addresses=ip_addresses, valid_days=valid_days, force=force
        )
    except (tls.CertificateError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    _report(paths)
    _ensure_state_key(cert_dir / STATE_KEY_FILE)


STATE_KEY_FILE = "state.key"
"""The state key ``certs generate`` makes next to the certificates: ``serve``'s default ``--state-key-file``."""


def _ensure_state_key(path: Path) -> None:
    """Make ``path`` a state key (one random 32-byte key, mode 0600) unless it exists; an existing key is never
    replaced, even with --force: a new key makes every stored state unverifiable (docs/operations.md)."""
    from webhook.admission.state_key import StateKeyError, ensure_state_key  # noqa: PLC0415

    existed = path.exists()
    try:
        ensure_state_key(path)
    except (StateKeyError, OSError) as exc:
        raise click.ClickException(f"{path}: {exc}") from exc
    if existed:
        click.echo(f"{path}: state key present; kept (a new key would make the stored states unverifiable)")
    else:
        click.echo(f"wrote {path} (mode {path.stat().st_mode & 0o777:04o}): the state key (serve --state-key-file); "
                   "for a cluster that already has a guard, use its key instead (Secret csinode-guard-state-key)")


@certs.command()
@_CERT_DIR_OPTION
@_DNS_NAME_OPTION
@_IP_OPTION
@_SERVICE_OPTION
@_NAMESPACE_OPTION
@_VALID_DAYS_OPTION
@click.option("--new-ca", is_flag=True, help="Step 1 of a CA rotation: also replace the CA (see above).")
@click.option("--finish", is_flag=True, help="Step 2 of a CA rotation: drop the old CA from ca-bundle.crt.")
def rotate(
    *,
    cert_dir: Path,
    dns_names: tuple[str, ...],
    ip_addresses: tuple[str, ...],
    service: str | None,
    namespace: str | None,
    valid_days: int,
    new_ca: bool,
    finish: bool,
) -> None:
    """Issue a new serving certificate in --cert-dir; with --new-ca/--finish, rotate the CA.

    Without name options the new certificate keeps the names (and IPs) of the current one.

    \b
    Rotating the CA:
      1. certs rotate --new-ca   new CA, new serving certificate signed by it, and ca-bundle.crt
                                 with the new and the old CA.
         Put ca-bundle.crt into the webhook configurations' caBundle FIRST, then roll out the new
         tls.crt/tls.key (the apiserver must trust the new CA before a replica serves it).
      2. certs rotate --finish   once every replica serves the new certificate: ca-bundle.crt holds the
                                 new CA only. Update caBundle again.
    """
    if new_ca and finish:
        raise click.UsageError("--new-ca and --finish are separate steps; pass one of them")
    names = _dns_names(dns_names, service, namespace) or None
    try:
        paths = cert_rotation.rotate(
            cert_dir,
            names,
            ip_addresses=ip_addresses or None,
            new_ca=new_ca,
            finish=finish,
            valid_days=valid_days,
        )
    except (tls.CertificateError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    _report(paths)
    if new_ca:
        click.echo(
            f"next: put {paths.ca_bundle} into the webhook configurations' caBundle, roll out "
            f"{paths.tls_cert} and {paths.tls_key}, then run: csinode-guard certs rotate --finish "
            f"--cert-dir {paths.cert_dir}"
        )
    elif finish and paths.written:
        click.echo(f"next: put {paths.ca_bundle} into the webhook configurations' caBundle")


def _dns_names(dns_names: Sequence[str], service: str | None, namespace: str | None) -> list[str]:
    """The explicit names, else the Service's names when --service/--namespace was given, else []."""
    if dns_names:
        return list(dns_names)
    if service is None and namespace is None:
        return []
    return tls.service_dns_names(service or tls.DEFAULT_SERVICE, namespace or tls.DEFAULT_NAMESPACE)


def _report(paths: tls.CertPaths) -> None:
    """Print each written file (with its mode, and for certificates subject, SANs and expiry)."""
    if not paths.written:
        click.echo(f"{paths.cert_dir}: certificates present and usable; nothing written")
        return
    for path in paths.written:
        mode = path.stat().st_mode & 0o777
        line = f"wrote {path} (mode {mode:04o})"
        if path.suffix == ".crt":
            line += f": {_describe(path)}"
        click.echo(line)


def _describe(path: Path) -> str:
    certs_in_file = x509.load_pem_x509_certificates(path.read_bytes())
    parts = []
    for cert in certs_in_file:
        text = f"{cert.subject.rfc4514_string()}, expires {cert.not_valid_after_utc:%Y-%m-%d %H:%M}Z"
        try:
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except x509.ExtensionNotFound:
            pass
        else:
            names = [
                *san.get_values_for_type(x509.DNSName),
                *map(str, san.get_values_for_type(x509.IPAddress)),
            ]
            text += f", names {', '.join(names)}"
        parts.append(text)
    return "; ".join(parts)
