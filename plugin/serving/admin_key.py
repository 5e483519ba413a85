"""The admin key as the stubs know it: its SHA-256 in their environment, never the key itself.

The launcher (and TritonServer) put `ADMIN_KEY_DIGEST_ENV` in the server's environment; the
generate model's weight operations compare a request's `admin_key` parameter against it. Light on
purpose (no torch): `ops` imports it.
"""

from __future__ import annotations

import hashlib
import hmac

ADMIN_KEY_DIGEST_ENV = "TRITON_ADMIN_KEY_SHA256"


def key_digest(key: str) -> str:
    """The hex SHA-256 of an admin key (what the stub is given instead of the key)."""
    return hashlib.sha256(key.encode()).hexdigest()


def key_matches(given: str, digest: str) -> bool:
    """Whether `given` is the key whose SHA-256 is `digest` (a constant-time comparison)."""
    return hmac.compare_digest(key_digest(given), digest)
