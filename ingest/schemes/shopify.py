"""Shopify's ``X-Shopify-Hmac-SHA256``."""

from __future__ import annotations

import uuid
from typing import Any

from .base import (
    _JSON,
    EventMeta,
    Request,
    Scheme,
    VerificationFailed,
    _decode_base64,
    _encode,
    _event_id,
    _from_iso,
    _signature_header,
    _str,
)


class Shopify(Scheme):
    """Shopify: ``X-Shopify-Hmac-SHA256: <base64>`` over the raw body; no timestamp.
    Shopify can take up to an hour to switch to a rotated secret, so keep both. The
    webhook id is not signed: dedupe is on the id and on the body's hash.

    Meta: ``event_id`` = ``X-Shopify-Webhook-Id``; ``event_type`` = ``X-Shopify-Topic``;
    ``occurred_at`` = ``X-Shopify-Triggered-At``; ``entity_id`` = body ``id`` (the order,
    product… the topic is about).
    """

    name = "shopify"
    signs_event_id = False

    def _offered(self, request: Request) -> tuple[list[bytes], str | None, bytes]:
        mac = _decode_base64(_signature_header(request, "x-shopify-hmac-sha256"))
        if mac is None or len(mac) != 32:
            raise VerificationFailed("malformed_signature")
        return [mac], None, request.body

    def extract(self, request: Request, parsed: Any) -> EventMeta:
        body = parsed if isinstance(parsed, dict) else {}
        return EventMeta(
            event_id=_event_id(request.headers.get("x-shopify-webhook-id", "").strip()),
            event_type=request.headers.get("x-shopify-topic", "").strip(),
            occurred_at=_from_iso(request.headers.get("x-shopify-triggered-at", "").strip()),
            entity_id=_str(body.get("id")),
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
        return {
            "content-type": _JSON,
            "x-shopify-webhook-id": event_id or str(uuid.uuid4()),
            "x-shopify-topic": event_type or "orders/create",
            "x-shopify-hmac-sha256": _encode(self._mac(secret, body), "base64"),
        }
