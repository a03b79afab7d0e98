"""Sending a Django signal for rows once the transaction that changed them commits: the
one rule every product's signals are sent by (``deliveries.signals``)."""

import logging
from collections.abc import Iterable

from django.db import transaction
from django.dispatch import Signal

logger = logging.getLogger("deliveries.signals")


def send_after_commit(signal: Signal, model, ids: Iterable) -> None:
    """Send ``signal`` for each row of ``model`` in ``ids`` once the current transaction
    commits (at once outside one), reading the rows as they then stand."""
    if not signal.has_listeners(model):
        return
    ids = list(ids)
    if ids:
        transaction.on_commit(lambda: _send(signal, model, ids))


def _send(signal: Signal, model, ids: list) -> None:
    for instance in model.objects.filter(pk__in=ids):
        for receiver, result in signal.send_robust(sender=model, instance=instance):
            if isinstance(result, Exception):
                logger.error(
                    "signal receiver failed",
                    exc_info=result,
                    extra={
                        "action": "signal.receiver_failed",
                        "receiver": getattr(receiver, "__qualname__", repr(receiver)),
                        "object_id": str(instance.pk),
                    },
                )
