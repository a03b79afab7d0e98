"""Publishing: the event and its deliveries in one statement, the idempotency lock, and
the signing secrets a delivery is signed with.
"""

from django.db.models import Q

from ..core.ids import UUID7_SQL
from ..core.sql import Statement
from ..jobs import wakeup
from ..models import (
    Delivery,
    Endpoint,
    EndpointSecret,
    Event,
)

# The event and one pending delivery per subscribed, enabled endpoint, in one statement
# (the ORM takes three and builds a model per row); the delivery table's trigger lists
# them (models.DeliveryListing). The subscription test is
# Endpoint.subscribes_to's (deliveries.catalogue): no event types means every type, else
# the filter holds one of ``patterns``, the type's name and its prefixes' wildcards.
# Columns the statement leaves out take the models' defaults, which the ORM path writes
# explicitly; keep both in step
# (tests/deliveries/test_pipeline.py compares them). When deliveries were written and are
# due now, the statement also wakes the scheduler (deliveries.jobs.wakeup.DUE): pg_notify is
# delivered with the caller's commit, never on a rollback, and PostgreSQL folds the
# notifications of one transaction into one. (A NOTIFY statement of its own cost the
# publishing process 150 µs a publish, a third of the rest.) Params: the event's columns
# (EVENT_COLUMNS, ``id``), ``now`` (its creation time), ``due``, ``patterns``
# (catalogue.filter_patterns of the type) and ``only`` (endpoint ids, or None for the
# subscribed ones).
PUBLISH = Statement(
    """
WITH event AS (
    INSERT INTO deliveries_event (id, tenant_id, event_type, payload_version, entity_id,
        body, priority, idempotency_key, request_hash, trace_context, created_at)
    VALUES (%(id)s, %(tenant_id)s, %(event_type)s, %(payload_version)s, %(entity_id)s,
        %(body)s, %(priority)s, %(idempotency_key)s, %(request_hash)s, %(trace_context)s,
        %(now)s)
    RETURNING id
), delivery AS (
    INSERT INTO deliveries_delivery (id, event_id, endpoint_id, tenant_id, state, priority,
        next_attempt_at, attempt_count, policy_attempts, dispatch_count, lease_expiries,
        last_outcome, last_error, created_at, updated_at)
    SELECT {uuid7}, event.id, endpoint.id, endpoint.tenant_id, 'pending',
        %(priority)s, %(due)s, 0, 0, 0, 0, '', '', %(now)s, %(now)s
    FROM event, deliveries_endpoint AS endpoint
    WHERE endpoint.tenant_id = %(tenant_id)s AND endpoint.enabled
        AND CASE WHEN %(only)b::uuid[] IS NULL
            THEN endpoint.event_types = '[]'::jsonb OR endpoint.event_types ?| %(patterns)b::text[]
            ELSE endpoint.id = ANY(%(only)b::uuid[]) END
    RETURNING 1
)
SELECT pg_notify('{due}', '') FROM (SELECT 1 FROM delivery LIMIT 1) AS written
WHERE %(due)s <= %(now)s
""".replace("{uuid7}", UUID7_SQL).replace("{due}", wakeup.DUE),
    returns="nothing",
)

EVENT_COLUMNS = (
    "tenant_id",
    "event_type",
    "payload_version",
    "entity_id",
    "body",
    "priority",
    "idempotency_key",
    "request_hash",
    "trace_context",
)


@PUBLISH.elsewhere
def _(params):
    event = Event(
        id=params["id"], created_at=params["now"], **{c: params[c] for c in EVENT_COLUMNS}
    )
    # Saved exactly as given (raw, as loaddata saves), so that the row holds the
    # creation time the caller's Event holds, as the PostgreSQL statement writes it.
    event.save_base(raw=True, force_insert=True)
    endpoints = Endpoint.objects.filter(tenant_id=params["tenant_id"], enabled=True).only(
        "id", "event_types"
    )
    only = params["only"]
    if only is not None:
        endpoints = endpoints.filter(id__in=only)
    Delivery.objects.bulk_create(
        [
            Delivery(
                event_id=event.id,
                endpoint_id=endpoint.id,
                tenant_id=params["tenant_id"],
                priority=params["priority"],
                next_attempt_at=params["due"],
            )
            for endpoint in endpoints
            if only is not None or endpoint.subscribes_to(params["event_type"])
        ]
    )


# An Idempotency-Key in use: a transaction-scoped advisory lock, not waited for. Params:
# [tenant id as text, key]; the row is (taken,).
TAKE_IDEMPOTENCY_LOCK = Statement(
    "SELECT pg_try_advisory_xact_lock(hashtext(%s), hashtext(%s))", returns="row", bound=False
)


@TAKE_IDEMPOTENCY_LOCK.elsewhere
def _(params):
    # SQLite: the IMMEDIATE transaction holds the write lock, so a second request with
    # the key waits for the first and then finds its event.
    return (True,)


# Signing secrets of endpoints, newest first, leaving out expired ones. Workers ask for
# every batch they lease, so on PostgreSQL it is one prepared statement (the ORM's
# compilation cost more than the query). "secret" is the legacy plain-text column
# (EndpointSecret.legacy_plaintext). Params: [endpoint ids, now]; rows (id, endpoint,
# secret_encrypted, legacy plain text).
ACTIVE_SECRETS = Statement("""
SELECT id, endpoint_id, secret_encrypted, secret FROM deliveries_endpointsecret
WHERE endpoint_id = ANY(%b::uuid[]) AND (expires_at IS NULL OR expires_at > %s)
ORDER BY created_at DESC
""")


@ACTIVE_SECRETS.elsewhere
def _(params):
    endpoint_ids, now = params
    return list(
        EndpointSecret.objects.filter(endpoint_id__in=endpoint_ids)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        .order_by("-created_at")
        .values_list("id", "endpoint_id", "secret_encrypted", "legacy_plaintext")
    )
