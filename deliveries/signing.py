"""Standard Webhooks signatures (https://www.standardwebhooks.com/).

The signed content is ``{webhook-id}.{webhook-timestamp}.{body}``; the MAC is HMAC-SHA256
keyed with the base64-decoded part of a ``whsec_`` secret, sent base64 as ``v1,<sig>``.
Several active secrets (a rotation) give several space-separated signatures.
"""

import base64
import functools
import hashlib
import hmac
import secrets as _secrets
from collections.abc import Iterable, Mapping

SECRET_PREFIX = "whsec_"  # noqa: S105 - a format prefix, not a secret


def generate_secret() -> str:
    """A new signing secret: 32 random bytes (the spec asks for at least 24)."""
    return SECRET_PREFIX + base64.b64encode(_secrets.token_bytes(32)).decode()


# The worker signs every delivery of an endpoint with the same few secrets, so the
# decoded key, and an HMAC already keyed with it, are kept per secret string. Bounded so
# a process that has seen many endpoints does not grow without limit; a miss only costs
# the decode again. The cached objects live no longer in memory than the secret strings
# the process already holds, and a secret that is no longer passed in is never used.
_KEY_CACHE_SIZE = 4096


@functools.lru_cache(maxsize=_KEY_CACHE_SIZE)
def secret_key(secret: str) -> bytes:
    """The HMAC key of a ``whsec_`` secret: its base64 part, decoded (cached per secret)."""
    return base64.b64decode(secret.removeprefix(SECRET_PREFIX))


@functools.lru_cache(maxsize=_KEY_CACHE_SIZE)
def _keyed_hmac(secret: str) -> hmac.HMAC:
    # Never updated itself: sign() works on a copy, which skips hashing the padded key
    # (about 1 µs of a 4 µs signature over 1 KiB).
    return hmac.new(secret_key(secret), digestmod=hashlib.sha256)


def sign(secret: str, *, msg_id: str, timestamp: int, body: bytes) -> str:
    """One ``v1,<base64>`` signature."""
    mac = _keyed_hmac(secret).copy()
    mac.update(f"{msg_id}.{timestamp}.".encode())
    mac.update(body)
    return "v1," + base64.b64encode(mac.digest()).decode()


def signature_header(secrets: Iterable[str], *, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value: one signature per active secret."""
    return " ".join(sign(s, msg_id=msg_id, timestamp=timestamp, body=body) for s in secrets)


def protocol_headers(*, msg_id: str, timestamp: int | str, signature: str) -> dict[str, str]:
    """The headers the protocol sets on every attempt, in the order they are sent.
    ``msg_id`` is both the ``webhook-id`` and the ``Idempotency-Key``: the delivery id,
    the same on every copy."""
    return {
        "content-type": "application/json",
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature,
        "idempotency-key": msg_id,
    }


def delivery_headers(
    custom: Mapping[str, str],
    secrets: Iterable[str],
    *,
    msg_id: str,
    timestamp: int,
    body: bytes,
) -> dict[str, str]:
    """The headers of one delivery attempt: the endpoint's custom headers (already
    held to ``deliveries.core.headers``, which keeps out the protocol's names in any case),
    then the protocol's."""
    signature = signature_header(secrets, msg_id=msg_id, timestamp=timestamp, body=body)
    return {**custom, **protocol_headers(msg_id=msg_id, timestamp=timestamp, signature=signature)}


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
