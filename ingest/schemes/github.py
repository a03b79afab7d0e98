"""GitHub's ``X-Hub-Signature-256``."""

from __future__ import annotations

import uuid
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
    _signature_header,
    _str,
)


class GitHub(Scheme):
    """GitHub: ``X-Hub-Signature-256: sha256=<hex>`` over the raw body; no timestamp, so
    no replay window. The delivery id is not signed: dedupe is on the id (a redelivery
    keeps it) and on the body's hash.

    Meta: ``event_id`` = ``X-GitHub-Delivery``; ``event_type`` = ``X-GitHub-Event``, plus
    ``.<action>`` when the body has one (``issues.opened``); ``occurred_at`` = None (the
    payloads' times differ per event type); ``entity_id`` = ``repository.full_name``: a
    coarse lock, but events about one repository then apply in order.
    """

    name = "github"
    signs_event_id = False

    def _offered(self, request: Request) -> tuple[list[bytes], str | None, bytes]:
        header = _signature_header(request, "x-hub-signature-256")
        mac = _decode_hex(header.removeprefix("sha256=")) if header.startswith("sha256=") else None
        if mac is None or len(mac) != 32:
            raise VerificationFailed("malformed_signature")
        return [mac], None, request.body

    def extract(self, request: Request, parsed: Any) -> EventMeta:
        body = parsed if isinstance(parsed, dict) else {}
        event = request.headers.get("x-github-event", "").strip()
        action = body.get("action")
        if event and isinstance(action, str) and action:
            event = f"{event}.{action}"
        return EventMeta(
            event_id=_event_id(request.headers.get("x-github-delivery", "").strip()),
            event_type=event,
            occurred_at=None,
            entity_id=_str(_dig(body, "repository.full_name")),
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
            "x-github-delivery": event_id or str(uuid.uuid4()),
            "x-github-event": event_type or "ping",
            "x-hub-signature-256": "sha256=" + self._mac(secret, body).hex(),
        }
