"""The state HMAC key file: reading the keys that sign the guard's state annotation, creating it in development.

The keys sign and verify the ``csinode-guard.io/state`` annotation (:class:`webhook.admission.state.StateKeys`); the
file comes from a Secret in a cluster (``--state-key-file``) and is created with one random key for development when
missing. Pure: imports nothing from Flask, kubernetes, prometheus_client or ``cryptography``.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
import os
import secrets
from pathlib import Path
from typing import Final

from webhook.admission.atomic_files import create_exclusive

__all__ = ["STATE_KEY_BYTES", "STATE_KEY_MIN_BYTES", "StateKeyError", "ensure_state_key"]

logger = logging.getLogger("webhook.tls")  # the name this warning has always been logged under

_KEY_MODE: Final = 0o600

STATE_KEY_BYTES: Final = 32
"""The length of a generated key."""
STATE_KEY_MIN_BYTES: Final = 16
"""The shortest key the file may hold."""


class StateKeyError(ValueError):
    """The state HMAC key file holds no key, or a line that is not hex/base64 of a long-enough key."""


def ensure_state_key(path: str | os.PathLike[str]) -> list[bytes]:
    """Read the HMAC keys that sign the guard's state annotation; create a one-key file when it is missing.

    File format (UTF-8 text): one key per line, hex (``[0-9a-fA-F]``, even length) or base64 (standard or
    URL-safe alphabet, padding optional); a line that is valid hex is read as hex. Blank lines and lines
    starting with ``#`` are ignored; surrounding whitespace is stripped. Each key is at least 16 bytes
    (32 recommended). The first key signs new state; every key verifies it, so a key is rotated by putting
    the new key on the first line and keeping the old one below it until all state was re-signed.

    A missing file (dev) is created with one random 32-byte key as hex, mode 0600; when another process
    creates it at the same moment, its key wins. Returns the keys in file order (at least one).
    Raises ``StateKeyError`` for a file with no key or an undecodable/short line, ``OSError`` for I/O errors
    (e.g. a missing file in a read-only Secret volume).
    """
    key_path = Path(path)
    if not key_path.exists():
        create_exclusive(key_path, secrets.token_bytes(STATE_KEY_BYTES).hex().encode() + b"\n", _KEY_MODE)
        logger.warning("generated a new state key in %s (for development; use a Secret)", key_path)
    keys = []
    for number, raw in enumerate(key_path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key = _decode_key_line(line)
        if key is None or len(key) < STATE_KEY_MIN_BYTES:
            raise StateKeyError(
                f"{key_path}:{number}: not a hex or base64 key of at least {STATE_KEY_MIN_BYTES} bytes"
            )
        keys.append(key)
    if not keys:
        raise StateKeyError(f"{key_path}: holds no key")
    return keys


def _decode_key_line(line: str) -> bytes | None:
    with contextlib.suppress(ValueError):
        return bytes.fromhex(line)
    padded = line + "=" * (-len(line) % 4)
    altchars = b"-_" if "-" in line or "_" in line else b"+/"
    with contextlib.suppress(binascii.Error, ValueError):
        return base64.b64decode(padded, altchars=altchars, validate=True)
    return None
