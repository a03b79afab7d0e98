"""Inbound webhook signature schemes: verify, parse and describe one provider's requests.

Each provider is one small class behind the :class:`Scheme` interface (``base``), in a
module of its own (``stripe``, ``github``, …; what the mail sources share is
``email``); a new provider is a new module and one line in ``SCHEMES`` below. The receive view
builds a :class:`Request` from the raw bytes and the (lower-cased) headers, then calls

1. ``verify(request, secrets=..., now=...)`` — raises :class:`VerificationFailed` with a
   stable ``reason``; nothing is parsed before this passes;
2. ``parse(request)`` — raises :class:`UnparseableBody` (a ``ValueError``);
3. ``extract(request, parsed)`` — the :class:`EventMeta` used for dedupe and ordering.

The module is pure: no database, no settings, and verification reads no clock (``now`` is
passed in), so the same code serves the view, the tests and the benchmarks (each scheme
can also ``sign`` a request the way its provider would).

Verification rules shared by every scheme:

- the MAC is computed over the raw bytes exactly as received, never re-serialised JSON;
- every configured secret is tried (rotation) against every offered signature, and every
  pair is compared with :func:`hmac.compare_digest` (no early exit);
- timestamped schemes refuse ``|now - ts| > tolerance`` in both directions, checked after
  the signature, so ``stale_timestamp``/``future_timestamp`` only ever describe authentic
  requests (a replay or a skewed clock) while forgeries count as ``bad_signature``;
- ``missing_signature`` means the signature header is absent or blank; anything present
  but unusable (bad syntax, no entry of the version we verify, a timestamp that is not
  plain ASCII digits, a signature that does not decode to a digest of the right length
  or is not canonical base64) is ``malformed_signature``.
"""

from collections.abc import Mapping
from typing import Any

from .base import (
    MAX_EVENT_ID_LENGTH,
    REASONS,
    EventMeta,
    Request,
    Scheme,
    UnparseableBody,
    VerificationFailed,
)
from .email import EmailScheme, MailPost, address_in
from .github import GitHub
from .hmac import GenericHmac
from .mailgun import Mailgun
from .polled import Polled
from .postmark import Postmark
from .sendgrid import SendGrid
from .shopify import Shopify
from .slack import Slack
from .smtp import Smtp
from .standard import StandardWebhooks
from .stripe import Stripe

__all__ = [
    "EMAIL_SCHEMES",
    "MAX_EVENT_ID_LENGTH",
    "REASONS",
    "SCHEMES",
    "WEBHOOK_SCHEMES",
    "EmailScheme",
    "EventMeta",
    "GenericHmac",
    "GitHub",
    "MailPost",
    "Mailgun",
    "Polled",
    "Postmark",
    "Request",
    "Scheme",
    "SendGrid",
    "Shopify",
    "Slack",
    "Smtp",
    "StandardWebhooks",
    "Stripe",
    "UnparseableBody",
    "VerificationFailed",
    "address_in",
    "get_scheme",
]

SCHEMES: dict[str, type[Scheme]] = {
    cls.name: cls
    for cls in (
        StandardWebhooks,
        Stripe,
        GitHub,
        Shopify,
        Slack,
        GenericHmac,
        Polled,
        Smtp,
        Mailgun,
        Postmark,
        SendGrid,
    )
}
# The schemes a source can be created with (``create_source``): webhooks and mail.
WEBHOOK_SCHEMES = tuple(name for name in SCHEMES if name != Polled.name)
EMAIL_SCHEMES = tuple(name for name, cls in SCHEMES.items() if cls.is_email)


def get_scheme(name: str, options: Mapping[str, Any] | None = None) -> Scheme:
    """The scheme called ``name``, configured with ``options`` (only ``hmac`` takes any);
    ValueError for an unknown name or bad options."""
    try:
        cls = SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown signature scheme {name!r}; known: {sorted(SCHEMES)}") from None
    return cls(**dict(options or {}))
