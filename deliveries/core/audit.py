"""The audit seam: every operator action and admin edit writes an audit row in the
transaction that makes the change. The table is the outbound product's
(``deliveries.models.AuditEntry``); the floor and the job machinery import no product
module, so the deliveries app registers its writer at start (``register_audit``), as the
kinds of work register themselves. Without one, ``audit`` refuses rather than let a
change go unaudited."""

from collections.abc import Callable

from django.core.exceptions import ImproperlyConfigured

AuditWriter = Callable[..., object]
_writer: list[AuditWriter] = []


def register_audit(writer: AuditWriter) -> None:
    """``writer(*, actor, action, target, count, **details)``, called inside the
    transaction that makes the change."""
    _writer[:] = [writer]


def audit(**entry) -> None:
    """Write an audit row with the registered writer, in the caller's transaction."""
    if not _writer:
        raise ImproperlyConfigured("no audit writer is registered (deliveries' AppConfig)")
    _writer[0](**entry)
