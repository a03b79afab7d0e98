"""Standard Webhooks (and Svix): the specification's scheme."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Mapping
from typing import Any

from .base import (
    _JSON,
    EventMeta,
    Request,
    Scheme,
    VerificationFailed,
    _decode_base64,
    _dig,
    _encode,
    _event_id,
    _from_iso,
    _from_unix,
    _now,
    _signature_header,
    _str,
    _text,
    _timestamp,
)


class StandardWebhooks(Scheme):
    """Standard Webhooks (https://www.standardwebhooks.com/), which Svix also sends as
    ``svix-*`` headers. Signed content ``{id}.{timestamp}.{body}``, HMAC-SHA256 keyed
    with the base64-decoded secret after ``whsec_``, base64 ``v1,<sig>`` entries separated
    by spaces (other versions ignored).

    Meta: ``event_id`` = the id header (a missing one is ``malformed_signature`` already,
    as it is part of the signed content); ``event_type`` = body ``type``; ``occurred_at`` =
    body ``timestamp`` (ISO 8601) else the timestamp header; ``entity_id`` = body
    ``data.id`` when present (the spec's envelope puts the object under ``data``).
    """

    name = "standard"

    def signing_key(self, secret: str) -> bytes:
        encoded = secret.removeprefix("whsec_")
        # Padding is optional in stored secrets (the reference library appends "==").
        key = _decode_base64_lenient(encoded)
        if not key:
            raise ValueError("a Standard Webhooks secret is base64 after 'whsec_'")
        return key

    @staticmethod
    def _prefix(headers: Mapping[str, str]) -> str:
        return (
            "svix"
            if "webhook-signature" not in headers and "svix-signature" in headers
            else "webhook"
        )

    def _offered(self, request: Request) -> tuple[list[bytes], str | None, bytes]:
        p = self._prefix(request.headers)
        header = _signature_header(request, f"{p}-signature")
        timestamp = _timestamp(request.headers.get(f"{p}-timestamp"))
        msg_id = request.headers.get(f"{p}-id", "").strip()
        if not msg_id:
            raise VerificationFailed("malformed_signature")
        candidates = []
        for entry in header.split():
            version, _, signature = entry.partition(",")
            if version == "v1" and (mac := _decode_base64(signature)) and len(mac) == 32:
                candidates.append(mac)
        if not candidates:
            raise VerificationFailed("malformed_signature")
        return candidates, timestamp, _text(f"{msg_id}.{timestamp}.") + request.body

    def extract(self, request: Request, parsed: Any) -> EventMeta:
        p = self._prefix(request.headers)
        body = parsed if isinstance(parsed, dict) else {}
        return EventMeta(
            event_id=_event_id(request.headers.get(f"{p}-id", "").strip()),
            event_type=_str(body.get("type")),
            occurred_at=_from_iso(body.get("timestamp"))
            or _from_unix(request.headers.get(f"{p}-timestamp", "").strip()),
            entity_id=_str(_dig(body, "data.id")),
        )

    def sign(
        self,
        *,
        body: bytes,
        secret: str,
        timestamp: int | None = None,
        event_id: str = "",
        event_type: str = "",
    ) -> dict[str, str]:
        ts = _now(timestamp)
        msg_id = event_id or f"msg_{uuid.uuid4().hex}"
        mac = self._mac(secret, f"{msg_id}.{ts}.".encode() + body)
        return {
            "content-type": _JSON,
            "webhook-id": msg_id,
            "webhook-timestamp": str(ts),
            "webhook-signature": "v1," + _encode(mac, "base64"),
        }


def _decode_base64_lenient(value: str) -> bytes | None:
    """Base64 with optional padding, for stored secrets (not for signatures)."""
    try:
        return base64.b64decode(value + "=" * (-len(value) % 4), validate=True)
    except ValueError:
        return None
