"""Stripe's ``Stripe-Signature``."""

from __future__ import annotations

from typing import Any

from .base import (
    _JSON,
    EventMeta,
    Request,
    Scheme,
    VerificationFailed,
    _decode_hex,
    _dig,
    _event_id,
    _from_unix,
    _now,
    _signature_header,
    _str,
    _timestamp,
)


class Stripe(Scheme):
    """Stripe: ``Stripe-Signature: t=<unix>,v1=<hex>[,v1=<hex>…]`` over ``{t}.{body}``,
    keyed with the whole ``whsec_…`` string as UTF-8 (not decoded); ``v0`` and unknown
    entries are ignored. stripe-python only refuses old timestamps; we refuse both ways.

    Meta: ``event_id`` = body ``id`` (``evt_…``); ``event_type`` = body ``type``;
    ``occurred_at`` = body ``created``; ``entity_id`` = body ``data.object.id``.
    """

    name = "stripe"

    def _offered(self, request: Request) -> tuple[list[bytes], str | None, bytes]:
        header = _signature_header(request, "stripe-signature")
        timestamps, candidates = [], []
        for item in header.split(","):
            key, _, value = item.strip().partition("=")
            if key == "t":
                timestamps.append(value)
            elif key == "v1" and (mac := _decode_hex(value)) and len(mac) == 32:
                candidates.append(mac)
        if not timestamps:
            raise VerificationFailed("missing_timestamp")
        if len(timestamps) > 1:
            raise VerificationFailed("malformed_signature")
        timestamp = _timestamp(timestamps[0])
        if not candidates:
            raise VerificationFailed("malformed_signature")
        return candidates, timestamp, f"{timestamp}.".encode() + request.body

    def extract(self, request: Request, parsed: Any) -> EventMeta:
        body = parsed if isinstance(parsed, dict) else {}
        return EventMeta(
            event_id=_event_id(body.get("id")),
            event_type=_str(body.get("type")),
            occurred_at=_from_unix(body.get("created")),
            entity_id=_str(_dig(body, "data.object.id")),
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
        mac = self._mac(secret, f"{ts}.".encode() + body)
        return {"content-type": _JSON, "stripe-signature": f"t={ts},v1={mac.hex()}"}
