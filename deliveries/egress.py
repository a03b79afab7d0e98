"""Moved to ``deliveries.core.egress``; this path stays for one release."""

from deliveries.core.moved import alias

alias(__name__, "deliveries.core.egress")
