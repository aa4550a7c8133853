"""Certificates and fingerprints (no network), and the public-address warning."""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

import pytest

from isthmus.comm.exposure import is_public, warn_if_public
from isthmus.coordinator.tls import (
    TLSFiles,
    fingerprint,
    normalize_fingerprint,
    self_signed,
    server_context,
)


def test_a_self_signed_certificate_loads_and_its_fingerprint_is_its_der_hash(
    tmp_path: Path,
) -> None:
    files = self_signed(str(tmp_path))
    der = ssl.PEM_cert_to_DER_cert(Path(files.cert).read_text())
    assert files.fingerprint == fingerprint(der)
    assert len(normalize_fingerprint(files.fingerprint)) == 32
    assert (Path(files.key).stat().st_mode & 0o777) == 0o600
    assert TLSFiles.load(files.cert, files.key) == files
    server_context(files)  # the key belongs to the certificate
    other = self_signed(str(tmp_path / "other"))
    assert other.fingerprint != files.fingerprint
    with pytest.raises(ValueError, match="cannot use TLS certificate"):
        server_context(TLSFiles(files.cert, other.key, files.fingerprint))


def test_fingerprints_are_read_in_every_common_spelling() -> None:
    raw = bytes(range(32))
    colons = ":".join(f"{b:02X}" for b in raw)
    for text in (colons, colons.lower(), colons.replace(":", ""), "SHA256:" + colons):
        assert normalize_fingerprint(text) == raw
    with pytest.raises(ValueError, match="64 hex digits"):
        normalize_fingerprint("AB:CD")


def test_a_public_gloo_address_is_warned_about_once(caplog: pytest.LogCaptureFixture) -> None:
    assert not is_public("10.1.2.3") and not is_public("127.0.0.1") and not is_public("myhost")
    assert not is_public("100.64.0.1")  # carrier-grade NAT (Tailscale's range) is not global
    with caplog.at_level(logging.WARNING, logger="isthmus.security"):
        assert warn_if_public("8.8.4.4")
        assert not warn_if_public("8.8.4.4")
        assert not warn_if_public("192.168.1.5")
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "8.8.4.4" in msgs[0] and "docs/SECURITY.md" in msgs[0]
