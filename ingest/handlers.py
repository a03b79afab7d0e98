"""The handler registry: application code registers functions per (source, event type).

    from ingest.handlers import handler

    @handler("stripe", "invoice.paid")
    def mark_invoice_paid(event: ParsedEvent) -> None:
        ...

Patterns are shell-style (``"invoice.*"``, ``"*"``) on both the source slug and the event
type. Email is registered per address: ``@handler("email", "support@example.com")`` runs
for mail to that address (and its plus forms) from every mail source (the SMTP listener's
and the providers'), ``"*@example.com"`` for a whole domain; a source's own slug works
too. An email handler gets an :class:`InboundMessage`.

Handlers run in the worker, inside the transaction that marks the event processed (on
PostgreSQL, with the rest of its batch), so their writes (and any ``publish_event``
they call) commit exactly when the event counts as processed: a crash rolls both back and
the event is processed again. A handler may run more than once for one event (a batch
rolled back by another event's failure runs again one by one): make it idempotent.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from email.message import EmailMessage
from fnmatch import fnmatchcase
from typing import Any

from .mail import Part


@dataclass(frozen=True)
class ParsedEvent:
    """What a handler receives: verified, parsed, typed."""

    id: str  # the inbound event's own id (UUID)
    source: str
    event_id: str
    event_type: str
    entity_id: str
    occurred_at: datetime | None
    payload: Any
    body: bytes
    headers: dict[str, str]
    attempt: int


@dataclass(frozen=True)
class InboundMessage(ParsedEvent):
    """What an email handler receives: the event's fields (``event_type`` is the
    recipient's address without its plus tag, ``entity_id`` the tag or the source's
    header pattern's match, ``occurred_at`` the Date header), the envelope, the
    message parsed again from the stored bytes by the ``email`` package (``payload``
    and ``message`` are that ``EmailMessage``), its bodies and attachments, and the
    authentication evidence recorded when it arrived."""

    transport: str = ""  # smtp, mailgun, postmark, sendgrid
    mail_from: str = ""  # the envelope sender
    recipient: str = ""  # the envelope recipient this event is for, plus tag and all
    recipients: tuple[str, ...] = ()
    from_address: str = ""
    to: tuple[str, ...] = ()
    cc: tuple[str, ...] = ()
    subject: str = ""
    message_id: str = ""
    text: str = ""
    html: str = ""
    attachments: tuple[Part, ...] = ()
    # {"spf": "pass", "dkim": "pass", "dmarc": "pass", "by": ...}; {} when nobody checked.
    authentication: dict[str, str] = field(default_factory=dict)
    message: EmailMessage | None = None


# The source pattern that matches every mail source.
EMAIL = "email"


@dataclass(frozen=True)
class Registration:
    source: str
    event_type: str
    func: Callable[[ParsedEvent], None]
    # Run even for an event older than the last one applied to its entity.
    see_stale: bool = False

    @property
    def name(self) -> str:
        return f"{self.func.__module__}.{self.func.__qualname__}"

    def matches(self, source: str, event_type: str, *, email: bool = False) -> bool:
        in_source = fnmatchcase(source, self.source) or (email and self.source == EMAIL)
        return in_source and fnmatchcase(event_type, self.event_type)


REGISTRY: list[Registration] = []


def handler(source: str, event_type: str = "*", *, see_stale: bool = False):
    """Register the decorated function for events of ``source`` matching ``event_type``
    (``source="email"``: mail of every mail source, ``event_type`` an address pattern,
    matched lower-cased as addresses are stored)."""
    if source == EMAIL:
        event_type = event_type.lower()

    def register(func: Callable[[ParsedEvent], None]):
        REGISTRY.append(Registration(source, event_type, func, see_stale))
        return func

    return register


def handlers_for(source: str, event_type: str, *, email: bool = False) -> list[Registration]:
    """The registrations for an event of ``source`` (a slug) and ``event_type``;
    ``email``: the source is a mail source, which ``"email"`` registrations match too."""
    return [r for r in REGISTRY if r.matches(source, event_type, email=email)]
