"""Postmark's inbound webhook."""

from __future__ import annotations

import json
import uuid

from .base import _JSON, Request, UnparseableBody, _parse_json, _str
from .email import MailPost, _BasicAuth, _text_bytes


class Postmark(_BasicAuth):
    """Postmark's inbound webhook, with "Include raw email content" on: JSON whose
    ``RawEmail`` is the message and ``OriginalRecipient`` the address it was sent to
    (else the ``ToFull``, ``CcFull`` and ``BccFull`` addresses); the envelope sender is
    not posted, so it is the ``From`` address. Basic auth; Postmark publishes the
    addresses it posts from, for ``allow_ips``."""

    name = "postmark"
    content_types = (_JSON,)

    def mail(self, request: Request) -> MailPost:
        body = _parse_json(request.body)
        if not isinstance(body, dict):
            raise UnparseableBody("invalid_json")
        raw = body.get("RawEmail")
        if not isinstance(raw, str) or not raw:
            raise UnparseableBody("no_raw_message")
        recipients = []
        if isinstance(body.get("OriginalRecipient"), str) and body["OriginalRecipient"]:
            recipients.append(body["OriginalRecipient"])
        else:
            for key in ("ToFull", "CcFull", "BccFull"):
                for entry in body.get(key) or ():
                    if isinstance(entry, dict) and isinstance(entry.get("Email"), str):
                        recipients.append(entry["Email"])
        return MailPost(
            raw=_text_bytes(raw),
            recipients=tuple(r.strip() for r in recipients if r.strip()),
            mail_from=_str(body.get("From")).strip(),
        )

    def post(self, *, raw, recipients, mail_from, secret, timestamp=None):
        body = {
            "From": mail_from,
            "OriginalRecipient": recipients[0] if recipients else "",
            "ToFull": [{"Email": r, "Name": ""} for r in recipients],
            "MessageID": str(uuid.uuid4()),
            "RawEmail": raw.decode("utf-8", "surrogateescape"),
        }
        return json.dumps(body).encode(), {
            "content-type": _JSON,
            "authorization": self._authorization(secret),
        }
