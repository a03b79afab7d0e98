"""Moved to ``deliveries.core.logs``; this path stays for one release."""

from deliveries.core.moved import alias

alias(__name__, "deliveries.core.logs")
