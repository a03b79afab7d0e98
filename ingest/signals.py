"""The signal a host connects to for inbound work, sent as deliveries.signals are: once
per object, after the commit that stored it, with the object as ``instance``."""

from django.dispatch import Signal

# An inbound event was stored for processing: a verified webhook or a polled record, not
# a duplicate copy and not a rejected body. ``instance`` is the InboundEvent. Handlers
# (docs/inbound.md) are the place for the event's own work; this signal is for telling
# the host it arrived.
inbound_event_stored = Signal()
