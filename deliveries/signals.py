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

from django.dispatch import Signal

from .core.signals import send_after_commit

__all__ = ["delivery_dead", "delivery_succeeded", "endpoint_disabled", "send_after_commit"]

# A delivery reached its receiver (2xx): ``instance`` is the Delivery.
delivery_succeeded = Signal()
# A delivery will not be tried again: its retries ran out, its endpoint answered 410 or
# was disabled, or an operator cancelled it. ``instance`` is the Delivery; why is in
# ``instance.last_outcome`` and ``instance.last_error``.
delivery_dead = Signal()
# An endpoint was disabled, by the failure clock, a 410, an operator or the API:
# ``instance`` is the Endpoint, ``instance.disabled_reason`` says why.
endpoint_disabled = Signal()
