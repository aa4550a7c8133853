"""TLS for the coordinator: certificates, fingerprints, and the contexts both sides use.

The coordinator serves everything (the API, the heartbeat websocket, the rendezvous store, the
dashboard and /metrics) over one TLS listener when it has a certificate: either the operator's
(``--tls-cert/--tls-key``) or one made at start (``--tls self-signed``), whose SHA-256
fingerprint it prints. A peer trusts the coordinator in one of two ways:

* it **pins** the fingerprint (``SessionConfig(coordinator_fingerprint=...)``): no CA is
  involved, and any other certificate (a man in the middle's) is refused with an error naming
  both fingerprints;
* or it verifies the chain and the host name against a CA file (``coordinator_ca=...``).

Fingerprints are written like OpenSSL's ``-fingerprint -sha256``: 32 upper-case hex pairs
joined by colons; :func:`normalize_fingerprint` also takes them without colons, in any case,
with or without a ``sha256:`` prefix.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "TLSFiles",
    "fingerprint",
    "format_fingerprint",
    "normalize_fingerprint",
    "self_signed",
    "server_context",
]


def format_fingerprint(digest: bytes) -> str:
    """``AB:CD:...`` of a 32-byte SHA-256 digest."""
    return ":".join(f"{b:02X}" for b in digest)


def fingerprint(cert_der: bytes) -> str:
    """The SHA-256 fingerprint of a DER certificate, as :func:`format_fingerprint` writes it."""
    return format_fingerprint(hashlib.sha256(cert_der).digest())


def normalize_fingerprint(text: str) -> bytes:
    """The 32 bytes a fingerprint string names. Raises ValueError saying what a fingerprint
    looks like when ``text`` is not one."""
    t = text.strip()
    if t.lower().startswith("sha256:"):
        t = t[7:]
    hexpart = t.replace(":", "").replace(" ", "")
    try:
        raw = bytes.fromhex(hexpart)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ValueError(
            f"coordinator fingerprint {text!r} is not a SHA-256 fingerprint: give the 64 hex "
            f"digits (colons allowed) the coordinator printed at start"
        )
    return raw


@dataclass(frozen=True)
class TLSFiles:
    """A certificate and its key on disk, and the certificate's fingerprint."""

    cert: str
    key: str
    fingerprint: str

    @staticmethod
    def load(cert: str, key: str) -> TLSFiles:
        """The operator's PEM files. Raises ValueError naming the file that cannot be read or
        is not a PEM certificate (the key is checked when the server context is made)."""
        try:
            pem = Path(cert).read_text()
        except OSError as e:
            raise ValueError(f"cannot read the TLS certificate {cert}: {e}") from None
        try:
            der = ssl.PEM_cert_to_DER_cert(pem)
        except ValueError as e:
            raise ValueError(f"{cert} is not a PEM certificate: {e}") from None
        if not Path(key).is_file():
            raise ValueError(f"TLS key {key} does not exist")
        return TLSFiles(cert, key, fingerprint(der))


def _hosts(hosts: list[str]) -> list[object]:
    from cryptography import x509

    names: list[object] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return names


def self_signed(directory: str | None = None, hosts: list[str] | None = None) -> TLSFiles:
    """Make an ECDSA P-256 key and a self-signed certificate valid for a year, write them (the
    key readable by this user only) into ``directory`` (default: a new temporary directory),
    and return them with the certificate's fingerprint.

    ``hosts`` become the certificate's subject alternative names (for peers that verify it as a
    CA instead of pinning it). Raises ImportError naming the package when ``cryptography`` is
    missing."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError as e:  # pragma: no cover - it is a dependency
        raise ImportError(
            "--tls self-signed needs the 'cryptography' package (pip install cryptography), "
            "or give --tls-cert/--tls-key made by another tool"
        ) from e
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "isthmus coordinator")])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # clocks differ a little
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    )
    sans = _hosts(hosts or ["localhost", "127.0.0.1"])
    builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)  # type: ignore[arg-type]
    cert = builder.sign(key, hashes.SHA256())
    d = Path(directory or tempfile.mkdtemp(prefix="isthmus-tls-"))
    d.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = d / "coordinator.crt", d / "coordinator.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    der = cert.public_bytes(serialization.Encoding.DER)
    return TLSFiles(str(cert_path), str(key_path), fingerprint(der))


def server_context(files: TLSFiles) -> ssl.SSLContext:
    """The coordinator's TLS context (TLS 1.2 or later). Raises ValueError naming the files
    when the key does not belong to the certificate or cannot be read."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(files.cert, files.key)
    except (ssl.SSLError, OSError) as e:
        raise ValueError(
            f"cannot use TLS certificate {files.cert} with key {files.key}: {e}"
        ) from None
    return ctx
