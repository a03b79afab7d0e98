"""Signals a host project connects to, to react to what the pipeline did.

Each is sent once per object, after the transaction that made the change commits (never
for a change that rolled back), with the object as ``instance`` as Django's model
signals do. Receivers run in the process that made the change (a worker, the scheduler,
a web request) after its commit: a receiver that raises is logged and stops nothing, and
a slow one slows that process, so hand long work to a job.

    from django.dispatch import receiver
    from deliveries.signals import delivery_dead

    @receiver(delivery_dead)
    def tell_the_account_manager(sender, instance, **kwargs):
        ...  # instance.last_outcome, instance.last_error, instance.event_id

When nothing is connected, sending costs nothing: the rows are not read.
"""

import logging
from collections.abc import Iterable

from django.db import transaction
from django.dispatch import Signal

logger = logging.getLogger(__name__)

# A delivery reached its receiver (2xx): ``instance`` is the Delivery.
delivery_succeeded = Signal()
# A delivery will not be tried again: its retries ran out, its endpoint answered 410 or
# was disabled, or an operator cancelled it. ``instance`` is the Delivery; why is in
# ``instance.last_outcome`` and ``instance.last_error``.
delivery_dead = Signal()
# An endpoint was disabled, by the failure clock, a 410, an operator or the API:
# ``instance`` is the Endpoint, ``instance.disabled_reason`` says why.
endpoint_disabled = Signal()


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
