"""The inbound soak's handler (loaded with INGEST_HANDLER_MODULES=tests.chaos.handlers).

Its effect is one row in ``chaos_effect`` per application, written inside the processing
transaction like any real handler's writes. The table has no unique constraint on
purpose: a second application of an event would show up as a second row, which is what
the ledger counts. ``see_stale=True`` so that events arriving out of order are applied
too (the ordering rule is checked separately, on ``EntityVersion``).
"""

from django.db import connection

from ingest.handlers import ParsedEvent, handler

SOURCE = "soak-in"
EFFECT_TABLE_SQL = (
    "CREATE TABLE IF NOT EXISTS chaos_effect ("
    " id bigserial PRIMARY KEY, event_id text NOT NULL, entity_id text NOT NULL,"
    " occurred_at timestamptz, applied_at timestamptz NOT NULL DEFAULT now())"
)


@handler(SOURCE, "*", see_stale=True)
def record_effect(event: ParsedEvent) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO chaos_effect (event_id, entity_id, occurred_at) VALUES (%s, %s, %s)",
            [event.event_id, event.entity_id, event.occurred_at],
        )
