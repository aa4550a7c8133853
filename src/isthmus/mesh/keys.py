"""WireGuard key pairs (X25519). The private key stays in the process that made it: only the
public key is ever sent anywhere."""

from __future__ import annotations

import base64
import binascii
import shutil
import subprocess
from dataclasses import dataclass, field

from isthmus.mesh import MeshError

__all__ = ["KeyPair", "check_public_key", "key_hex"]


def key_hex(key_b64: str) -> str:
    """A base64 key (WireGuard's usual form) as the 64 hex digits its control socket wants."""
    return base64.b64decode(key_b64, validate=True).hex()


def check_public_key(key_b64: object) -> str | None:
    """Why ``key_b64`` is not a WireGuard public key (32 bytes, base64), or None if it is."""
    if not isinstance(key_b64, str) or len(key_b64) != 44:
        return "expected 44 characters of base64 (32 bytes)"
    try:
        raw = base64.b64decode(key_b64, validate=True)
    except (binascii.Error, ValueError):
        return "not base64"
    return None if len(raw) == 32 else "not 32 bytes"


@dataclass(frozen=True)
class KeyPair:
    """A WireGuard key pair. ``private`` is never logged or shown (``repr`` hides it)."""

    public: str
    private: str = field(repr=False)

    @classmethod
    def generate(cls) -> KeyPair:
        """A fresh pair, from the ``cryptography`` package, else from ``wg genkey``/``wg pubkey``.

        Raises :class:`MeshError` naming what to install when neither is available."""
        try:
            from cryptography.hazmat.primitives import serialization
            from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
        except ImportError:
            return cls._from_wg()
        priv = X25519PrivateKey.generate()
        raw = serialization.Encoding.Raw
        private = priv.private_bytes(
            raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        public = priv.public_key().public_bytes(raw, serialization.PublicFormat.Raw)
        return cls(base64.b64encode(public).decode(), base64.b64encode(private).decode())

    @classmethod
    def _from_wg(cls) -> KeyPair:
        wg = shutil.which("wg")
        if wg is None:
            raise MeshError(
                "cannot make a WireGuard key: install the cryptography package "
                "(pip install cryptography) or wireguard-tools (apt-get install wireguard-tools)"
            )
        private = subprocess.run([wg, "genkey"], capture_output=True, text=True, check=True)
        public = subprocess.run(
            [wg, "pubkey"], input=private.stdout, capture_output=True, text=True, check=True
        )
        return cls(public.stdout.strip(), private.stdout.strip())
