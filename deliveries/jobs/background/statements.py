"""The host's background jobs' statements; with ``state``, the only modules that change
``Job.state``: every change is a guarded UPDATE on the expected state (and, out of
``running``, on the lease token), and what the row count says is what happened.

The hot statements (insert, claim, record, renew) are ``sql.Statement``s: their
PostgreSQL text with, below it, the same effect with the ORM for SQLite. The claim and
the record take batches, so that a worker spends two statements on a page of jobs, not
two per job.

    pending ──claim──▶ running ──record──▶ done | dead
       ▲                  ├──record (Retry, an error, a timeout)──▶ pending
       │                  ├──record (entity lock busy: not an attempt)──▶ pending
       └──lease expired───┘ (the "job" kind's sweep; dead when attempts are spent)
    pending ──deadline passed──▶ dead
"""

import json
import uuid
from collections import Counter
from datetime import datetime, timedelta

from django.db import IntegrityError, transaction
from django.db.models import F, Q

from deliveries.core.sql import Statement

from ..models import EntityLock, Job, JobOutcome, JobRun, JobState

PENDING, RUNNING, DONE, DEAD = JobState.PENDING, JobState.RUNNING, JobState.DONE, JobState.DEAD

# --- Enqueue -----------------------------------------------------------------------------

_INSERT_COLUMNS = (
    "id", "type", "queue", "priority", "tenant_id", "payload", "version", "idempotency_key",
    "run_at", "deadline", "max_attempts", "lock_key", "created_at",
)  # fmt: skip

# One job, or nothing when (type, idempotency_key) exists (the constraint job_idempotency;
# a concurrent insert of the same key waits for the first to commit, then inserts
# nothing). Params: the columns by name, payload a Jsonb; row (id,) or None.
INSERT_JOB = Statement(
    f"""
INSERT INTO trusty_jobs_job ({", ".join(_INSERT_COLUMNS)}, state, attempts, last_error,
    dead_reason)
VALUES ({", ".join(f"%({c})s" for c in _INSERT_COLUMNS)}, 'pending', 0, '', '')
ON CONFLICT (type, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
RETURNING id
""",
    returns="row",
)


@INSERT_JOB.elsewhere
def _(params):
    fields = {**params, "payload": params["payload"].obj}
    try:
        with transaction.atomic():  # a savepoint: the conflict leaves the caller's work
            Job.objects.create(**fields)
    except IntegrityError:
        return None
    return (fields["id"],)


# --- Claim ---------------------------------------------------------------------------------

# What a claim gives back for each job, in this order.
CLAIMED = ("id", "type", "version", "payload", "attempts", "lease_token", "lock_key",
           "tenant_id", "deadline")  # fmt: skip

# Due pending jobs of the queues, highest priority first then oldest run_at (each queue
# read in the order of the partial index job_claimable, the queues merged after), none
# past its deadline, set running with a lease of their own
# (each job a token: the entity locks' owner) in one statement. Fairness: a tenant with
# ``per_tenant`` jobs running in these queues (the partial index job_running) is passed
# over, and of a tenant's candidates only as many as it has room for are taken, so that
# one tenant's flood leaves slots to the others. ``scan`` candidates are locked (SKIP
# LOCKED: claims divide the work), at most ``limit`` claimed; the rest are let go at the
# statement's commit. The claimed rows are updated through the primary key (an id array:
# a join would let the planner hash the whole table). The lease: ``leases`` seconds for
# the type at the same place in ``types``, ``default_lease`` for a type this worker does
# not know. The rows come back in claim order (priority, then due time), the order the
# worker starts them in and so takes their entity locks: of two claimed jobs on one
# entity, the older runs first.
# Params: {queues, now, limit, scan, per_tenant, types, leases, default_lease}.
CLAIM_JOBS = Statement("""
WITH running AS (
    SELECT tenant_id, count(*) AS n FROM trusty_jobs_job
    WHERE state = 'running' AND tenant_id IS NOT NULL AND queue = ANY(%(queues)b::text[])
    GROUP BY tenant_id
), candidate AS (
    SELECT c.* FROM unnest(%(queues)b::text[]) AS q(name), LATERAL (
        SELECT id, tenant_id, priority, run_at FROM trusty_jobs_job
        WHERE state = 'pending' AND queue = q.name AND run_at <= %(now)s
            AND (deadline IS NULL OR deadline > %(now)s)
            AND (tenant_id IS NULL OR %(per_tenant)s <= 0 OR tenant_id NOT IN (
                SELECT tenant_id FROM running WHERE n >= %(per_tenant)s))
        ORDER BY priority DESC, run_at
        LIMIT %(scan)s
        FOR UPDATE SKIP LOCKED
    ) AS c
), picked AS (
    SELECT c.id FROM (
        SELECT candidate.*,
            row_number() OVER (PARTITION BY tenant_id ORDER BY priority DESC, run_at) AS nth
        FROM candidate
    ) c LEFT JOIN running r ON r.tenant_id = c.tenant_id
    WHERE c.tenant_id IS NULL OR %(per_tenant)s <= 0
        OR c.nth + coalesce(r.n, 0) <= %(per_tenant)s
    ORDER BY c.priority DESC, c.run_at
    LIMIT %(limit)s
), claimed AS (
    UPDATE trusty_jobs_job j
    SET state = 'running', lease_token = gen_random_uuid(), attempts = j.attempts + 1,
        started_at = %(now)s,
        lease_until = %(now)s + make_interval(secs => coalesce(
            (SELECT l.seconds
             FROM unnest(%(types)b::text[], %(leases)b::float8[]) AS l(type, seconds)
             WHERE l.type = j.type), %(default_lease)s))
    WHERE j.id = ANY(ARRAY(SELECT id FROM picked))
    RETURNING j.id, j.type, j.version, j.payload, j.attempts, j.lease_token, j.lock_key,
        j.tenant_id, j.deadline, j.priority, j.run_at
)
SELECT id, type, version, payload, attempts, lease_token, lock_key, tenant_id, deadline
FROM claimed ORDER BY priority DESC, run_at, id
""")


@CLAIM_JOBS.elsewhere
def _(params):
    # SQLite: the IMMEDIATE transaction holds the write lock; nobody else claims.
    now, per_tenant = params["now"], params["per_tenant"]
    leases = dict(zip(params["types"], params["leases"], strict=True))
    with transaction.atomic():
        running = Counter(
            Job.objects.filter(state=RUNNING, queue__in=params["queues"], tenant_id__isnull=False)
            .values_list("tenant_id", flat=True)
            .iterator()
        )
        candidates = (
            Job.objects.filter(state=PENDING, queue__in=params["queues"], run_at__lte=now)
            .filter(Q(deadline__isnull=True) | Q(deadline__gt=now))
            .order_by("-priority", "run_at", "id")
        )
        if per_tenant > 0:
            full = [t for t, n in running.items() if n >= per_tenant]
            candidates = candidates.exclude(tenant_id__in=full)
        picked = []
        for row in candidates.values_list("id", "type", "tenant_id")[: params["scan"]]:
            if len(picked) >= params["limit"]:
                break
            job_id, job_type, tenant = row
            if tenant is not None and per_tenant > 0:
                if running[tenant] >= per_tenant:
                    continue
                running[tenant] += 1
            picked.append((job_id, job_type))
        for job_id, job_type in picked:
            seconds = leases.get(job_type, params["default_lease"])
            Job.objects.filter(id=job_id, state=PENDING).update(
                state=RUNNING,
                lease_token=uuid.uuid4(),
                lease_until=now + timedelta(seconds=seconds),
                attempts=F("attempts") + 1,
                started_at=now,
            )
        rows = Job.objects.filter(id__in=[p[0] for p in picked]).values_list(*CLAIMED)
        by_id = {row[0]: row for row in rows}
        return [by_id[job_id] for job_id, _ in picked]


# RECORD_JOBS and RENEW_JOBS find a batch of rows by primary key, joining the batch's
# arrays (unnest) to the job table. Their state test is written ``(j.state || '') =
# 'running'`` so that the planner cannot answer it from the partial index job_running: a
# generic plan (prepared statements) assumes 10 rows an unnest, and with statistics from
# when few jobs ran it read every running job to find the batch's (hash or nested loop);
# without that path the one cheap plan left is a primary-key lookup per row of the batch.
# The claim updates its rows by ``j.id = ANY(...)`` already.

# --- Record --------------------------------------------------------------------------------

# What one finished (or given back) job records: the row's next state, and the run.
# Every job sends RECORD_FIELDS; the rest, RECORD_OTHER_FIELDS, only a job whose values
# are not RECORD_DEFAULTS (a plain run that returned: done, no error, progress or
# result), with its place in the batch (``nth``, from 1). Most batches are all plain
# runs, and each array element is Python work for the driver (psycopg dumps arrays
# element by element) and for the server's unnest.
RECORD_FIELDS = ("id", "token", "attempt", "started", "duration_ms")
RECORD_OTHER_FIELDS = (
    "state", "run_at", "error", "reason", "uncount", "reported", "done", "total", "outcome",
    "trace", "keep_lock", "result", "error_class",
)  # fmt: skip
RECORD_DEFAULTS = (DONE, None, "", "", 0, False, 0, -1, JobOutcome.DONE, "", False, "", "")


def record_params(rows: list[tuple], others: list[tuple], *, now: datetime, run_id) -> dict:
    """RECORD_JOBS's parameters: ``rows`` one tuple of RECORD_FIELDS per job, ``others``
    one of ``nth`` and RECORD_OTHER_FIELDS per job that does not take the defaults."""

    def arrays(names: tuple[str, ...], tuples: list[tuple]) -> dict:
        columns = zip(*tuples, strict=True) if tuples else ([] for _ in names)
        return {name: list(column) for name, column in zip(names, columns, strict=True)}

    return {
        **arrays(RECORD_FIELDS, rows),
        **arrays(("nth", *RECORD_OTHER_FIELDS), others),
        "now": now,
        "run_id": run_id,
    }


# Record a batch: move each job out of running, for its lease holder only (a job whose
# lease was lost to the sweep is left as the sweep made it), append its run ("" outcome:
# no run, a job given back because its entity lock was held, which also gives back the
# attempt and keeps the last error), and release its entity lock in the same statement,
# unless ``keep_lock``: the function still runs (past its timeout, or at a shutdown), and
# the lock is the worker's to release when it returns, or to let expire.
# ``run_at`` is read for pending only; progress (``reported``) is written when set, a
# ``total`` of -1 meaning unknown; ``result`` is the JSON text of a return value the job's
# type keeps ("" for none), ``error_class`` the import path of the exception the run
# raised. Params: ``record_params``; rows (id,) of the jobs moved.
RECORD_JOBS = Statement("""
WITH o AS (
    SELECT * FROM unnest(%(nth)b::int4[], %(state)b::text[], %(run_at)b::timestamptz[],
        %(error)b::text[], %(reason)b::text[], %(uncount)b::int4[], %(reported)b::bool[],
        %(done)b::int8[], %(total)b::int8[], %(outcome)b::text[], %(trace)b::text[],
        %(keep_lock)b::bool[], %(result)b::text[], %(error_class)b::text[])
    AS o(nth, state, run_at, error, reason, uncount, reported, done, total, outcome, trace,
        keep_lock, result, error_class)
), r AS (
    SELECT b.id, b.token, b.attempt, b.started, b.duration_ms,
        coalesce(o.state, 'done') AS state, o.run_at, coalesce(o.error, '') AS error,
        coalesce(o.reason, '') AS reason, coalesce(o.uncount, 0) AS uncount,
        coalesce(o.reported, false) AS reported, coalesce(o.done, 0) AS done,
        coalesce(o.total, -1) AS total, coalesce(o.outcome, 'done') AS outcome,
        coalesce(o.trace, '') AS trace, coalesce(o.keep_lock, false) AS keep_lock,
        coalesce(o.result, '') AS result, coalesce(o.error_class, '') AS error_class
    FROM unnest(%(id)b::uuid[], %(token)b::uuid[], %(attempt)b::int4[],
        %(started)b::timestamptz[], %(duration_ms)b::float8[])
        WITH ORDINALITY AS b(id, token, attempt, started, duration_ms, nth)
    LEFT JOIN o ON o.nth = b.nth
), moved AS (
    UPDATE trusty_jobs_job j
    SET state = r.state, lease_token = NULL, lease_until = NULL,
        run_at = CASE WHEN r.state = 'pending' THEN r.run_at ELSE j.run_at END,
        last_error = CASE WHEN r.uncount > 0 THEN j.last_error ELSE r.error END,
        dead_reason = r.reason, attempts = j.attempts - r.uncount,
        result = nullif(r.result, '')::jsonb,
        finished_at = CASE WHEN r.state IN ('done', 'dead') THEN %(now)s END,
        progress_done = CASE WHEN r.reported THEN r.done ELSE j.progress_done END,
        progress_total = CASE WHEN r.reported THEN nullif(r.total, -1)
            ELSE j.progress_total END,
        progress_updated_at = CASE WHEN r.reported THEN %(now)s ELSE j.progress_updated_at END
    FROM r WHERE j.id = r.id AND (j.state || '') = 'running' AND j.lease_token = r.token
    RETURNING j.id, j.lock_key, r.token, r.keep_lock
), runs AS (
    INSERT INTO trusty_jobs_jobrun (job_id, attempt, run_id, started_at, duration_ms,
        outcome, error, error_class)
    SELECT id, attempt, %(run_id)s::uuid, started, duration_ms, outcome, trace, error_class
    FROM r
    WHERE outcome <> ''
), unlocked AS (
    DELETE FROM deliveries_entitylock l USING moved
    WHERE moved.lock_key <> '' AND NOT moved.keep_lock AND l.key = moved.lock_key
        AND l.owner = moved.token::text
)
SELECT id FROM moved
""")


def _record_rows(params: dict):
    """Each job's fields of RECORD_JOBS's parameters by name, the defaults filled in."""
    others = {nth: k for k, nth in enumerate(params["nth"])}
    for i in range(len(params["id"])):
        row = {name: params[name][i] for name in RECORD_FIELDS}
        k = others.get(i + 1)
        if k is None:
            row.update(zip(RECORD_OTHER_FIELDS, RECORD_DEFAULTS, strict=True))
        else:
            row.update((name, params[name][k]) for name in RECORD_OTHER_FIELDS)
        yield row


@RECORD_JOBS.elsewhere
def _(params):
    now = params["now"]
    moved = []
    with transaction.atomic():
        for r in _record_rows(params):
            job_id = r["id"]
            fields = {
                "state": r["state"],
                "lease_token": None,
                "lease_until": None,
                "dead_reason": r["reason"],
                "finished_at": now if r["state"] in (DONE, DEAD) else None,
                "result": json.loads(r["result"]) if r["result"] else None,
            }
            if r["state"] == PENDING:
                fields["run_at"] = r["run_at"]
            if r["uncount"]:
                fields["attempts"] = F("attempts") - r["uncount"]
            else:
                fields["last_error"] = r["error"]
            if r["reported"]:
                fields["progress_done"] = r["done"]
                fields["progress_total"] = r["total"] if r["total"] >= 0 else None
                fields["progress_updated_at"] = now
            mine = Job.objects.filter(id=job_id, state=RUNNING, lease_token=r["token"])
            lock_key = mine.values_list("lock_key", flat=True).first()
            if mine.update(**fields):
                moved.append((job_id,))
                if lock_key and not r["keep_lock"]:
                    EntityLock.objects.filter(key=lock_key, owner=str(r["token"])).delete()
            if r["outcome"]:
                JobRun.objects.create(
                    job_id=job_id,
                    attempt=r["attempt"],
                    run_id=params["run_id"],
                    started_at=r["started"],
                    duration_ms=r["duration_ms"],
                    outcome=r["outcome"],
                    error=r["trace"],
                    error_class=r["error_class"],
                )
    return moved


# --- Renew -----------------------------------------------------------------------------

# Extend the leases of jobs still running (each to its ``until``), write the progress they
# reported, and extend their entity locks to the same ``until``, for the lease holders
# only, in one statement: a lock never runs out before the lease it belongs to (a
# database error renews neither, and the next pass tries both again). A lock whose row
# is gone or has another owner is left as it is: it expired and was taken over (its
# holder stalled past the lease), and what the other holder runs cannot be undone; the
# second column says so, and the worker logs it (``job.lock_lost``).
# Params: {id, token, until, reported, done, total, now} (arrays but now); rows
# (id, lock held) of the leases still held, lock held true for a job without a lock.
RENEW_JOBS = Statement("""
WITH renewed AS (
    UPDATE trusty_jobs_job j
    SET lease_until = r.until,
        progress_done = CASE WHEN r.reported THEN r.done ELSE j.progress_done END,
        progress_total = CASE WHEN r.reported THEN nullif(r.total, -1)
            ELSE j.progress_total END,
        progress_updated_at = CASE WHEN r.reported THEN %(now)s ELSE j.progress_updated_at END
    FROM unnest(%(id)b::uuid[], %(token)b::uuid[], %(until)b::timestamptz[],
        %(reported)b::bool[], %(done)b::int8[], %(total)b::int8[])
        AS r(id, token, until, reported, done, total)
    WHERE j.id = r.id AND (j.state || '') = 'running' AND j.lease_token = r.token
    RETURNING j.id, j.lock_key, j.lease_token, r.until
), locks AS (
    UPDATE deliveries_entitylock l SET expires_at = renewed.until
    FROM renewed
    WHERE renewed.lock_key <> '' AND l.key = renewed.lock_key
        AND l.owner = renewed.lease_token::text
    RETURNING renewed.id
)
SELECT id, lock_key = '' OR id IN (SELECT id FROM locks) FROM renewed
""")


@RENEW_JOBS.elsewhere
def _(params):
    held = []
    with transaction.atomic():
        for i, job_id in enumerate(params["id"]):
            token, until = params["token"][i], params["until"][i]
            fields = {"lease_until": until}
            if params["reported"][i]:
                total = params["total"][i]
                fields.update(
                    progress_done=params["done"][i],
                    progress_total=total if total >= 0 else None,
                    progress_updated_at=params["now"],
                )
            mine = Job.objects.filter(id=job_id, state=RUNNING, lease_token=token)
            lock_key = mine.values_list("lock_key", flat=True).first()
            if not mine.update(**fields):
                continue
            locked = not lock_key or bool(
                EntityLock.objects.filter(key=lock_key, owner=str(token)).update(expires_at=until)
            )
            held.append((job_id, locked))
    return held
