"""Moved to ``deliveries.core.admin_input``; this path stays for one release."""

from deliveries.core.moved import alias

alias(__name__, "deliveries.core.admin_input")
