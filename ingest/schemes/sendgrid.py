"""SendGrid's Inbound Parse."""

from __future__ import annotations

import json
import re

from .base import Request, UnparseableBody, _parse_json, _str
from .email import _MULTIPART, MailPost, _BasicAuth, _form_fields, _multipart


class SendGrid(_BasicAuth):
    """SendGrid's Inbound Parse, with "POST the raw, full MIME message" on:
    multipart/form-data whose ``email`` field is the message and ``envelope`` a JSON
    ``{"to": [...], "from": ...}``; its ``SPF`` and ``dkim`` fields are SendGrid's
    verdicts, recorded beside any ``Authentication-Results``. Basic auth."""

    name = "sendgrid"
    content_types = (_MULTIPART,)

    def mail(self, request: Request) -> MailPost:
        fields = _form_fields(request)
        raw = fields.get("email")
        if not raw:
            raise UnparseableBody("no_raw_message")
        envelope = _parse_json(fields.get("envelope") or b"{}")
        envelope = envelope if isinstance(envelope, dict) else {}
        to = envelope.get("to") or []
        to = [to] if isinstance(to, str) else to
        verdicts = {}
        spf = fields.get("SPF", b"").decode("utf-8", "replace").strip().lower()
        if spf:
            verdicts["spf"] = spf[:40]
        dkim = re.search(r":\s*([a-z]+)", fields.get("dkim", b"").decode("utf-8", "replace"))
        if dkim:
            verdicts["dkim"] = dkim.group(1)
        if verdicts:
            verdicts["by"] = "sendgrid"
        return MailPost(
            raw=raw,
            recipients=tuple(r.strip() for r in to if isinstance(r, str) and r.strip()),
            mail_from=_str(envelope.get("from")).strip(),
            verdicts=verdicts,
        )

    def post(self, *, raw, recipients, mail_from, secret, timestamp=None):
        body, content_type = _multipart(
            [
                ("envelope", json.dumps({"to": list(recipients), "from": mail_from}).encode()),
                ("SPF", b"pass"),
                ("dkim", b"{@example.org : pass}"),
                ("email", raw),
            ]
        )
        return body, {"content-type": content_type, "authorization": self._authorization(secret)}
