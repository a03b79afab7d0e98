"""The delivery log's admin pages with 1,000,000 deliveries on PostgreSQL.

Target: the list and filtered pages stay under 200 ms. This is a
measurement, not a timed test:

    .venv/bin/python bench/admin_log.py                  # generate once, then measure
    .venv/bin/python bench/admin_log.py --regenerate     # throw the data away first

1. A dedicated database, ``webhooks_admin_bench`` (created if missing, migrated on every
   run), so the 1M rows never meet the test suite's or ``outbound.py``'s data.
2. Unless it is there already (``--regenerate`` drops and recreates the database), a
   synthetic history written with set-based SQL (``INSERT … SELECT … FROM
   generate_series``, one statement per batch of events and one per batch of deliveries
   with their attempts; keys, indexes and foreign keys built afterwards): 50 tenants of
   very different sizes, 500 endpoints, 500,000 events of nine types fanned out to 2
   endpoints each, so 1,000,000 deliveries over 30 days, ~1.35 attempts each. The values
   come from a hash of the row number, so every generation writes the same rows
   (relative to its start time). Then ``VACUUM (ANALYZE)``: statistics, and the hint
   bits and visibility map a table that autovacuum had been keeping would have.
3. In-process (``django.test.Client``, a superuser logged in with ``force_login``), each
   admin page once to warm up, then ``--runs`` rounds over all pages: wall time of the
   request, the CPU time of this process (Python: views, templates, the driver), the SQL
   statements it ran (``CaptureQueriesContext``: count, sum, the slowest), and the
   share of the machine's CPU used by anything else meanwhile ("others' CPU": other
   engineers' work on a shared machine, but also the page's own PostgreSQL parallel
   workers, which are separate processes).
4. A Markdown table on stdout and ``bench/results/admin_log.json``; for every page whose
   median is over ``--budget-ms``, ``EXPLAIN (ANALYZE, BUFFERS)`` of its slowest statement
   (``--explain-all``: of every page's).

The data are warm (just generated, or read by the warm-up request): these are the figures
of a server whose working set is in memory (here mostly the OS page cache: the local
server keeps the default 128 MB of shared_buffers).
"""

import argparse
import hashlib
import html
import json
import os
import re
import statistics
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import outbound  # the bench directory is not a package; database helpers live there

# --db-name picks another (a checkout whose migrations differ needs its own database).
DB_NAME = "webhooks_admin_bench"
BASE_URL = "postgres://webhooks@127.0.0.1:5432/postgres"
RESULT_FILE = outbound.RESULTS / "admin_log.json"

TENANTS = 50
ENDPOINTS_PER_TENANT = 10
FANOUT = 2  # deliveries per event: one event goes to two of its tenant's endpoints
SPAN = timedelta(days=30)
BATCH_EVENTS = 100_000

# (name, share of events): a few busy types and a rare one, so that the event-type filter
# is measured both where matches are dense and where they are sparse.
EVENT_TYPES = [
    ("order.created", 0.25),
    ("order.paid", 0.20),
    ("order.shipped", 0.15),
    ("customer.updated", 0.15),
    ("invoice.created", 0.10),
    ("invoice.paid", 0.08),
    ("subscription.renewed", 0.05),
    ("refund.created", 0.015),
    ("invoice.voided", 0.005),
]
COMMON_TYPE, RARE_TYPE = "order.created", "invoice.voided"

# How dead deliveries ended (share of dead rows).
DEAD_OUTCOMES = [
    ("retry", 0.55),
    ("permanent", 0.20),
    ("endpoint_gone", 0.10),
    ("endpoint_disabled", 0.08),
    ("cancelled", 0.04),
    ("blocked", 0.02),
    ("lease_expired", 0.01),
]


# --- Data ----------------------------------------------------------------------------


def _u(expr: str, salt: int) -> str:
    """SQL for a uniform value in [0, 1) that depends only on ``expr`` and ``salt``."""
    return f"((hashint8extended(({expr})::bigint, {salt}) & 2147483647)::float8 / 2147483648)"


def _pick(u: str, choices: list[tuple[str, float]]) -> str:
    """SQL CASE choosing a name by cumulative share."""
    arms, total = [], 0.0
    for name, share in choices[:-1]:
        total += share
        arms.append(f"WHEN {u} < {total:.4f} THEN '{name}'")
    return f"CASE {' '.join(arms)} ELSE '{choices[-1][0]}' END"


def _md5_uuid(text: str) -> uuid.UUID:
    """The id ``md5(text)::uuid`` gives in PostgreSQL."""
    return uuid.UUID(hashlib.md5(text.encode(), usedforsecurity=False).hexdigest())


def _event_columns(e: str) -> str:
    """Tenant, creation time and type of event number ``e``: shared by both inserts so
    that a delivery lands on its event's tenant at its event's time."""
    return f"""
        floor(%(tenants)s * power({_u(e, 1)}, 2))::int AS t,
        %(t0)s::timestamptz - %(span)s::interval * (1 - ({e} + 0.5) / %(events)s) AS created,
        {_pick(_u(e, 2), EVENT_TYPES)} AS event_type"""


# The tenant is drawn with a squared uniform: tenant 0 gets ~14 % of the events, tenant 49
# ~1 %, as in a real multi-tenant service where one customer dwarfs the others.
EVENTS_SQL = f"""
INSERT INTO deliveries_event (id, tenant_id, event_type, payload_version, entity_id, body,
                              priority, idempotency_key, request_hash, created_at)
SELECT md5('event' || e)::uuid, md5('tenant' || t)::uuid, event_type, 1, entity_id,
       convert_to('{{"type":"' || event_type || '","id":"' || md5('event' || e)::uuid
                  || '","data":{{"entity":"' || entity_id || '","amount":' || mod(e, 9973)
                  || ',"currency":"EUR","note":"' || repeat('x', 200 + mod(e, 300)::int)
                  || '"}}}}', 'UTF8'),
       0, NULL, '', created
FROM (
    SELECT e, {_event_columns("e")},
           'ent_' || floor({_u("e", 3)} * %(events)s / 4)::bigint AS entity_id
    FROM generate_series(%(lo)s::bigint, %(hi)s::bigint - 1) AS e
) s
"""

# The CTEs are MATERIALIZED because each one's CASE refers to the one before's: inlined,
# every reference re-evaluates the whole chain of expressions (2x slower here).
# States by age: the last hour holds the in-flight rows, the last three days the retries
# still waiting; older rows are terminal. Dead rows carry the outcome that killed them.
# ``attempts`` counts Attempt rows written; a leased row has one more attempt counted (the
# lease increments attempt_count) whose row is not written yet.
DELIVERIES_SQL = f"""
WITH base AS MATERIALIZED (
    SELECT k, e, t, created, event_type,
           CASE WHEN slot = 0 THEN j0
                ELSE mod(j0 + 1 + floor(9 * {_u("e", 5)})::int, %(per_tenant)s) END AS j,
           {_u("k", 6)} AS u_state, {_u("k", 7)} AS u_outcome, {_u("k", 8)} AS u_count,
           {_u("k", 9)} AS u_code
    FROM (
        SELECT k, k / {FANOUT} AS e, mod(k, {FANOUT}) AS slot, {_event_columns(f"k / {FANOUT}")},
               floor(%(per_tenant)s * power({_u(f"k / {FANOUT}", 4)}, 2))::int AS j0
        FROM generate_series(%(lo)s::bigint * {FANOUT}, %(hi)s::bigint * {FANOUT} - 1) AS k
    ) s
), stated AS MATERIALIZED (
    SELECT *,
           CASE
             WHEN created > %(t0)s::timestamptz - interval '1 hour' THEN
               CASE WHEN u_state < 0.60 THEN 'succeeded' WHEN u_state < 0.75 THEN 'pending'
                    WHEN u_state < 0.90 THEN 'enqueued' ELSE 'leased' END
             WHEN created > %(t0)s::timestamptz - interval '3 days' THEN
               CASE WHEN u_state < 0.95 THEN 'succeeded' WHEN u_state < 0.97 THEN 'dead'
                    ELSE 'pending' END
             ELSE CASE WHEN u_state < 0.975 THEN 'succeeded' ELSE 'dead' END
           END AS state
    FROM base
), outcomes AS MATERIALIZED (
    SELECT *,
           CASE state
             WHEN 'succeeded' THEN 'success'
             WHEN 'dead' THEN {_pick("u_outcome", DEAD_OUTCOMES)}
             WHEN 'pending' THEN CASE WHEN created > %(t0)s::timestamptz - interval '1 hour'
                                      AND u_outcome < 0.5 THEN '' ELSE 'retry' END
             ELSE CASE WHEN u_outcome < 0.7 THEN '' ELSE 'retry' END
           END AS last_outcome
    FROM stated
), counted AS MATERIALIZED (
    SELECT *,
           CASE
             WHEN last_outcome = 'success' THEN
               CASE WHEN u_count < 0.80 THEN 1 WHEN u_count < 0.95 THEN 2 ELSE 3 END
             WHEN state = 'dead' AND last_outcome IN ('retry', 'lease_expired') THEN 8
             WHEN last_outcome = 'endpoint_disabled' THEN 2
             WHEN last_outcome = 'cancelled' THEN (u_count < 0.5)::int
             WHEN state = 'dead' THEN 1
             WHEN last_outcome = '' THEN 0
             ELSE 1 + floor(u_count * 3)::int
           END AS attempts
    FROM outcomes
), d AS (
    SELECT *,
           md5('delivery' || k)::uuid AS id,
           attempts + (state = 'leased')::int AS attempt_count,
           CASE WHEN attempts > 0
                THEN created + interval '0.5 s' + interval '30 s' * (power(2, attempts - 1) - 1)
           END AS last_attempt_at,
           CASE
             WHEN last_outcome = 'success' THEN 200
             WHEN last_outcome = 'retry' THEN
               CASE WHEN u_code < 0.6 THEN 503 WHEN u_code < 0.8 THEN 500
                    WHEN u_code < 0.9 THEN 429 END
             WHEN last_outcome = 'permanent' THEN CASE WHEN u_code < 0.7 THEN 400 ELSE 422 END
             WHEN last_outcome = 'endpoint_gone' THEN 410
           END AS last_status_code
    FROM counted
), inserted AS (
    INSERT INTO deliveries_delivery (
        id, event_id, endpoint_id, tenant_id, state, priority, next_attempt_at, attempt_count,
        policy_attempts, dispatch_count, enqueued_at, lease_until, lease_token,
        lease_expiries, last_outcome, last_status_code, last_error, last_attempt_at,
        created_at, updated_at, finished_at)
    SELECT id, md5('event' || e)::uuid, md5('endpoint' || (t * %(per_tenant)s + j))::uuid,
           md5('tenant' || t)::uuid, state, 0,
           CASE WHEN state = 'pending' AND last_outcome = 'retry'
                THEN %(t0)s::timestamptz + interval '6 hours' * u_code
                ELSE coalesce(last_attempt_at, created) END,
           attempt_count, attempt_count, attempt_count + (state = 'enqueued')::int,
           CASE WHEN state <> 'pending' THEN coalesce(last_attempt_at, created)
                + interval '0.1 s' END,
           CASE WHEN state = 'leased' THEN %(t0)s::timestamptz + interval '30 s' END,
           CASE WHEN state = 'leased' THEN md5('lease' || k)::uuid END,
           (last_outcome = 'lease_expired')::int, last_outcome, last_status_code,
           CASE
             WHEN last_outcome = 'retry' AND last_status_code IS NULL
               THEN 'timeout: no answer within 30 s'
             WHEN last_outcome = 'blocked' THEN 'blocked: resolves to a private address'
             WHEN last_outcome = 'endpoint_disabled' THEN 'endpoint disabled'
             WHEN last_outcome = 'cancelled' THEN 'cancelled by an operator'
             WHEN last_outcome = 'lease_expired' THEN 'lease expired, retries spent'
             ELSE ''
           END,
           last_attempt_at, created,
           coalesce(last_attempt_at, created) + interval '1 s',
           CASE WHEN state IN ('succeeded', 'dead')
                THEN coalesce(last_attempt_at, created) + interval '1 s' END
    FROM d
    RETURNING 1
)
INSERT INTO deliveries_attempt (
    delivery_id, endpoint_id, number, started_at, duration_ms, status_code, outcome,
    error_kind, error, ambiguous, response_body, response_truncated, request_headers,
    recorded, worker)
SELECT id, md5('endpoint' || (t * %(per_tenant)s + j))::uuid, n, started,
       20 + 400 * {_u("k * 16 + n", 10)},
       CASE WHEN final THEN last_status_code ELSE 503 END, outcome,
       CASE WHEN outcome = 'blocked' THEN 'blocked'
            WHEN outcome = 'retry' AND final AND last_status_code IS NULL THEN 'timeout'
            ELSE '' END,
       CASE WHEN outcome = 'blocked' THEN 'resolves to a private address'
            WHEN outcome = 'retry' AND final AND last_status_code IS NULL
              THEN 'no answer within 30 s'
            ELSE '' END,
       outcome = 'retry' AND final AND last_status_code IS NULL,
       CASE WHEN outcome = 'success' THEN 'ok' WHEN outcome = 'blocked' THEN ''
            ELSE '{{"error":"unavailable"}}' END,
       false,
       jsonb_build_object('content-type', 'application/json', 'webhook-id', id::text,
                          'webhook-timestamp', floor(extract(epoch FROM started))::text,
                          'idempotency-key', id::text),
       true, 'worker-' || mod(k, 4)
FROM (
    SELECT d.*, n, n = attempts AND state <> 'leased' AS final,
           created + interval '0.5 s' + interval '30 s' * (power(2, n - 1) - 1) AS started,
           CASE WHEN n = attempts AND state <> 'leased'
                     AND last_outcome IN ('success', 'permanent', 'endpoint_gone', 'blocked')
                THEN last_outcome ELSE 'retry' END AS outcome
    FROM d CROSS JOIN LATERAL generate_series(1, attempts) AS n
) a
"""

DATA_TABLES = (
    "deliveries_attempt",
    "deliveries_delivery",
    "deliveries_deliverylisting",
    "deliveries_event",
    "deliveries_endpoint",
    "deliveries_tenant",
    "deliveries_eventtype",
)


def dataset() -> dict | None:
    """What an earlier invocation generated here (None: nothing, or not all of it)."""
    if not outbound.sql("SELECT to_regclass('bench_admin_dataset')")[0][0]:
        return None
    rows = outbound.sql("SELECT deliveries, events, generated_at, seconds FROM bench_admin_dataset")
    if not rows:
        return None
    deliveries, events, generated_at, seconds = rows[0]
    if outbound.sql("SELECT count(*) FROM deliveries_delivery")[0][0] != deliveries:
        return None
    return {
        "deliveries": deliveries,
        "events": events,
        "generated_at": generated_at.isoformat(),
        "seconds": seconds,
    }


# The three big tables. Loading them with their keys, indexes and foreign keys in place
# would maintain ~15 B-trees row by row (five of them on random UUIDs) and queue a
# deferred foreign-key check per row. Instead, as pg_restore does: rows first, then each
# index built in one sorted pass and each foreign key validated with one join.
BULK_TABLES = (
    "deliveries_event",
    "deliveries_delivery",
    "deliveries_deliverylisting",
    "deliveries_attempt",
)


def bulk_ddl() -> tuple[list[str], list[str]]:
    """(drop, create) statements for every key, index and foreign key of BULK_TABLES
    (and foreign keys pointing at them), from the catalog, so that the rebuilt schema is
    the one the migrations made, names included."""
    tables = "ARRAY[" + ", ".join(f"'{t}'::regclass" for t in BULK_TABLES) + "]"
    fks = outbound.sql(
        "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) FROM pg_constraint"
        f" WHERE contype = 'f' AND (conrelid = ANY({tables}) OR confrelid = ANY({tables}))"
        " ORDER BY 1, 2"
    )
    keys = outbound.sql(
        "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) FROM pg_constraint"
        f" WHERE contype IN ('p', 'u') AND conrelid = ANY({tables}) ORDER BY 1, 2"
    )
    indexes = outbound.sql(
        "SELECT i.indexrelid::regclass::text, pg_get_indexdef(i.indexrelid) FROM pg_index i"
        f" WHERE i.indrelid = ANY({tables}) AND NOT EXISTS (SELECT 1 FROM pg_constraint c"
        " WHERE c.conindid = i.indexrelid AND c.contype IN ('p', 'u')) ORDER BY 1"
    )
    drop = [f'ALTER TABLE {t} DROP CONSTRAINT "{n}"' for t, n, _ in fks + keys]
    drop += [f"DROP INDEX {n}" for n, _ in indexes]
    create = [f'ALTER TABLE {t} ADD CONSTRAINT "{n}" {d}' for t, n, d in keys]
    create += [d for _, d in indexes]
    create += [f'ALTER TABLE {t} ADD CONSTRAINT "{n}" {d}' for t, n, d in fks]
    return drop, create


def recreate_database(env: dict) -> None:
    """A fresh, migrated, empty bench database. Also what makes an interrupted load
    harmless: it may have left the big tables without their indexes."""
    import psycopg
    from django.db import connections

    connections.close_all()
    with psycopg.connect(BASE_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{DB_NAME}"')
    outbound.ensure_database(BASE_URL, DB_NAME)
    outbound.migrate(env)


def generate(deliveries: int) -> dict:
    """Write the synthetic history into the empty tables of a fresh database: tenants,
    endpoints, event types, then events and their deliveries and attempts in batches
    (one transaction each), then the indexes and foreign keys."""
    events = deliveries // FANOUT
    t0 = datetime.now(UTC).replace(microsecond=0)
    params = {
        "tenants": TENANTS,
        "per_tenant": ENDPOINTS_PER_TENANT,
        "events": events,
        "t0": t0,
        "span": SPAN,
    }
    started = time.perf_counter()
    # Session settings for a bulk load: bigger sorts for the index builds; no wait for the
    # WAL flush at each batch's commit (a crash means regenerating anyway); and no JIT: the
    # planner's cost estimate for a batch (millions, from generate_series's default row
    # count) turns on JIT with optimisation: 24 of the 27 s of a 20,000-event test batch
    # went to compiling.
    outbound.sql("SET maintenance_work_mem = '256MB'")
    outbound.sql("SET synchronous_commit = off")
    outbound.sql("SET jit = off")
    drop, create = bulk_ddl()
    for statement in drop:
        outbound.sql(statement)
    outbound.sql(
        "INSERT INTO deliveries_tenant (id, name, created_at)"
        " SELECT md5('tenant' || t)::uuid, 'tenant-' || lpad(t::text, 2, '0'),"
        " %(t0)s::timestamptz - interval '400 days' FROM generate_series(0, %(tenants)s - 1) t",
        params,
    )
    # Every 97th endpoint is disabled, as the failure policy leaves some.
    outbound.sql(
        "INSERT INTO deliveries_endpoint (id, tenant_id, url, description, event_types,"
        " enabled, disabled_reason, disabled_at, headers, retry_client_errors, created_at,"
        " updated_at)"
        " SELECT md5('endpoint' || n)::uuid, md5('tenant' || (n / %(per_tenant)s))::uuid,"
        " 'https://hooks.tenant-' || (n / %(per_tenant)s) || '.example.com/webhooks/' || n,"
        " '', '[]', mod(n, 97) <> 5,"
        " CASE WHEN mod(n, 97) = 5 THEN 'failing for 3 days' ELSE '' END,"
        " CASE WHEN mod(n, 97) = 5 THEN %(t0)s::timestamptz - interval '2 days' END,"
        " '{}', false, %(t0)s::timestamptz - interval '300 days',"
        " %(t0)s::timestamptz - interval '300 days'"
        " FROM generate_series(0, %(tenants)s * %(per_tenant)s - 1) n",
        params,
    )
    for name, share in EVENT_TYPES:
        outbound.sql(
            "INSERT INTO deliveries_eventtype (name, owner, description, replay_safe)"
            " VALUES (%s, %s, %s, %s)",
            [name, name.split(".")[0] + "-team", f"{share:.1%} of the bench's events", True],
        )
    for lo in range(0, events, BATCH_EVENTS):
        batch = {**params, "lo": lo, "hi": min(events, lo + BATCH_EVENTS)}
        t = time.perf_counter()
        outbound.sql(EVENTS_SQL, batch)
        outbound.sql(DELIVERIES_SQL, batch)
        print(
            f"  events {batch['hi']:,}/{events:,}, deliveries {batch['hi'] * FANOUT:,}"
            f" ({time.perf_counter() - t:.1f} s)",
            flush=True,
        )
    rows_done = time.perf_counter() - started
    for statement in create:
        outbound.sql(statement)
    outbound.sql("RESET maintenance_work_mem")
    outbound.sql("RESET synchronous_commit")
    outbound.sql("RESET jit")
    loaded = time.perf_counter() - started
    print(
        f"  rows in {rows_done:.1f} s, keys, indexes and foreign keys in"
        f" {loaded - rows_done:.1f} s",
        flush=True,
    )
    t = time.perf_counter()
    # Statistics, hint bits and the visibility map: what autovacuum gives a table that has
    # been in service, and what the planner's estimates depend on.
    outbound.sql(f"VACUUM (ANALYZE) {', '.join(DATA_TABLES)}")
    vacuum = time.perf_counter() - t
    outbound.sql(
        "CREATE TABLE bench_admin_dataset (deliveries bigint, events bigint,"
        " generated_at timestamptz, seconds float8)"
    )
    outbound.sql(
        "INSERT INTO bench_admin_dataset VALUES (%s, %s, %s, %s)",
        [deliveries, events, t0, round(loaded, 1)],
    )
    print(f"  loaded in {loaded:.1f} s, VACUUM (ANALYZE) {vacuum:.1f} s", flush=True)
    return {
        "deliveries": deliveries,
        "events": events,
        "generated_at": t0.isoformat(),
        "seconds": round(loaded, 1),
        "vacuum_analyze_seconds": round(vacuum, 1),
    }


# The overview's tallies (deliveries.models.AttemptMinute, EndpointHour) as the workers
# write them, for the 24 hours before the measurement: every minute and every hour of
# every endpoint, each outcome, from WRITERS recording connections. That is the most rows
# a day of 500 endpoints and 4 workers can leave (17,280 minute rows; 150,000 hour rows,
# the hour the window starts in included), whatever the traffic: a day of a million
# deliveries leaves as many. Rewritten at every run, relative to its time, so the window
# is always full.
WRITERS = 4
TALLY_OUTCOMES = ("success", "retry", "permanent")
TALLIES_SQL = f"""
DELETE FROM deliveries_attemptminute;
DELETE FROM deliveries_endpointhour;
INSERT INTO deliveries_attemptminute (minute, outcome, writer, attempts)
SELECT m, o, w, 1 + (hashint8extended(extract(epoch FROM m)::bigint * 7 + w, 3) & 255)
FROM generate_series(date_trunc('minute', now()) - interval '1439 minutes',
                     date_trunc('minute', now()), interval '1 minute') AS m,
     unnest(ARRAY{list(TALLY_OUTCOMES)}) AS o, generate_series(1, {WRITERS}) AS w;
INSERT INTO deliveries_endpointhour (hour, endpoint_id, outcome, writer, attempts, total_ms,
    le_5ms, le_10ms, le_20ms, le_50ms, le_100ms, le_200ms, le_500ms, le_1000ms, le_2000ms,
    le_5000ms, le_10000ms, le_30000ms, slower)
SELECT h, e.id, o, w, 100, 100 * 80.0, 5, 10, 20, 20, 15, 10, 8, 5, 3, 2, 1, 1, 0
FROM generate_series(date_trunc('hour', now()) - interval '24 hours',
                     date_trunc('hour', now()), interval '1 hour') AS h,
     deliveries_endpoint e, unnest(ARRAY{list(TALLY_OUTCOMES)}) AS o,
     generate_series(1, {WRITERS}) AS w;
ANALYZE deliveries_attemptminute, deliveries_endpointhour;
"""


def write_tallies() -> dict:
    for statement in TALLIES_SQL.split(";"):
        if statement.strip():
            outbound.sql(statement)
    return {
        "attempt_minute_rows": outbound.sql("SELECT count(*) FROM deliveries_attemptminute")[0][0],
        "endpoint_hour_rows": outbound.sql("SELECT count(*) FROM deliveries_endpointhour")[0][0],
    }


def describe_data() -> dict:
    """Row counts and sizes: what the figures were measured on."""
    states = dict(
        outbound.sql("SELECT state, count(*) FROM deliveries_delivery GROUP BY 1 ORDER BY 2 DESC")
    )
    sizes = {
        table: {
            "rows": outbound.sql(f"SELECT count(*) FROM {table}")[0][0],
            "table_mb": round(outbound.sql(f"SELECT pg_table_size('{table}')")[0][0] / 2**20),
            "indexes_mb": round(outbound.sql(f"SELECT pg_indexes_size('{table}')")[0][0] / 2**20),
        }
        for table in DATA_TABLES
    }
    return {"states": states, "tables": sizes}


# --- Pages ---------------------------------------------------------------------------


def _q(**params: str) -> str:
    from urllib.parse import urlencode

    return "?" + urlencode(params)


def pick_subjects(client) -> dict:
    """Ids that the pages filter on: the biggest and smallest tenant and endpoint, a dead
    delivery with a full attempt timeline, the largest dead-letter group, the date links
    the admin's DateFieldListFilter renders."""
    sql = outbound.sql
    tenants = sql(
        "SELECT tenant_id, count(*) FROM deliveries_delivery GROUP BY 1 ORDER BY 2 DESC, 1"
    )
    endpoints = sql(
        "SELECT endpoint_id, count(*) FROM deliveries_delivery GROUP BY 1 ORDER BY 2 DESC, 1"
    )
    dead_group = sql(
        "SELECT endpoint_id, last_outcome, count(*) FROM deliveries_delivery"
        " WHERE state = 'dead' GROUP BY 1, 2 ORDER BY 3 DESC, 1 LIMIT 1"
    )[0]
    dead = sql(
        "SELECT id, attempt_count FROM deliveries_delivery WHERE state = 'dead'"
        " ORDER BY attempt_count DESC, created_at DESC LIMIT 1"
    )[0]
    succeeded = sql(
        "SELECT id FROM deliveries_delivery WHERE state = 'succeeded' AND attempt_count = 1"
        " ORDER BY created_at DESC OFFSET 1000 LIMIT 1"
    )[0][0]
    events = sql("SELECT events FROM bench_admin_dataset")[0][0]
    event_id = _md5_uuid(f"event{events // 3}")
    entity = sql("SELECT entity_id FROM deliveries_event WHERE id = %s", [event_id])[0][0]
    entity_deliveries = sql(
        "SELECT count(*) FROM deliveries_delivery d JOIN deliveries_event e ON e.id = d.event_id"
        " WHERE e.entity_id = %s",
        [entity],
    )[0][0]

    # The date links exactly as the changelist renders them (a timezone-aware midnight).
    page = client.get("/admin/deliveries/delivery/").content.decode()
    date_links = {
        html.unescape(text): html.unescape(href)
        for href, text in re.findall(r'<a href="([^"]*created_at__gte[^"]*)">([^<]+)</a>', page)
    }
    if not {"Today", "Past 7 days", "This month"} <= date_links.keys():
        raise outbound.BenchError(f"date filter links not found: {date_links}")
    return {
        "tenant_big": (tenants[0][0], tenants[0][1]),
        "tenant_small": (tenants[-1][0], tenants[-1][1]),
        "endpoint_big": (endpoints[0][0], endpoints[0][1]),
        "endpoint_small": (endpoints[-1][0], endpoints[-1][1]),
        "dead_group": dead_group,
        "dead": dead,
        "succeeded": succeeded,
        "delivery_search": _md5_uuid(f"delivery{events * FANOUT // 4 + 7}"),
        "event_search": event_id,
        "entity": (entity, entity_deliveries),
        "date_links": date_links,
    }


def pages(s: dict) -> list[tuple[str, str]]:
    """(name, path) of every page measured."""
    log = "/admin/deliveries/delivery/"
    tb, tb_n = s["tenant_big"]
    ts, ts_n = s["tenant_small"]
    eb, eb_n = s["endpoint_big"]
    es, es_n = s["endpoint_small"]
    dg_endpoint, dg_outcome, dg_n = s["dead_group"]
    entity, entity_n = s["entity"]
    dates = s["date_links"]
    return [
        ("list", log),
        ("list p=2", log + "?p=1"),
        ("list p=50", log + "?p=49"),
        ("state=dead", log + _q(state__exact="dead")),
        ("state=pending", log + _q(state__exact="pending")),
        ("state=leased", log + _q(state__exact="leased")),
        (f"tenant, largest ({tb_n:,})", log + _q(tenant=tb)),
        (f"tenant, smallest ({ts_n:,})", log + _q(tenant=ts)),
        (f"endpoint, busiest ({eb_n:,})", log + _q(endpoint=eb)),
        (f"endpoint, quietest ({es_n:,})", log + _q(endpoint=es)),
        (f"event_type={COMMON_TYPE}", log + _q(event_type=COMMON_TYPE)),
        (f"event_type={RARE_TYPE}", log + _q(event_type=RARE_TYPE)),
        ("last_outcome=retry", log + _q(last_outcome__exact="retry")),
        ("last_outcome=permanent", log + _q(last_outcome__exact="permanent")),
        ("created: today", log + dates["Today"]),
        ("created: past 7 days", log + dates["Past 7 days"]),
        ("created: this month", log + dates["This month"]),
        (
            f"dead-letter group link ({dg_n})",
            log + _q(state="dead", endpoint=dg_endpoint, last_outcome=dg_outcome),
        ),
        (
            "tenant largest + dead + past 7 days",
            log + dates["Past 7 days"] + "&" + _q(tenant=tb, state__exact="dead")[1:],
        ),
        (
            "tenant smallest + pending",
            log + _q(tenant=ts, state__exact="pending"),
        ),
        (
            f"tenant smallest + {RARE_TYPE}",
            log + _q(tenant=ts, event_type=RARE_TYPE),
        ),
        (
            f"endpoint busiest + {COMMON_TYPE} + dead",
            log + _q(endpoint=eb, event_type=COMMON_TYPE, state__exact="dead"),
        ),
        ("search: delivery id", log + _q(q=s["delivery_search"])),
        ("search: event id", log + _q(q=s["event_search"])),
        (f"search: entity id ({entity_n} deliveries)", log + _q(q=entity)),
        ("search: entity id, no match", log + _q(q="ent_nope")),
        (f"detail: dead, {s['dead'][1]} attempts", f"{log}{s['dead'][0]}/change/"),
        ("detail: succeeded, 1 attempt", f"{log}{s['succeeded']}/change/"),
        ("dead letters", log + "dead-letters/"),
        ("endpoint list", "/admin/deliveries/endpoint/"),
        ("overview", "/admin/"),
        (
            f"replay matching: largest dead group's endpoint, dead ({dg_n}+)",
            log + "replay-matching/" + _q(state__exact="dead", endpoint=dg_endpoint),
        ),
    ]


# Pages with a budget of their own (the overview's is 500 ms); the others have --budget-ms.
BUDGETS_MS = {"overview": 500.0}


def budget_of(page: dict, default: float) -> float:
    return BUDGETS_MS.get(page["name"], default)


def _get(client, path: str):
    response = client.get(path)
    if response.status_code != 200:
        raise outbound.BenchError(f"GET {path} answered {response.status_code}")
    return response


def measure(client, named_paths: list[tuple[str, str]], runs: int) -> list[dict]:
    """Every page once to warm up, then ``runs`` rounds over all of them. Interleaved, so
    that a burst of load from elsewhere on a shared machine spreads over every page
    instead of landing on one."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    pages = []
    for name, path in named_paths:
        body = _get(client, path).content.decode()
        rows = body.count('name="_selected_action"')
        pages.append({"name": name, "path": path, "rows_on_page": rows, "samples": []})
    for round_ in range(runs):
        for page in pages:
            connection.ensure_connection()
            backend = connection.connection.info.backend_pid
            busy0, _ = outbound.machine_cpu()
            ours0 = outbound.proc_cpu_seconds(os.getpid()) + outbound.proc_cpu_seconds(backend)
            with CaptureQueriesContext(connection) as ctx:
                started, cpu = time.perf_counter(), time.process_time()
                _get(client, page["path"])
                wall = time.perf_counter() - started
                cpu = time.process_time() - cpu
            busy1, _ = outbound.machine_cpu()
            ours1 = outbound.proc_cpu_seconds(os.getpid()) + outbound.proc_cpu_seconds(backend)
            page["samples"].append(
                {
                    "wall": wall,
                    "cpu": cpu,
                    # Machine CPU that neither this process nor its PostgreSQL backend
                    # used meanwhile: on a shared machine, what tells a skewed figure.
                    "others": max(0.0, (busy1 - busy0) / outbound.CLK_TCK - (ours1 - ours0)),
                    "queries": ctx.captured_queries,
                }
            )
        print(f"  round {round_ + 1}/{runs} done", flush=True)
    return [summarise(page) for page in pages]


def summarise(page: dict) -> dict:
    samples = page.pop("samples")
    walls = [s["wall"] * 1000 for s in samples]
    times = [[float(q["time"]) * 1000 for q in s["queries"]] for s in samples]
    last = samples[-1]["queries"]
    top = max(last, key=lambda q: float(q["time"]))
    others = sum(s["others"] for s in samples)
    return {
        **page,
        "runs_ms": [round(w, 1) for w in walls],
        "median_ms": round(statistics.median(walls), 1),
        "min_ms": round(min(walls), 1),
        "max_ms": round(max(walls), 1),
        "python_cpu_ms_median": round(statistics.median(s["cpu"] * 1000 for s in samples), 1),
        "queries": max(len(t) for t in times),
        "sql_ms_median": round(statistics.median(sum(t) for t in times), 1),
        "slowest_query_ms_median": round(statistics.median(max(t, default=0) for t in times), 1),
        "others_cpu_share": round(others / (sum(walls) / 1000 * os.cpu_count()), 2),
        "slowest_query": top["sql"],
        "queries_last_run": [
            {"ms": round(float(q["time"]) * 1000, 1), "sql": q["sql"]} for q in last
        ],
    }


def explain(query: str) -> str:
    rows = outbound.sql("EXPLAIN (ANALYZE, BUFFERS) " + query)
    return "\n".join(r[0] for r in rows)


# --- Report --------------------------------------------------------------------------


def code_version() -> dict:
    """The commit measured, and the files under test that differ from it (other work in
    progress changes what the pages do)."""
    import subprocess

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=outbound.ROOT, capture_output=True, text=True)
        return done.stdout.strip()

    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "modified": git("status", "--porcelain", "--", "deliveries", "project", "templates"),
    }


def summary(result: dict) -> str:
    data = result["data"]
    states = ", ".join(f"{k} {v:,}" for k, v in data["states"].items())
    tables = data["tables"]
    size = sum(t["table_mb"] + t["indexes_mb"] for t in tables.values())
    v = result["versions"]
    return (
        f"{tables['deliveries_delivery']['rows']:,} deliveries ({states}),"
        f" {tables['deliveries_event']['rows']:,} events,"
        f" {tables['deliveries_attempt']['rows']:,} attempts; {size:,} MB with indexes."
        f" PostgreSQL {v['postgres']}, Django {v['django']}, Python {v['python']};"
        f" {result['runs']} runs per page after one warm-up, interleaved;"
        f" code at {result['code']['commit']}"
        + (" with uncommitted changes" if result["code"]["modified"] else "")
        + "."
    )


def is_list(path: str) -> bool:
    """Whether a page is a list, whose rows the table counts."""
    page = path.split("?")[0]
    return page in ("/admin/deliveries/delivery/", "/admin/deliveries/endpoint/")


def markdown(result: dict) -> str:
    budget = result["budget_ms"]
    lines = [
        "| page | rows | median ms | min ms | max ms | queries | SQL ms | slowest query ms"
        f" | Python CPU ms | others' CPU | under {budget:.0f} ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for p in result["pages"]:
        over = p["median_ms"] > budget_of(p, budget)
        median = f"**{p['median_ms']:.1f}**" if over else f"{p['median_ms']:.1f}"
        changelist = is_list(p["path"])
        rows = p["rows_on_page"] if changelist else "—"
        lines.append(
            f"| {p['name']} | {rows} | {median} | {p['min_ms']:.1f} | {p['max_ms']:.1f}"
            f" | {p['queries']}"
            f" | {p['sql_ms_median']:.1f} | {p['slowest_query_ms_median']:.1f}"
            f" | {p['python_cpu_ms_median']:.1f} | {p['others_cpu_share']:.0%}"
            f" | {'**NO, over budget**' if over else 'yes'}"
            + (f" (budget {budget_of(p, budget):.0f} ms)" if p["name"] in BUDGETS_MS else "")
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    global DB_NAME
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deliveries", type=int, default=1_000_000)
    parser.add_argument("--regenerate", action="store_true", help="throw the data away first")
    parser.add_argument("--runs", type=int, default=7, help="timed requests per page")
    parser.add_argument("--budget-ms", type=float, default=200.0)
    parser.add_argument("--explain-all", action="store_true")
    parser.add_argument("--only", help="measure only pages whose name contains this")
    parser.add_argument("--json", type=Path, default=RESULT_FILE)
    parser.add_argument("--db-name", default=DB_NAME, help=f"the database (default {DB_NAME})")
    args = parser.parse_args(argv)
    DB_NAME = args.db_name

    url = outbound.with_db(BASE_URL, DB_NAME)
    env = {**os.environ, "DATABASE_URL": url, "LOG_LEVEL": "WARNING"}
    outbound.ensure_database(BASE_URL, DB_NAME)
    outbound.migrate(env)
    outbound.setup_django(url)

    from django.contrib.auth import get_user_model
    from django.test import Client

    data = None if args.regenerate else dataset()
    if data and data["deliveries"] != args.deliveries:
        data = None
    if data is None:
        print(f"generating {args.deliveries:,} deliveries in a fresh {DB_NAME}", flush=True)
        recreate_database(env)
        data = generate(args.deliveries)
    else:
        age = datetime.now(UTC) - datetime.fromisoformat(data["generated_at"])
        print(f"reusing {data['deliveries']:,} deliveries generated {age} ago", flush=True)
        if age > timedelta(hours=12):
            print("  (the date filters are relative to today: consider --regenerate)")
    data.update(describe_data())
    data["tallies"] = write_tallies()

    user, _ = get_user_model().objects.get_or_create(
        username="admin-bench", defaults={"is_staff": True, "is_superuser": True}
    )
    client = Client(HTTP_HOST="localhost")
    client.force_login(user)
    subjects = pick_subjects(client)

    named = [(n, p) for n, p in pages(subjects) if not args.only or args.only in n]
    measured = measure(client, named, args.runs)
    for page in measured:
        if args.explain_all or page["median_ms"] > budget_of(page, args.budget_ms):
            page["explain"] = explain(page["slowest_query"])

    result = {
        "database": DB_NAME,
        "versions": outbound.versions(DB_NAME),
        "code": code_version(),
        "data": data,
        "runs": args.runs,
        "budget_ms": args.budget_ms,
        "measured_at": datetime.now(UTC).isoformat(),
        "pages": measured,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print()
    print(summary(result))
    print()
    print(markdown(result))
    over = [p for p in measured if p["median_ms"] > budget_of(p, args.budget_ms)]
    for p in over:
        print(f"\n### {p['name']}: median {p['median_ms']:.1f} ms\n\n{p['slowest_query']}\n")
        print(p["explain"])
    print(f"\n{len(over)} of {len(measured)} pages over {args.budget_ms:.0f} ms; see {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
