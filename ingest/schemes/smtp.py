"""The SMTP listener's source."""

from __future__ import annotations

from collections.abc import Sequence

from .base import Request, VerificationFailed
from .email import EmailScheme, _credentials


class Smtp(EmailScheme):
    """The SMTP listener's source (``manage.py run_smtp``). Nothing posted to its webhook
    URL is authentic. Its secrets, if any, are ``user:password`` pairs the listener's
    AUTH accepts (AUTH is then required); ``max_body_bytes`` is the message-size limit."""

    name = "smtp"
    default_max_body_bytes = 10 * 1024 * 1024

    def verify(
        self, request: Request, *, secrets: Sequence[str], now: float, tolerance: int = 300
    ) -> None:
        raise VerificationFailed("no_secret")

    def signing_key(self, secret: str) -> bytes:
        return _credentials(secret)
