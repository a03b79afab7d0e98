"""The customer portal: a tenant's own pages inside the host's Django, reached through a
short-lived, single-use signed link (``portal_url``), themed by the host.

    from deliveries.portal import portal_url

    url = portal_url(tenant, ttl=300)  # redirect the customer there, or put it in an iframe

docs/portal.md says how a host mounts, themes and links to it.
"""

from .links import portal_url

__all__ = ["portal_url"]
