"""The reads beside the fast path: egress allowances, the oldest due delivery, the event
types seen.
"""

from django.db.models import Min

from ..core.sql import Statement
from ..models import (
    Delivery,
    EgressAllowance,
    Event,
)
from . import PENDING

# The egress allowances of tenants, by the tenant index; the tenant ids travel as one
# array parameter: the ORM's IN list of a 200-target batch cost 3.5 ms. Params: [tenant
# ids]; rows (tenant, endpoint or None, network).
TENANT_ALLOWANCES = Statement("""
SELECT tenant_id, endpoint_id, network FROM deliveries_egressallowance
WHERE tenant_id = ANY(%b::uuid[])
""")


@TENANT_ALLOWANCES.elsewhere
def _(params):
    (tenant_ids,) = params
    return list(
        EgressAllowance.objects.filter(tenant_id__in=tenant_ids).values_list(
            "tenant_id", "endpoint_id", "network"
        )
    )


# The oldest due pending delivery, by a skip scan over the partial index delivery_due
# (-priority, next_attempt_at): one index probe per distinct priority instead of reading
# every pending row, however deep the backlog. The row is (next_attempt_at or None,).
OLDEST_DUE = Statement(
    """
WITH RECURSIVE p AS (
    (SELECT priority FROM deliveries_delivery WHERE state = 'pending'
     ORDER BY priority DESC LIMIT 1)
    UNION ALL
    SELECT (SELECT d.priority FROM deliveries_delivery d
            WHERE d.state = 'pending' AND d.priority < p.priority
            ORDER BY d.priority DESC LIMIT 1)
    FROM p WHERE p.priority IS NOT NULL
)
SELECT min((SELECT d.next_attempt_at FROM deliveries_delivery d
            WHERE d.state = 'pending' AND d.priority = p.priority
            ORDER BY d.next_attempt_at LIMIT 1))
FROM p WHERE p.priority IS NOT NULL
""",
    returns="row",
    bound=False,
)


@OLDEST_DUE.elsewhere
def _(params):
    return (Delivery.objects.filter(state=PENDING).aggregate(m=Min("next_attempt_at"))["m"],)


# The event types published, by a skip scan of the event table's type index: one index
# probe per type, however many events (the admin's event-type filter at millions of
# rows). Params: {most}; rows (event type,), at most ``most``, in name order.
EVENT_TYPES_SEEN = Statement("""
WITH RECURSIVE types AS (
    (SELECT event_type, 1 AS n FROM deliveries_event ORDER BY event_type LIMIT 1)
    UNION ALL
    SELECT (SELECT e.event_type FROM deliveries_event e WHERE e.event_type > t.event_type
            ORDER BY e.event_type LIMIT 1), t.n + 1
    FROM types t WHERE t.event_type IS NOT NULL AND t.n < %(most)s
)
SELECT event_type FROM types WHERE event_type IS NOT NULL
""")


@EVENT_TYPES_SEEN.elsewhere
def _(params):
    seen = Event.objects.order_by("event_type").values_list("event_type", flat=True).distinct()
    return [(t,) for t in seen[: params["most"]]]
