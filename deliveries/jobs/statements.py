"""The job machinery's fast-path statements, each defined once by name: its PostgreSQL
text and, directly below it, the same effect with the ORM for the other databases
(``sql.Statement``). The broker, the entity locks and the relay call them; what a call
gives back is the same shape on either database."""

import json

from django.db import IntegrityError, transaction
from django.db.models import F, Q

from ..core.sql import Statement
from .models import EntityLock, Outbox, QueueMessage

# The database broker's queue.

# The payloads travel as one JSON array of strings, not as a text[] parameter: psycopg
# builds an array literal in Python, quoting and escaping every element (about 7 µs for
# a message's JSON), where json.dumps of the list is one C call.
# Params: [queue, visible_at, created_at, JSON array of payloads, priorities]; rows (id,).
ENQUEUE_MESSAGES = Statement("""
INSERT INTO deliveries_queuemessage (queue, payload, priority, visible_at, receives, created_at)
SELECT %s, m.payload, p.priority, %s, 0, %s
FROM json_array_elements_text(%s::json) WITH ORDINALITY AS m(payload, i)
JOIN unnest(%b::int[]) WITH ORDINALITY AS p(priority, i) USING (i)
ORDER BY i
RETURNING id
""")


@ENQUEUE_MESSAGES.elsewhere
def _(params):
    queue, visible_at, created_at, tasks, priorities = params
    rows = QueueMessage.objects.bulk_create(
        [
            QueueMessage(
                queue=queue,
                payload=task,
                priority=p,
                visible_at=visible_at,
                created_at=created_at,
            )
            for task, p in zip(json.loads(tasks), priorities, strict=True)
        ]
    )
    return [(r.id,) for r in rows]


# A take, in the caller's transaction: lock visible messages of a queue, highest priority
# first (the index queue_visible), skipping those another take holds...
# Params: [queue, now, limit]; rows (id, payload).
LOCK_MESSAGES = Statement("""
SELECT id, payload FROM deliveries_queuemessage WHERE queue = %s AND visible_at <= %s
ORDER BY priority DESC, visible_at LIMIT %s FOR UPDATE SKIP LOCKED
""")


@LOCK_MESSAGES.elsewhere
def _(params):
    # SQLite: the IMMEDIATE transaction holds the write lock; nobody else takes.
    queue, now, limit = params
    return list(
        QueueMessage.objects.filter(queue=queue, visible_at__lte=now)
        .order_by("-priority", "visible_at")
        .values_list("id", "payload")[:limit]
    )


# ...then settle them: delete the spent, hide the rest for the visibility timeout. A
# spent message never gets a second row version: a delivery's message costs the queue an
# insert and a delete.
SETTLE_MESSAGES = Statement(
    """
WITH spent AS (DELETE FROM deliveries_queuemessage WHERE id = ANY(%(spent)b::bigint[]))
UPDATE deliveries_queuemessage SET visible_at = %(until)s, receives = receives + 1
WHERE id = ANY(%(hidden)b::bigint[])
""",
    returns="nothing",
)


@SETTLE_MESSAGES.elsewhere
def _(params):
    if params["spent"]:
        QueueMessage.objects.filter(id__in=params["spent"]).delete()
    if params["hidden"]:
        QueueMessage.objects.filter(id__in=params["hidden"]).update(
            visible_at=params["until"], receives=F("receives") + 1
        )


# The ids travel as one array parameter (bound_cursor), not quoted one by one.
# Params: [ids].
ACKNOWLEDGE_MESSAGES = Statement(
    "DELETE FROM deliveries_queuemessage WHERE id = ANY(%b::bigint[])", returns="nothing"
)


@ACKNOWLEDGE_MESSAGES.elsewhere
def _(params):
    (ids,) = params
    QueueMessage.objects.filter(id__in=ids).delete()


# The pipeline workers' take with the database broker: the committed outbox row is the
# queue entry. One statement claims unpublished rows of the kinds the worker processes,
# highest priority first, then oldest (the index outbox_claimable), skipping rows another
# take holds or a relay has claimed, and records their publication (published_at, as the
# relay did); then it locks visible messages on the queue table up to the same limit,
# which only a relay still running beside the workers writes there. The caller leases
# the jobs in the same transaction and settles the messages (SETTLE_MESSAGES).
# The claimed ids are handed to the UPDATE as one array, found by primary-key probes:
# as "id IN (SELECT ...)" the planner may join them to a sequential scan of the whole
# outbox, published rows and all (it does at 20,000 rows, for 200 ids).
# Params: {kinds, now, limit, queue}; rows (outbox id, ref_id, dispatch, priority, kind,
# None) for a claimed outbox row, (message id, None, None, None, None, payload) for a
# message, in no particular order.
TAKE = Statement("""
WITH claimed AS (
    UPDATE deliveries_outbox SET published_at = %(now)s
    WHERE id = ANY(ARRAY(
        SELECT id FROM deliveries_outbox
        WHERE published_at IS NULL AND kind = ANY(%(kinds)b::text[])
            AND (claimed_until IS NULL OR claimed_until < %(now)s)
        ORDER BY priority DESC, created_at LIMIT %(limit)s FOR UPDATE SKIP LOCKED
    ))
    RETURNING id, ref_id, dispatch, priority, kind
), queued AS (
    SELECT id, payload FROM deliveries_queuemessage
    WHERE queue = %(queue)s AND visible_at <= %(now)s
    ORDER BY priority DESC, visible_at
    LIMIT greatest(0, %(limit)s - (SELECT count(*) FROM claimed)) FOR UPDATE SKIP LOCKED
)
SELECT id, ref_id, dispatch, priority, kind, NULL::text FROM claimed
UNION ALL
SELECT id, NULL::uuid, NULL::int, NULL::smallint, NULL::text, payload FROM queued
""")


@TAKE.elsewhere
def _(params):
    # SQLite: the IMMEDIATE transaction holds the write lock; nobody else takes.
    now, limit = params["now"], params["limit"]
    rows = list(
        Outbox.objects.filter(published_at__isnull=True, kind__in=params["kinds"])
        .filter(Q(claimed_until__isnull=True) | Q(claimed_until__lt=now))
        .order_by("-priority", "created_at")
        .values_list("id", "ref_id", "dispatch", "priority", "kind")[:limit]
    )
    Outbox.objects.filter(id__in=[r[0] for r in rows]).update(published_at=now)
    claimed = [(*r, None) for r in rows]
    if len(claimed) >= limit:
        return claimed
    queued = LOCK_MESSAGES([params["queue"], now, limit - len(claimed)])
    return claimed + [(i, None, None, None, None, payload) for i, payload in queued]


# Entity locks.

# Take free keys, take over expired locks, or renew our own: one statement (and, in
# autocommit, one commit) for any number of keys. A row held by another owner and not
# expired is left alone, and its key does not come back. Keys are taken in sorted order,
# so two takers of overlapping sets cannot deadlock. Rows (key,): the keys now held.
ACQUIRE_LOCKS = Statement("""
INSERT INTO deliveries_entitylock (key, owner, expires_at)
SELECT key, %(owner)s, %(expires)s FROM unnest(%(keys)b::text[]) AS key ORDER BY key
ON CONFLICT (key) DO UPDATE SET owner = EXCLUDED.owner, expires_at = EXCLUDED.expires_at
WHERE deliveries_entitylock.expires_at < %(now)s
    OR deliveries_entitylock.owner = EXCLUDED.owner
RETURNING key
""")


@ACQUIRE_LOCKS.elsewhere
def _(params):
    owner, expires, now = params["owner"], params["expires"], params["now"]
    return [(key,) for key in params["keys"] if _acquire_one(key, owner, expires, now)]


def _acquire_one(key, owner, expires, now) -> bool:
    # Take over an expired lock, or renew our own: one guarded UPDATE.
    taken = EntityLock.objects.filter(key=key, expires_at__lt=now).update(
        owner=owner, expires_at=expires
    ) or EntityLock.objects.filter(key=key, owner=owner).update(expires_at=expires)
    if taken:
        return True
    try:
        with transaction.atomic():
            EntityLock.objects.create(key=key, owner=owner, expires_at=expires)
    except IntegrityError:
        return False  # somebody else holds it (the primary key is the uniqueness)
    return True


# Release the keys ``%(lock_keys)s`` that ``%(owner)s`` holds, as one part of a statement
# of the caller's (a CTE of the statement that records the work done under the locks).
# PostgreSQL only, and not a statement of its own: the caller's statement runs it.
RELEASE_SQL = """
DELETE FROM deliveries_entitylock WHERE key = ANY(%(lock_keys)b::text[]) AND owner = %(owner)s
"""


# The relay's outbox pages.

# One page of unpublished rows that no relay holds a claim on, oldest first, locked so
# that relays divide the work, with one column set. The inner SELECT uses the partial
# index outbox_unpublished. RETURNING gives the rows in no particular order.
_OUTBOX_PAGE = """
UPDATE deliveries_outbox SET {column} = %(value)s
WHERE id IN (
    SELECT id FROM deliveries_outbox
    WHERE published_at IS NULL AND (claimed_until IS NULL OR claimed_until < %(now)s)
    ORDER BY id LIMIT %(limit)s FOR UPDATE SKIP LOCKED
)
RETURNING id, ref_id, dispatch, priority, kind
"""


def _outbox_page(params, column: str) -> list[tuple]:
    with transaction.atomic():
        rows = list(
            Outbox.objects.filter(published_at__isnull=True)
            .filter(Q(claimed_until__isnull=True) | Q(claimed_until__lt=params["now"]))
            .order_by("id")
            .values_list("id", "ref_id", "dispatch", "priority", "kind")[: params["limit"]]
        )
        Outbox.objects.filter(id__in=[r[0] for r in rows]).update(**{column: params["value"]})
    return rows


# The page of a relay publishing to a broker outside the database: claimed (claimed_until
# set to the end of the claim) for the time it takes to publish it with no transaction
# open. Params: {value: claimed until, now, limit}; rows (id, ref_id, dispatch, priority,
# kind).
CLAIM_OUTBOX_PAGE = Statement(_OUTBOX_PAGE.format(column="claimed_until"))


@CLAIM_OUTBOX_PAGE.elsewhere
def _(params):
    return _outbox_page(params, "claimed_until")


# The database broker's page: marked published (published_at set) inside the transaction
# that inserts its messages. Params and rows as CLAIM_OUTBOX_PAGE's, value the time.
PUBLISH_OUTBOX_PAGE = Statement(_OUTBOX_PAGE.format(column="published_at"))


@PUBLISH_OUTBOX_PAGE.elsewhere
def _(params):
    return _outbox_page(params, "published_at")


# A claimed page, once published. The ids travel as one array parameter on PostgreSQL
# (the ORM's IN list of a 2,000-row page cost more Python than the rest of the relay's
# page). Params: [now, ids].
MARK_PUBLISHED = Statement(
    """
UPDATE deliveries_outbox SET published_at = %s
WHERE id = ANY(%b::bigint[]) AND published_at IS NULL
""",
    returns="nothing",
)


@MARK_PUBLISHED.elsewhere
def _(params):
    now, ids = params
    Outbox.objects.filter(id__in=ids, published_at__isnull=True).update(published_at=now)
