"""The handler registry: application code registers functions per (source, event type).

    from ingest.handlers import handler

    @handler("stripe", "invoice.paid")
    def mark_invoice_paid(event: ParsedEvent) -> None:
        ...

Patterns are shell-style (``"invoice.*"``, ``"*"``) on both the source slug and the event
type. Handlers run in the worker, inside the transaction that marks the event processed
(on PostgreSQL, with the rest of its batch), so their writes (and any ``publish_event``
they call) commit exactly when the event counts as processed: a crash rolls both back and
the event is processed again. A handler may run more than once for one event (a batch
rolled back by another event's failure runs again one by one): make it idempotent.
"""

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from fnmatch import fnmatchcase
from typing import Any


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
class Registration:
    source: str
    event_type: str
    func: Callable[[ParsedEvent], None]
    # Run even for an event older than the last one applied to its entity.
    see_stale: bool = False

    @property
    def name(self) -> str:
        return f"{self.func.__module__}.{self.func.__qualname__}"

    def matches(self, source: str, event_type: str) -> bool:
        return fnmatchcase(source, self.source) and fnmatchcase(event_type, self.event_type)


REGISTRY: list[Registration] = []


def handler(source: str, event_type: str = "*", *, see_stale: bool = False):
    """Register the decorated function for events of ``source`` matching ``event_type``."""

    def register(func: Callable[[ParsedEvent], None]):
        REGISTRY.append(Registration(source, event_type, func, see_stale))
        return func

    return register


def handlers_for(source: str, event_type: str) -> list[Registration]:
    return [r for r in REGISTRY if r.matches(source, event_type)]
