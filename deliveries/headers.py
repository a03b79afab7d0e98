"""Moved to ``deliveries.core.headers``; this path stays for one release."""

from deliveries.core.moved import alias

alias(__name__, "deliveries.core.headers")
