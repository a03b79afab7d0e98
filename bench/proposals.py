"""Evidence for the worker's database-side proposals: the same batches handled by the
current code and by set-based SQL prototypes, CPU per delivery measured for each step.

What it compares, batch by batch (``--batch-size`` messages, ``--batches`` of them per
variant, all responses 200, on the bench database left by ``bench/outbound.py``):

* **current**: ``broker.receive`` (SELECT … FOR UPDATE SKIP LOCKED, then UPDATE),
  ``worker._claim`` (``state.lease`` + endpoints + secrets), ``state.record`` (ORM
  ``bulk_create`` of the attempts, guarded UPDATEs), ``broker.acknowledge``;
* **set-based**: one ``UPDATE … WHERE id IN (SELECT … SKIP LOCKED) RETURNING`` dequeue;
  one ``UPDATE … FROM unnest(ids, dispatches) … RETURNING`` lease that also returns the
  event body; a guarded ``UPDATE … RETURNING id`` then ``COPY`` of the attempts for the
  record; the same ``DELETE`` acknowledgement. Same guards (state, dispatch, lease
  token), same rows written. Disabled endpoints and failures are left out of the
  prototype (the benchmark has none); they would keep today's code path.

CPU is the calling thread's (``time.thread_time``), which is what a worker's database
threads spend under the GIL that its event loop needs too.

    python bench/proposals.py [--batches 20 --batch-size 200]
"""

import argparse
import json
import os
import sys
import time
import uuid
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import outbound  # the bench directory is not a package


def prepare(n: int, url: str) -> None:
    """Restore the published snapshot and push ``n`` deliveries onto the broker."""
    from deliveries import broker
    from deliveries.loops import relay_tick, scheduler_tick

    outbound.snapshot_restore(url)
    b = broker.broker()
    admitted = published = 0
    while admitted < n:
        admitted += scheduler_tick(page_size=min(1000, n - admitted)).counts["enqueued"]
    while published < n:
        published += relay_tick(b=b, page_size=1000).counts["published"]


def results_for(leased: list, worker: str) -> list:
    from deliveries import state
    from deliveries.policy import classify

    now = datetime.now(UTC)
    return [
        state.AttemptResult(
            leased=item,
            classification=classify(status=200),
            started_at=now,
            duration_ms=1.5,
            status_code=200,
            response_body="ok",
            request_headers={
                "content-type": "application/json",
                "webhook-id": str(item.id),
                "webhook-timestamp": str(int(now.timestamp())),
                "idempotency-key": str(item.id),
            },
            worker=worker,
        )
        for item in leased
    ]


# --- Set-based prototypes ------------------------------------------------------------


def sb_dequeue(limit: int, queue: str, visibility: float) -> list[tuple[int, str]]:
    from django.db import connection, transaction

    with transaction.atomic(), connection.cursor() as cur:
        # The inner SELECT uses the index queue_visible; claim and hide in one statement.
        cur.execute(
            "UPDATE deliveries_queuemessage SET visible_at = now() + %s * interval '1 second',"
            " receives = receives + 1 WHERE id IN (SELECT id FROM deliveries_queuemessage"
            " WHERE queue = %s AND visible_at <= now() ORDER BY priority DESC, visible_at"
            " FOR UPDATE SKIP LOCKED LIMIT %s) RETURNING id, payload",
            [visibility, queue, limit],
        )
        return cur.fetchall()


def sb_lease(messages: list[tuple[int, str]], lease_seconds: float) -> list:
    from django.db import connection, transaction

    from deliveries import broker, state

    ids, dispatches = [], []
    for _, payload in messages:
        m = broker.Message.decode(payload)
        ids.append(m.delivery_id)
        dispatches.append(m.dispatch)
    token = uuid.uuid4()
    now = datetime.now(UTC)
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute(
            "WITH wanted AS (SELECT * FROM unnest(%s::uuid[], %s::int[]) AS w(id, dispatch)),"
            " locked AS (SELECT d.id FROM deliveries_delivery d JOIN wanted w"
            " ON w.id = d.id AND w.dispatch = d.dispatch_count WHERE d.state = 'enqueued'"
            " FOR UPDATE OF d SKIP LOCKED)"
            " UPDATE deliveries_delivery d SET state = 'leased', lease_until = %s,"
            " lease_token = %s, attempt_count = d.attempt_count + 1,"
            " policy_attempts = d.policy_attempts + 1, updated_at = %s"
            " FROM locked, deliveries_event e, deliveries_endpoint ep"
            " WHERE d.id = locked.id AND e.id = d.event_id AND ep.id = d.endpoint_id"
            " AND ep.enabled RETURNING d.id, d.event_id, d.endpoint_id, d.tenant_id,"
            " e.event_type, e.body, d.attempt_count, d.policy_attempts",
            [ids, dispatches, now + timedelta(seconds=lease_seconds), token, now],
        )
        rows = cur.fetchall()
    return [
        state.Leased(
            id=r[0],
            event_id=r[1],
            endpoint_id=r[2],
            tenant_id=r[3],
            event_type=r[4],
            body=bytes(r[5]),
            attempt_number=r[6],
            policy_attempts=r[7],
            lease_token=token,
        )
        for r in rows
    ]


ATTEMPT_COLUMNS = (
    "delivery_id, number, started_at, duration_ms, status_code, outcome, error_kind, error,"
    " ambiguous, response_body, response_truncated, request_headers, recorded, worker"
)


def sb_record(results: list) -> int:
    """All-success batches only (the prototype's scope): one guarded UPDATE that says
    which leases were still held, then the attempts by COPY."""
    from django.db import connection, transaction
    from psycopg.types.json import Jsonb

    now = datetime.now(UTC)
    by_token = defaultdict(list)
    for r in results:
        by_token[r.leased.lease_token].append(r.leased.id)
    with transaction.atomic(), connection.cursor() as cur:
        held = set()
        for token, ids in by_token.items():
            cur.execute(
                "UPDATE deliveries_delivery SET state = 'succeeded', finished_at = %s,"
                " last_outcome = 'success', last_status_code = 200, last_error = '',"
                " lease_until = NULL, lease_token = NULL, last_attempt_at = %s,"
                " updated_at = %s WHERE id = ANY(%s) AND state = 'leased'"
                " AND lease_token = %s RETURNING id",
                [now, now, now, ids, token],
            )
            held.update(row[0] for row in cur.fetchall())
        with cur.cursor.copy(f"COPY deliveries_attempt ({ATTEMPT_COLUMNS}) FROM STDIN") as copy:
            for r in results:
                copy.write_row(
                    (
                        r.leased.id,
                        r.leased.attempt_number,
                        r.started_at,
                        r.duration_ms,
                        r.status_code,
                        str(r.classification.outcome),
                        r.error_kind,
                        r.error[:500],
                        r.classification.ambiguous,
                        r.response_body,
                        r.response_truncated,
                        Jsonb(r.request_headers),
                        r.leased.id in held,
                        r.worker,
                    )
                )
    return len(held)


# --- The comparison ------------------------------------------------------------------


def own_backend_cpu() -> float:
    """CPU seconds of this process's PostgreSQL backend (the server's share of the work)."""
    pid = outbound.sql("SELECT pg_backend_pid()")[0][0]
    return outbound.proc_cpu_seconds(pid)


def run_variant(name: str, batches: int, batch_size: int) -> dict:
    from django.conf import settings
    from django.utils import timezone

    from deliveries import broker, state, worker
    from deliveries.policy import RetryPolicy

    b = broker.broker()
    policy = RetryPolicy.from_settings()
    cpu: dict[str, float] = defaultdict(float)
    wall: dict[str, float] = defaultdict(float)
    done = 0
    pg0 = own_backend_cpu()

    def timed(step, fn, *args):
        w0, c0 = time.perf_counter(), time.thread_time()
        out = fn(*args)
        cpu[step] += time.thread_time() - c0
        wall[step] += time.perf_counter() - w0
        return out

    for _ in range(batches):
        if name == "current":
            messages = timed("dequeue", broker.receive, b, batch_size)
            claimed = timed("lease", worker._claim, messages, 75.0)
            leased = claimed.leased
        else:
            messages = timed(
                "dequeue", sb_dequeue, batch_size, b.list_key, settings.QUEUE_VISIBILITY_TIMEOUT
            )
            leased = timed("lease", sb_lease, messages, 75.0)
        results = results_for(leased, "bench")
        if name == "current":
            summary = timed(
                "record", lambda r: state.record(r, now=timezone.now(), policy=policy), results
            )
            succeeded = summary.succeeded
        else:
            succeeded = timed("record", sb_record, results)
        timed("acknowledge", broker.acknowledge, b, [m[0] for m in messages])
        if succeeded != len(messages):
            raise outbound.BenchError(f"{name}: {succeeded} of {len(messages)} recorded")
        done += succeeded
    total = sum(cpu.values())
    pg = own_backend_cpu() - pg0
    return {
        "deliveries": done,
        "postgres_cpu_us_per_delivery": round(pg / done * 1e6, 1),
        "thread_cpu_us_per_delivery": {k: round(v / done * 1e6, 1) for k, v in cpu.items()}
        | {"total": round(total / done * 1e6, 1)},
        "wall_us_per_delivery": {k: round(v / done * 1e6, 1) for k, v in wall.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per variant")
    parser.add_argument("--db-name", default="webhooks_bench")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    n = args.batches * args.batch_size

    base_url = os.environ.get("DATABASE_URL") or "postgres://webhooks@127.0.0.1:5432/webhooks"
    for name in (
        "DELIVERY_MAX_IN_FLIGHT",
        "DELIVERY_TENANT_MAX_IN_FLIGHT",
        "DELIVERY_ENDPOINT_MAX_CONCURRENCY",
    ):
        os.environ[name] = str(max(n, 5000))
    outbound.setup_django(outbound.with_db(base_url, args.db_name, "bench-proposals"))
    available = outbound.snapshot_events()
    if available < n:
        raise SystemExit(
            f"needs {n} published deliveries saved by bench/outbound.py (found {available}): "
            f"run it first with --events {n} or more"
        )
    out: dict = {"batch_size": args.batch_size, "batches": args.batches, "rounds": []}
    for _ in range(args.rounds):
        for variant in ("current", "set-based"):
            prepare(n, "http://127.0.0.1:9/unused")
            row = run_variant(variant, args.batches, args.batch_size)
            out["rounds"].append({"variant": variant, **row})
            print(f"{variant:>10}: {json.dumps(row)}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
