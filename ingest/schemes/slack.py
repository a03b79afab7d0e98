"""Slack's ``X-Slack-Signature``."""

from __future__ import annotations

from typing import Any

from .base import (
    _FORM,
    _JSON,
    EventMeta,
    Request,
    Scheme,
    VerificationFailed,
    _decode_hex,
    _dig,
    _event_id,
    _from_unix,
    _is_form,
    _now,
    _parse_form,
    _parse_json,
    _signature_header,
    _str,
    _timestamp,
)


class Slack(Scheme):
    """Slack: ``X-Slack-Signature: v0=<hex>`` over ``v0:{ts}:{body}`` with
    ``X-Slack-Request-Timestamp``. Bodies are JSON (Events API) or form-encoded (slash
    commands; interactivity sends one ``payload`` field holding JSON).

    Meta, JSON: ``event_id`` = ``event_id``; ``event_type`` = ``event.type`` else ``type``;
    ``occurred_at`` = ``event_time``. Form: ``event_id`` = ``trigger_id`` (of the
    ``payload`` for interactivity); ``event_type`` = the ``command`` field's value
    (``/deploy``), or the payload's ``type`` (``block_actions``); ``occurred_at`` = None.
    ``entity_id`` = "" (Slack events do not update one entity in place).
    A ``url_verification`` body has no ``event_id``: the view answers its challenge itself.
    """

    name = "slack"
    content_types = (_FORM, _JSON)

    def _offered(self, request: Request) -> tuple[list[bytes], str | None, bytes]:
        header = _signature_header(request, "x-slack-signature")
        timestamp = _timestamp(request.headers.get("x-slack-request-timestamp"))
        mac = _decode_hex(header.removeprefix("v0=")) if header.startswith("v0=") else None
        if mac is None or len(mac) != 32:
            raise VerificationFailed("malformed_signature")
        return [mac], timestamp, f"v0:{timestamp}:".encode() + request.body

    def parse(self, request: Request) -> Any:
        if not _is_form(request):
            return _parse_json(request.body)
        form = _parse_form(request.body)
        if "payload" in form:
            return {**form, "payload": _parse_json(form["payload"].encode())}
        return form

    def extract(self, request: Request, parsed: Any) -> EventMeta:
        body = parsed if isinstance(parsed, dict) else {}
        if _is_form(request):
            payload = body.get("payload")
            if isinstance(payload, dict):
                event_id, event_type = payload.get("trigger_id"), _str(payload.get("type"))
            else:
                event_id, event_type = body.get("trigger_id"), _str(body.get("command"))
            return EventMeta(_event_id(event_id), event_type, None, "")
        return EventMeta(
            event_id=_event_id(body.get("event_id")),
            event_type=_str(_dig(body, "event.type")) or _str(body.get("type")),
            occurred_at=_from_unix(body.get("event_time")),
            entity_id="",
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
        mac = self._mac(secret, f"v0:{ts}:".encode() + body)
        return {
            "content-type": _JSON if body.lstrip().startswith(b"{") else _FORM,
            "x-slack-request-timestamp": str(ts),
            "x-slack-signature": f"v0={mac.hex()}",
        }
