"""Mailgun's routes (raw MIME posts)."""

from __future__ import annotations

import uuid

from .base import Request, UnparseableBody, VerificationFailed, _decode_hex, _now, _timestamp
from .email import EmailScheme, MailPost, _form_fields, _multipart


class Mailgun(EmailScheme):
    """Mailgun's routes, ``forward()`` to a URL ending in ``mime`` (its raw-MIME post):
    form fields ``timestamp``, ``token``, ``signature`` (hex HMAC-SHA256 of
    ``{timestamp}{token}`` keyed with the webhook signing key), ``body-mime`` (the
    message), ``recipient`` and ``sender`` (the envelope). The signature covers the
    timestamp and token, not the message; the replay window (``replay_tolerance``)
    applies both ways and the message is deduplicated on its Message-ID.
    Mailgun posts the signature inside the form, so the form is read before the
    signature is checked; the message is not parsed until it has been."""

    name = "mailgun"

    def _offered(self, request: Request) -> tuple[list[bytes], str | None, bytes]:
        try:
            fields = _form_fields(request)
        except UnparseableBody:
            raise VerificationFailed("malformed_signature") from None
        signature = fields.get("signature", b"").decode("ascii", "replace").strip()
        if not signature:
            raise VerificationFailed("missing_signature")
        timestamp = _timestamp(fields.get("timestamp", b"").decode("ascii", "replace"))
        token = fields.get("token", b"")
        mac = _decode_hex(signature)
        if mac is None or len(mac) != 32 or not token:
            raise VerificationFailed("malformed_signature")
        return [mac], timestamp, timestamp.encode() + token

    def replay_key(self, request: Request) -> str:
        return _form_fields(request).get("token", b"").decode("ascii", "replace")

    def mail(self, request: Request) -> MailPost:
        fields = _form_fields(request)
        raw = fields.get("body-mime")
        if not raw:
            raise UnparseableBody("no_raw_message")
        recipients = fields.get("recipient", b"").decode("utf-8", "replace")
        return MailPost(
            raw=raw,
            recipients=tuple(r.strip() for r in recipients.split(",") if r.strip()),
            mail_from=fields.get("sender", b"").decode("utf-8", "replace").strip(),
        )

    def post(self, *, raw, recipients, mail_from, secret, timestamp=None):
        ts = str(_now(timestamp))
        token = uuid.uuid4().hex + uuid.uuid4().hex[:18]  # 50 characters, as Mailgun's
        signature = self._mac(secret, (ts + token).encode()).hex()
        body, content_type = _multipart(
            [
                ("timestamp", ts.encode()),
                ("token", token.encode()),
                ("signature", signature.encode()),
                ("recipient", ", ".join(recipients).encode()),
                ("sender", mail_from.encode()),
                ("body-mime", raw),
            ]
        )
        return body, {"content-type": content_type}
