"""Standard Webhooks signatures (https://www.standardwebhooks.com/).

The signed content is ``{webhook-id}.{webhook-timestamp}.{body}``; the MAC is HMAC-SHA256
keyed with the base64-decoded part of a ``whsec_`` secret, sent base64 as ``v1,<sig>``.
Several active secrets (a rotation) give several space-separated signatures.
"""

import base64
import hashlib
import hmac
import secrets as _secrets
from collections.abc import Iterable

SECRET_PREFIX = "whsec_"  # noqa: S105 - a format prefix, not a secret


def generate_secret() -> str:
    """A new signing secret: 32 random bytes (the spec asks for at least 24)."""
    return SECRET_PREFIX + base64.b64encode(_secrets.token_bytes(32)).decode()


def secret_key(secret: str) -> bytes:
    return base64.b64decode(secret.removeprefix(SECRET_PREFIX))


def sign(secret: str, *, msg_id: str, timestamp: int, body: bytes) -> str:
    """One ``v1,<base64>`` signature."""
    content = f"{msg_id}.{timestamp}.".encode() + body
    mac = hmac.new(secret_key(secret), content, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def signature_header(secrets: Iterable[str], *, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value: one signature per active secret."""
    return " ".join(sign(s, msg_id=msg_id, timestamp=timestamp, body=body) for s in secrets)


def verify(
    secrets: Iterable[str], *, msg_id: str, timestamp: int, body: bytes, header: str
) -> bool:
    """True when any ``v1`` signature in ``header`` matches any secret (constant time)."""
    offered = [part.split(",", 1)[1] for part in header.split() if part.startswith("v1,")]
    expected = [sign(s, msg_id=msg_id, timestamp=timestamp, body=body)[3:] for s in secrets]
    matched = False
    for candidate in offered:
        for good in expected:
            matched |= hmac.compare_digest(candidate.encode(), good.encode())
    return matched
