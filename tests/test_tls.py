"""The certificate modules (webhook.serving.tls and beside it) and ``certs``: real certificates, real TLS over
127.0.0.1."""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import logging
import os
import queue
import shutil
import socket
import ssl
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from tests.clirun import run_cli
from webhook.admission import state_key
from webhook.serving import cert_rotation, dev_certs, ssl_context, tls

SERVICE_HOSTNAME = "csinode-guard.csinode-guard.svc"
TIMEOUT = 10.0  # seconds; only reached when something hangs


# --------------------------------------------------------------------------------------------------
# A TLS server on 127.0.0.1 and a client, one handshake at a time


@dataclasses.dataclass
class Outcome:
    """One connection: what the client saw and what the server saw."""

    server_cert: bytes | None  # DER of the certificate the server presented (None when the handshake failed)
    client_error: ssl.SSLError | None
    server_client_cert: bytes | None  # DER of the client certificate the server received
    server_error: ssl.SSLError | None
    version: str | None = None  # negotiated protocol, e.g. "TLSv1.3"
    cipher: str | None = None  # negotiated cipher suite (OpenSSL name)

    @property
    def ok(self) -> bool:
        return self.client_error is None and self.server_error is None


class TLSServer:
    """Accepts connections in a thread; each handshake wraps with a fresh ``context_factory()`` call."""

    def __init__(self, context_factory: Callable[[], ssl.SSLContext]) -> None:
        self._context_factory = context_factory
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._results: queue.Queue[bytes | ssl.SSLError | None] = queue.Queue()
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            conn, _ = self._listener.accept()
            if self._stopping:
                conn.close()
                return
            with conn:
                conn.settimeout(TIMEOUT)
                try:
                    with self._context_factory().wrap_socket(conn, server_side=True) as tls_conn:
                        client_cert = tls_conn.getpeercert(binary_form=True)
                        tls_conn.sendall(b"ok")
                    self._results.put(client_cert)
                except ssl.SSLError as exc:
                    self._results.put(exc)

    def connect(self, client: ssl.SSLContext, server_hostname: str = SERVICE_HOSTNAME) -> Outcome:
        """One connection from ``client``; waits for both ends to finish."""
        server_cert = client_error = version = cipher = None
        try:
            with (
                socket.create_connection(("127.0.0.1", self.port), timeout=TIMEOUT) as raw,
                client.wrap_socket(raw, server_hostname=server_hostname) as conn,
            ):
                server_cert = conn.getpeercert(binary_form=True)
                version, cipher = conn.version(), (conn.cipher() or (None,))[0]
                assert conn.recv(2) == b"ok"  # a TLS 1.3 client learns of a rejected client cert only here
        except ssl.SSLError as exc:
            client_error = exc
            server_cert = None
        result = self._results.get(timeout=TIMEOUT)
        if isinstance(result, ssl.SSLError):
            return Outcome(server_cert, client_error, None, result, version, cipher)
        return Outcome(server_cert, client_error, result, None, version, cipher)

    def close(self) -> None:
        self._stopping = True
        socket.create_connection(("127.0.0.1", self.port), timeout=TIMEOUT).close()
        self._thread.join(TIMEOUT)
        self._listener.close()


Serve = Callable[[Callable[[], ssl.SSLContext]], TLSServer]
"""``serve(context_factory)`` starts a ``TLSServer``; the fixture closes it after the test."""
ClientCA = tuple[Path, ec.EllipticCurvePrivateKey, x509.Certificate]


@pytest.fixture
def serve() -> Iterator[Serve]:
    servers: list[TLSServer] = []

    def start(context_factory: Callable[[], ssl.SSLContext]) -> TLSServer:
        server = TLSServer(context_factory)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def client_context(cafile: Path) -> ssl.SSLContext:
    """A strict client, like the apiserver: verifies the chain to ``cafile`` and the hostname."""
    context = ssl.create_default_context(cafile=str(cafile))
    context.verify_flags |= ssl.VERIFY_X509_STRICT
    return context


def der(path: Path) -> bytes:
    return x509.load_pem_x509_certificate(path.read_bytes()).public_bytes(serialization.Encoding.DER)


def load_cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def write_pair(directory: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    cert_file, key_file = directory / "tls.crt", directory / "tls.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_file, key_file


class FakeClock:
    """A monotonic clock the test moves by hand (seconds)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def cert_dir(tmp_path: Path) -> tls.CertPaths:
    return dev_certs.ensure_dev_certs(tmp_path / "certs")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


# --------------------------------------------------------------------------------------------------
# Generated certificates


@pytest.mark.parametrize(
    "hostname",
    [
        pytest.param(SERVICE_HOSTNAME, id="the service name the apiserver calls"),
        pytest.param("csinode-guard.csinode-guard.svc.cluster.local", id="the fully qualified service name"),
        pytest.param("localhost", id="localhost"),
        pytest.param("127.0.0.1", id="the loopback IP"),
    ],
)
def test_serving_cert_verifies_against_the_ca_for(
    hostname: str, cert_dir: tls.CertPaths, serve: Serve
) -> None:
    server = serve(lambda: ssl_context.build_server_context(cert_dir.tls_cert, cert_dir.tls_key))

    outcome = server.connect(client_context(cert_dir.ca_cert), server_hostname=hostname)

    assert outcome.ok, outcome
    assert outcome.server_cert == der(cert_dir.tls_cert)


def test_serving_cert_verifies_against_the_ca_bundle(cert_dir: tls.CertPaths, serve: Serve) -> None:
    server = serve(lambda: ssl_context.build_server_context(cert_dir.tls_cert, cert_dir.tls_key))

    assert server.connect(client_context(cert_dir.ca_bundle)).ok


def test_a_hostname_not_in_the_cert_is_rejected(cert_dir: tls.CertPaths, serve: Serve) -> None:
    server = serve(lambda: ssl_context.build_server_context(cert_dir.tls_cert, cert_dir.tls_key))

    outcome = server.connect(client_context(cert_dir.ca_cert), server_hostname="other.example")

    assert isinstance(outcome.client_error, ssl.SSLCertVerificationError)
    assert "Hostname mismatch" in str(outcome.client_error)


def test_a_client_trusting_another_ca_rejects_the_cert(
    cert_dir: tls.CertPaths, tmp_path: Path, serve: Serve
) -> None:
    other = dev_certs.ensure_dev_certs(tmp_path / "other")
    server = serve(lambda: ssl_context.build_server_context(cert_dir.tls_cert, cert_dir.tls_key))

    outcome = server.connect(client_context(other.ca_cert))

    assert isinstance(outcome.client_error, ssl.SSLCertVerificationError)


def test_ca_cert_extensions(cert_dir: tls.CertPaths) -> None:
    ca = load_cert(cert_dir.ca_cert)

    basic = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage)
    assert (basic.critical, basic.value.ca) == (True, True)
    assert usage.critical
    assert (usage.value.key_cert_sign, usage.value.crl_sign, usage.value.digital_signature) == (
        True,
        True,
        False,
    )
    public_key = ca.public_key()
    assert isinstance(public_key, ec.EllipticCurvePublicKey)
    assert isinstance(public_key.curve, ec.SECP256R1)
    ca.verify_directly_issued_by(ca)


def test_serving_cert_extensions(cert_dir: tls.CertPaths) -> None:
    ca, cert = load_cert(cert_dir.ca_cert), load_cert(cert_dir.tls_cert)

    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage)
    ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    aki = cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    assert san.get_values_for_type(x509.DNSName) == [*tls.DEFAULT_DNS_NAMES, "localhost"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value == x509.ExtendedKeyUsage(
        [ExtendedKeyUsageOID.SERVER_AUTH]
    )
    assert usage.critical
    assert (usage.value.digital_signature, usage.value.key_cert_sign) == (True, False)
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert aki.key_identifier == ski.digest
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    cert.verify_directly_issued_by(ca)


def test_serving_cert_adds_requested_names_and_ips_and_never_outlives_the_ca() -> None:
    ca_key, ca_cert = dev_certs.generate_ca("test CA", valid_days=30)

    _, cert = dev_certs.generate_serving_cert(ca_key, ca_cert, ["a.example", "localhost"], ["10.0.0.1", "::1"], 365)

    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["a.example", "localhost"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.1", "::1", "127.0.0.1"]
    assert cert.not_valid_after_utc == ca_cert.not_valid_after_utc


@pytest.mark.parametrize(
    ("dns_names", "ip_addresses", "now_offset"),
    [
        pytest.param([""], [], dt.timedelta(0), id="an empty DNS name"),
        pytest.param(["a.example"], ["not-an-ip"], dt.timedelta(0), id="an unparsable IP address"),
        pytest.param(["a.example"], [], dt.timedelta(days=40), id="a CA that has expired"),
    ],
)
def test_generate_serving_cert_raises_value_error_for(
    dns_names: list[str], ip_addresses: list[str], now_offset: dt.timedelta
) -> None:
    ca_key, ca_cert = dev_certs.generate_ca("test CA", valid_days=30)

    with pytest.raises(ValueError):
        dev_certs.generate_serving_cert(
            ca_key, ca_cert, dns_names, ip_addresses, now=dt.datetime.now(dt.UTC) + now_offset
        )


# --------------------------------------------------------------------------------------------------
# The server context: protocol versions, ciphers, compression, client certificates


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1:DeprecationWarning")
@pytest.mark.parametrize(
    "version",
    [pytest.param("TLSv1", id="TLS 1.0"), pytest.param("TLSv1_1", id="TLS 1.1")],
)
def test_an_old_protocol_client_is_refused_by_the_server(
    version: str, cert_dir: tls.CertPaths, serve: Serve
) -> None:
    if not getattr(ssl, f"HAS_{version}"):
        pytest.skip(f"this OpenSSL was built without {version}")
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    client.verify_mode = ssl.CERT_NONE
    client.minimum_version = client.maximum_version = getattr(ssl.TLSVersion, version)
    client.set_ciphers("DEFAULT:@SECLEVEL=0")  # so that OpenSSL 3 really offers the old protocol
    server = serve(lambda: ssl_context.build_server_context(cert_dir.tls_cert, cert_dir.tls_key))

    outcome = server.connect(client)

    assert outcome.client_error is not None
    assert outcome.server_error is not None
    assert outcome.server_error.reason == "UNSUPPORTED_PROTOCOL"  # the server refused, not the client


def test_a_tls12_client_gets_an_ecdhe_aead_cipher(cert_dir: tls.CertPaths, serve: Serve) -> None:
    client = client_context(cert_dir.ca_cert)
    client.maximum_version = ssl.TLSVersion.TLSv1_2
    server = serve(lambda: ssl_context.build_server_context(cert_dir.tls_cert, cert_dir.tls_key))

    outcome = server.connect(client)

    assert outcome.ok, outcome
    assert outcome.version == "TLSv1.2"
    assert outcome.cipher is not None
    assert outcome.cipher.startswith("ECDHE-")
    assert "GCM" in outcome.cipher or "CHACHA20" in outcome.cipher


def test_a_default_client_negotiates_tls13(cert_dir: tls.CertPaths, serve: Serve) -> None:
    server = serve(lambda: ssl_context.build_server_context(cert_dir.tls_cert, cert_dir.tls_key))

    assert server.connect(client_context(cert_dir.ca_cert)).version == "TLSv1.3"


def test_a_tls12_client_offering_only_cbc_ciphers_is_refused(cert_dir: tls.CertPaths, serve: Serve) -> None:
    client = client_context(cert_dir.ca_cert)
    client.maximum_version = ssl.TLSVersion.TLSv1_2
    client.set_ciphers("ECDHE-ECDSA-AES128-SHA256:ECDHE-ECDSA-AES256-SHA:ECDHE-ECDSA-AES128-SHA")
    server = serve(lambda: ssl_context.build_server_context(cert_dir.tls_cert, cert_dir.tls_key))

    outcome = server.connect(client)

    assert outcome.server_error is not None
    assert outcome.server_error.reason == "NO_SHARED_CIPHER"


def test_server_context_settings(cert_dir: tls.CertPaths) -> None:
    context = ssl_context.build_server_context(cert_dir.tls_cert, cert_dir.tls_key)

    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert context.options & ssl.OP_NO_COMPRESSION
    assert context.verify_mode == ssl.CERT_NONE
    tls12 = [c["name"] for c in context.get_ciphers() if c["protocol"] == "TLSv1.2"]
    assert tls12
    assert all(name.startswith("ECDHE-") and ("GCM" in name or "CHACHA20" in name) for name in tls12)


@pytest.fixture
def client_ca(tmp_path: Path) -> ClientCA:
    key, cert = dev_certs.generate_ca("client CA")
    path = tmp_path / "client-ca.crt"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path, key, cert


def test_client_ca_mode_rejects_a_client_without_a_certificate(
    cert_dir: tls.CertPaths, client_ca: ClientCA, serve: Serve
) -> None:
    server = serve(lambda: ssl_context.build_server_context(cert_dir.tls_cert, cert_dir.tls_key, client_ca[0]))

    outcome = server.connect(client_context(cert_dir.ca_cert))

    assert outcome.client_error is not None
    assert outcome.server_error is not None
    assert outcome.server_error.reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE"


def test_client_ca_mode_accepts_a_client_certificate_signed_by_that_ca(
    cert_dir: tls.CertPaths, client_ca: ClientCA, tmp_path: Path, serve: Serve
) -> None:
    _, ca_key, ca_cert = client_ca
    key, cert = dev_certs.generate_client_cert(ca_key, ca_cert, "kube-apiserver")
    cert_file, key_file = write_pair(tmp_path / "client", key, cert)
    client = client_context(cert_dir.ca_cert)
    client.load_cert_chain(cert_file, key_file)
    server = serve(lambda: ssl_context.build_server_context(cert_dir.tls_cert, cert_dir.tls_key, client_ca[0]))

    outcome = server.connect(client)

    assert outcome.ok, outcome
    assert outcome.server_client_cert == cert.public_bytes(serialization.Encoding.DER)


def test_client_ca_mode_rejects_a_client_certificate_from_another_ca(
    cert_dir: tls.CertPaths, client_ca: ClientCA, tmp_path: Path, serve: Serve
) -> None:
    other_key, other_ca = dev_certs.generate_ca("another CA")
    key, cert = dev_certs.generate_client_cert(other_key, other_ca, "intruder")
    cert_file, key_file = write_pair(tmp_path / "client", key, cert)
    client = client_context(cert_dir.ca_cert)
    client.load_cert_chain(cert_file, key_file)
    server = serve(lambda: ssl_context.build_server_context(cert_dir.tls_cert, cert_dir.tls_key, client_ca[0]))

    outcome = server.connect(client)

    assert outcome.server_error is not None
    assert outcome.server_error.reason == "CERTIFICATE_VERIFY_FAILED"


# --------------------------------------------------------------------------------------------------
# ReloadingSSLContext


def test_a_rotated_certificate_is_served_after_the_check_interval_without_restart(
    cert_dir: tls.CertPaths, clock: FakeClock, serve: Serve
) -> None:
    reloading = ssl_context.ReloadingSSLContext(cert_dir.tls_cert, cert_dir.tls_key, check_interval=10, clock=clock)
    server = serve(reloading.context)
    client = client_context(cert_dir.ca_bundle)
    old = der(cert_dir.tls_cert)
    assert server.connect(client).server_cert == old

    cert_rotation.rotate(cert_dir.cert_dir)
    clock.advance(9.9)
    before_interval = server.connect(client).server_cert
    clock.advance(0.1)
    after_interval = server.connect(client).server_cert

    assert before_interval == old
    assert after_interval == der(cert_dir.tls_cert) != old
    assert reloading.last_error is None


def test_a_secret_volume_symlink_swap_is_picked_up(tmp_path: Path, clock: FakeClock, serve: Serve) -> None:
    # The layout kubelet's AtomicWriter gives a Secret volume: files -> ..data/file, ..data -> ..<timestamp>.
    source = dev_certs.ensure_dev_certs(tmp_path / "source")
    volume = tmp_path / "volume"
    volume.mkdir()

    def publish(version: str) -> None:
        shutil.copytree(source.cert_dir, volume / version)
        (volume / "..data_tmp").symlink_to(version)
        os.replace(volume / "..data_tmp", volume / "..data")

    publish("..v1")
    for name in ("tls.crt", "tls.key"):
        (volume / name).symlink_to(Path("..data") / name)
    reloading = ssl_context.ReloadingSSLContext(
        volume / "tls.crt", volume / "tls.key", check_interval=10, clock=clock
    )
    server = serve(reloading.context)
    client = client_context(source.ca_cert)
    first = server.connect(client).server_cert

    cert_rotation.rotate(source.cert_dir)
    publish("..v2")
    clock.advance(10)
    second = server.connect(client).server_cert

    assert first == der(volume / "..v1" / "tls.crt")
    assert second == der(volume / "..v2" / "tls.crt") != first


def _mismatched_key(paths: tls.CertPaths) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    paths.tls_key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )


def _half_written_cert(paths: tls.CertPaths) -> None:
    pem = paths.tls_cert.read_bytes()
    paths.tls_cert.write_bytes(pem[: len(pem) // 2])


def _missing_key(paths: tls.CertPaths) -> None:
    paths.tls_key.unlink()


@pytest.mark.parametrize(
    "break_files",
    [
        pytest.param(_mismatched_key, id="a key that does not match the certificate"),
        pytest.param(_half_written_cert, id="a half-written certificate"),
        pytest.param(_missing_key, id="a missing key"),
    ],
)
def test_broken_new_files_keep_the_last_good_context_until_fixed(
    break_files: Callable[[tls.CertPaths], None],
    cert_dir: tls.CertPaths,
    clock: FakeClock,
    serve: Serve,
    caplog: pytest.LogCaptureFixture,
) -> None:
    reloading = ssl_context.ReloadingSSLContext(cert_dir.tls_cert, cert_dir.tls_key, check_interval=10, clock=clock)
    server = serve(reloading.context)
    client = client_context(cert_dir.ca_cert)
    good = der(cert_dir.tls_cert)

    break_files(cert_dir)
    with caplog.at_level(logging.WARNING, logger="webhook.tls"):
        clock.advance(10)
        first = server.connect(client)
        clock.advance(10)
        second = server.connect(client)

    assert first.ok
    assert first.server_cert == second.server_cert == good
    assert reloading.last_error is not None
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1  # once, not per check

    cert_rotation.rotate(cert_dir.cert_dir, tls.DEFAULT_DNS_NAMES)  # repaired: a complete new pair
    clock.advance(10)

    assert server.connect(client).server_cert == der(cert_dir.tls_cert) != good
    assert reloading.last_error is None


def test_context_is_the_same_object_until_the_files_change(cert_dir: tls.CertPaths, clock: FakeClock) -> None:
    reloading = ssl_context.ReloadingSSLContext(cert_dir.tls_cert, cert_dir.tls_key, check_interval=10, clock=clock)
    first = reloading.context()
    clock.advance(60)

    assert reloading.context() is first
    assert reloading.reload() is False

    cert_rotation.rotate(cert_dir.cert_dir)

    assert reloading.context() is first  # the interval has not passed since the last check
    assert reloading.reload() is True
    assert reloading.context() is not first


def test_client_ca_mode_survives_reload(
    cert_dir: tls.CertPaths, client_ca: ClientCA, clock: FakeClock, serve: Serve
) -> None:
    reloading = ssl_context.ReloadingSSLContext(
        cert_dir.tls_cert, cert_dir.tls_key, client_ca=client_ca[0], check_interval=1, clock=clock
    )
    server = serve(reloading.context)
    cert_rotation.rotate(cert_dir.cert_dir)
    clock.advance(1)

    outcome = server.connect(client_context(cert_dir.ca_cert))

    assert outcome.server_error is not None
    assert outcome.server_error.reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE"


def test_the_gunicorn_hook_returns_the_current_context(cert_dir: tls.CertPaths) -> None:
    reloading = ssl_context.ReloadingSSLContext(cert_dir.tls_cert, cert_dir.tls_key)

    def default_factory() -> ssl.SSLContext:
        raise AssertionError("the default factory is not used")

    assert reloading.ssl_context(object(), default_factory) is reloading.context()


def test_concurrent_callers_always_get_a_context_and_the_last_rotation_wins(
    cert_dir: tls.CertPaths, serve: Serve
) -> None:
    reloading = ssl_context.ReloadingSSLContext(cert_dir.tls_cert, cert_dir.tls_key, check_interval=0)
    errors: list[BaseException] = []
    stop = threading.Event()

    def call_context() -> None:
        try:
            while not stop.is_set():
                assert isinstance(reloading.context(), ssl.SSLContext)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call_context) for _ in range(4)]
    for thread in threads:
        thread.start()
    for _ in range(5):
        cert_rotation.rotate(cert_dir.cert_dir)
    stop.set()
    for thread in threads:
        thread.join(TIMEOUT)
    server = serve(reloading.context)

    assert errors == []
    assert server.connect(client_context(cert_dir.ca_cert)).server_cert == der(cert_dir.tls_cert)
    assert reloading.last_error is None


def test_constructor_raises_for_missing_files(tmp_path: Path) -> None:
    with pytest.raises(tls.CertificateError):
        ssl_context.ReloadingSSLContext(tmp_path / "tls.crt", tmp_path / "tls.key")


# --------------------------------------------------------------------------------------------------
# ensure_dev_certs


def _contents(paths: tls.CertPaths) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(paths.cert_dir.iterdir())}


def test_ensure_dev_certs_writes_the_layout_with_private_keys_0600(cert_dir: tls.CertPaths) -> None:
    names = {p.name for p in cert_dir.written}

    assert names == {"ca.crt", "ca.key", "tls.crt", "tls.key", "ca-bundle.crt"}
    assert sorted(p.name for p in cert_dir.cert_dir.iterdir()) == sorted(names)  # no temporary files left
    assert stat.S_IMODE(cert_dir.ca_key.stat().st_mode) == 0o600
    assert stat.S_IMODE(cert_dir.tls_key.stat().st_mode) == 0o600
    assert stat.S_IMODE(cert_dir.cert_dir.stat().st_mode) == 0o700
    assert cert_dir.ca_bundle.read_bytes() == cert_dir.ca_cert.read_bytes()


def test_ensure_dev_certs_changes_nothing_when_all_is_usable(cert_dir: tls.CertPaths) -> None:
    before = _contents(cert_dir)

    again = dev_certs.ensure_dev_certs(cert_dir.cert_dir)

    assert again.written == ()
    assert _contents(cert_dir) == before


def test_ensure_dev_certs_reissues_from_the_same_ca_for_a_new_dns_name(cert_dir: tls.CertPaths) -> None:
    ca_before = cert_dir.ca_cert.read_bytes()

    again = dev_certs.ensure_dev_certs(cert_dir.cert_dir, [*tls.DEFAULT_DNS_NAMES, "guard.example"])

    san = load_cert(cert_dir.tls_cert).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert again.written == (cert_dir.tls_key, cert_dir.tls_cert)
    assert "guard.example" in san.get_values_for_type(x509.DNSName)
    assert cert_dir.ca_cert.read_bytes() == ca_before
    load_cert(cert_dir.tls_cert).verify_directly_issued_by(load_cert(cert_dir.ca_cert))


def test_ensure_dev_certs_reissues_an_expired_serving_cert(tmp_path: Path) -> None:
    two_years_ago = dt.datetime.now(dt.UTC) - dt.timedelta(days=730)
    paths = dev_certs.ensure_dev_certs(tmp_path / "certs", now=two_years_ago)
    ca_before = paths.ca_cert.read_bytes()
    assert tls.certificate_problems(paths.tls_cert) != []

    again = dev_certs.ensure_dev_certs(paths.cert_dir)

    assert again.written == (paths.tls_key, paths.tls_cert)
    assert tls.certificate_problems(paths.tls_cert) == []
    assert paths.ca_cert.read_bytes() == ca_before


def test_ensure_dev_certs_reissues_when_the_key_does_not_match(cert_dir: tls.CertPaths) -> None:
    _mismatched_key(cert_dir)

    again = dev_certs.ensure_dev_certs(cert_dir.cert_dir)

    assert again.written == (cert_dir.tls_key, cert_dir.tls_cert)
    ssl_context.build_server_context(cert_dir.tls_cert, cert_dir.tls_key)


def test_ensure_dev_certs_refuses_a_ca_key_that_does_not_match(cert_dir: tls.CertPaths) -> None:
    cert_dir.ca_key.write_bytes(cert_dir.tls_key.read_bytes())

    with pytest.raises(tls.CertificateError, match="does not match"):
        dev_certs.ensure_dev_certs(cert_dir.cert_dir)


def test_ensure_dev_certs_force_replaces_everything(cert_dir: tls.CertPaths) -> None:
    before = _contents(cert_dir)

    again = dev_certs.ensure_dev_certs(cert_dir.cert_dir, force=True)

    after = _contents(cert_dir)
    assert set(again.written) == {
        cert_dir.ca_cert,
        cert_dir.ca_key,
        cert_dir.tls_cert,
        cert_dir.tls_key,
        cert_dir.ca_bundle,
    }
    assert all(after[name] != before[name] for name in before)


# --------------------------------------------------------------------------------------------------
# rotate


def _fingerprints(pem: bytes) -> list[bytes]:
    return [c.fingerprint(hashes.SHA256()) for c in x509.load_pem_x509_certificates(pem)]


def test_rotate_issues_a_new_serving_cert_from_the_same_ca_with_the_same_names(
    cert_dir: tls.CertPaths,
) -> None:
    before = _contents(cert_dir)
    old_cert = load_cert(cert_dir.tls_cert)

    rotated = cert_rotation.rotate(cert_dir.cert_dir)

    new_cert = load_cert(cert_dir.tls_cert)
    assert rotated.written == (cert_dir.tls_key, cert_dir.tls_cert)
    assert new_cert.serial_number != old_cert.serial_number
    assert new_cert.extensions.get_extension_for_class(x509.SubjectAlternativeName) == (
        old_cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    )
    assert _contents(cert_dir)["ca.crt"] == before["ca.crt"]
    assert _contents(cert_dir)["ca-bundle.crt"] == before["ca-bundle.crt"]
    assert stat.S_IMODE(cert_dir.tls_key.stat().st_mode) == 0o600


def test_ca_rotation_bundle_trusts_old_and_new_certs_until_finished(
    cert_dir: tls.CertPaths, tmp_path: Path, serve: Serve
) -> None:
    old_ca = tmp_path / "old-ca.crt"
    shutil.copy2(cert_dir.ca_cert, old_ca)
    old_pair = tmp_path / "old"
    old_pair.mkdir()
    for path in (cert_dir.tls_cert, cert_dir.tls_key):
        shutil.copy2(path, old_pair / path.name)

    rotated = cert_rotation.rotate(cert_dir.cert_dir, new_ca=True)

    assert rotated.written[0] == cert_dir.ca_bundle  # written before anything is signed by the new CA
    assert set(rotated.written) == {
        cert_dir.ca_bundle,
        cert_dir.ca_key,
        cert_dir.ca_cert,
        cert_dir.tls_key,
        cert_dir.tls_cert,
    }
    new_ca = cert_dir.ca_cert.read_bytes()
    assert _fingerprints(cert_dir.ca_bundle.read_bytes()) == [
        *_fingerprints(new_ca),
        *_fingerprints(old_ca.read_bytes()),
    ]
    load_cert(cert_dir.tls_cert).verify_directly_issued_by(load_cert(cert_dir.ca_cert))
    old_server = serve(lambda: ssl_context.build_server_context(old_pair / "tls.crt", old_pair / "tls.key"))
    new_server = serve(lambda: ssl_context.build_server_context(cert_dir.tls_cert, cert_dir.tls_key))
    during = client_context(cert_dir.ca_bundle)

    assert old_server.connect(during).ok
    assert new_server.connect(during).ok
    assert isinstance(new_server.connect(client_context(old_ca)).client_error, ssl.SSLCertVerificationError)

    finished = cert_rotation.rotate(cert_dir.cert_dir, finish=True)
    after = client_context(cert_dir.ca_bundle)

    assert finished.written == (cert_dir.ca_bundle,)
    assert cert_dir.ca_bundle.read_bytes() == new_ca
    assert isinstance(old_server.connect(after).client_error, ssl.SSLCertVerificationError)
    assert new_server.connect(after).ok
    assert cert_rotation.rotate(cert_dir.cert_dir, finish=True).written == ()  # finishing twice is a no-op


def test_a_second_ca_rotation_before_finishing_the_first_is_refused(cert_dir: tls.CertPaths) -> None:
    cert_rotation.rotate(cert_dir.cert_dir, new_ca=True)
    before = _contents(cert_dir)

    with pytest.raises(tls.CertificateError, match="--finish"):
        cert_rotation.rotate(cert_dir.cert_dir, new_ca=True)
    assert _contents(cert_dir) == before


def test_finish_is_refused_while_the_serving_cert_is_from_the_old_ca(
    cert_dir: tls.CertPaths, tmp_path: Path
) -> None:
    old_pair = {path.name: path.read_bytes() for path in (cert_dir.tls_cert, cert_dir.tls_key)}
    cert_rotation.rotate(cert_dir.cert_dir, new_ca=True)
    for name, content in old_pair.items():
        (cert_dir.cert_dir / name).write_bytes(content)

    with pytest.raises(tls.CertificateError, match="not signed by"):
        cert_rotation.rotate(cert_dir.cert_dir, finish=True)
    assert len(_fingerprints(cert_dir.ca_bundle.read_bytes())) == 2


def test_rotate_refuses_new_ca_together_with_finish(cert_dir: tls.CertPaths) -> None:
    with pytest.raises(ValueError):
        cert_rotation.rotate(cert_dir.cert_dir, new_ca=True, finish=True)


def test_rotate_needs_an_existing_ca(tmp_path: Path) -> None:
    with pytest.raises(tls.CertificateError, match="missing"):
        cert_rotation.rotate(tmp_path)


# --------------------------------------------------------------------------------------------------
# certificate_not_after, certificate_problems


def test_certificate_not_after_is_the_utc_expiry(cert_dir: tls.CertPaths) -> None:
    not_after = tls.certificate_not_after(cert_dir.tls_cert)

    assert not_after == load_cert(cert_dir.tls_cert).not_valid_after_utc
    assert not_after.utcoffset() == dt.timedelta(0)


@pytest.mark.parametrize(
    ("offset", "expected"),
    [
        pytest.param(dt.timedelta(0), [], id="a fresh certificate has no problems"),
        pytest.param(dt.timedelta(days=366), ["expired"], id="an expired certificate"),
        pytest.param(dt.timedelta(minutes=-10), ["not valid before"], id="a certificate not yet valid"),
    ],
)
def test_certificate_problems(offset: dt.timedelta, expected: list[str], cert_dir: tls.CertPaths) -> None:
    problems = tls.certificate_problems(cert_dir.tls_cert, now=dt.datetime.now(dt.UTC) + offset)

    assert len(problems) == len(expected)
    for problem, word in zip(problems, expected, strict=True):
        assert word in problem


def test_certificate_problems_reports_an_unreadable_file(tmp_path: Path) -> None:
    (tmp_path / "garbage.crt").write_text("not a certificate")

    assert len(tls.certificate_problems(tmp_path / "missing.crt")) == 1
    assert len(tls.certificate_problems(tmp_path / "garbage.crt")) == 1


# --------------------------------------------------------------------------------------------------
# ensure_state_key


def test_ensure_state_key_creates_one_32_byte_key_with_mode_0600_and_then_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "state" / "hmac.key"

    created = state_key.ensure_state_key(path)
    read_back = state_key.ensure_state_key(path)

    assert len(created) == 1
    assert len(created[0]) == 32
    assert read_back == created
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_ensure_state_key_reads_several_keys_in_order(tmp_path: Path) -> None:
    first, second, third = (bytes([n]) * 32 for n in (1, 2, 0xFB))
    path = tmp_path / "hmac.key"
    path.write_text(
        "# signing key first\n"
        f"{first.hex()}\n"
        "\n"
        f"  {base64.b64encode(second).decode()}  \n"
        f"{base64.urlsafe_b64encode(third).decode().rstrip('=')}\n"
    )

    assert state_key.ensure_state_key(path) == [first, second, third]


@pytest.mark.parametrize(
    "content",
    [
        pytest.param("", id="an empty file"),
        pytest.param("# only a comment\n\n", id="a file with only comments"),
        pytest.param("not a key!\n", id="a line that is neither hex nor base64"),
        pytest.param("abcd\n", id="a key shorter than 16 bytes"),
    ],
)
def test_ensure_state_key_rejects(content: str, tmp_path: Path) -> None:
    path = tmp_path / "hmac.key"
    path.write_text(content)

    with pytest.raises(state_key.StateKeyError):
        state_key.ensure_state_key(path)


# --------------------------------------------------------------------------------------------------
# The CLI


def test_cli_generate_writes_the_files_with_0600_keys_and_then_leaves_them(tmp_path: Path) -> None:
    first = run_cli("certs", "generate", "--cert-dir", "tmp", cwd=tmp_path)
    second = run_cli("certs", "generate", "--cert-dir", "tmp", cwd=tmp_path)

    cert_dir = tmp_path / "tmp"
    assert first.returncode == 0, first.stderr
    assert sorted(p.name for p in cert_dir.iterdir()) == [
        "ca-bundle.crt",
        "ca.crt",
        "ca.key",
        "state.key",
        "tls.crt",
        "tls.key",
    ]
    assert stat.S_IMODE((cert_dir / "ca.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((cert_dir / "tls.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((cert_dir / "state.key").stat().st_mode) == 0o600, "the state key serve --state-key-file reads"
    assert first.stdout.count("wrote ") == 6
    assert SERVICE_HOSTNAME in first.stdout
    key = (cert_dir / "state.key").read_bytes()
    assert second.returncode == 0, second.stderr
    assert "nothing written" in second.stdout and "state key present; kept" in second.stdout
    assert (cert_dir / "state.key").read_bytes() == key, "never replaced: it would orphan every stored state"


def test_cli_rotate_runs_a_ca_rotation(tmp_path: Path) -> None:
    generated = run_cli("certs", "generate", cwd=tmp_path)  # default --cert-dir ./certs
    started = run_cli("certs", "rotate", "--new-ca", cwd=tmp_path)
    bundle_during = (tmp_path / "certs" / "ca-bundle.crt").read_bytes()
    finished = run_cli("certs", "rotate", "--finish", cwd=tmp_path)
    both = run_cli("certs", "rotate", "--new-ca", "--finish", cwd=tmp_path)

    assert generated.returncode == 0, generated.stderr
    assert started.returncode == 0, started.stderr
    assert "rotate --finish" in started.stdout
    assert len(_fingerprints(bundle_during)) == 2
    assert finished.returncode == 0, finished.stderr
    assert len(_fingerprints((tmp_path / "certs" / "ca-bundle.crt").read_bytes())) == 1
    assert both.returncode == 2
    assert "separate steps" in both.stderr


def test_cli_help_describes_the_options(tmp_path: Path) -> None:
    result = run_cli("certs", "rotate", "--help", cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    for option in ("--cert-dir", "--dns-name", "--new-ca", "--finish", "caBundle"):
        assert option in result.stdout


def test_optional_client_ca_mode_lets_a_client_without_a_certificate_connect(
    cert_dir: tls.CertPaths, client_ca: ClientCA, serve: Serve
) -> None:
    server = serve(
        lambda: ssl_context.build_server_context(
            cert_dir.tls_cert, cert_dir.tls_key, client_ca[0], client_cert_optional=True
        )
    )

    outcome = server.connect(client_context(cert_dir.ca_cert))

    assert outcome.client_error is None
    assert outcome.server_error is None


def test_optional_client_ca_mode_still_rejects_a_certificate_from_another_ca(
    cert_dir: tls.CertPaths, tmp_path: Path, client_ca: ClientCA, serve: Serve
) -> None:
    other_key, other_cert = dev_certs.generate_ca("another CA")
    key, cert = dev_certs.generate_client_cert(other_key, other_cert, "intruder")
    cert_file, key_file = tmp_path / "intruder.crt", tmp_path / "intruder.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    server = serve(
        lambda: ssl_context.build_server_context(
            cert_dir.tls_cert, cert_dir.tls_key, client_ca[0], client_cert_optional=True
        )
    )
    context = client_context(cert_dir.ca_cert)
    context.load_cert_chain(cert_file, key_file)

    outcome = server.connect(context)

    assert outcome.server_error is not None
