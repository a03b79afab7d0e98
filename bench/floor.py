"""The statements floor: the service's own SQL, driven by the least Python that can run it.

A measurement, not a product: ``bench/outbound.py --floor`` runs it beside the bare loop
and the service, on the same published rows, receiver and clock. It answers one
question the throughput target raises: how fast could *any* implementation of the
design go on this machine, given the writes it makes per delivery?

Each role runs the service's statements verbatim (imported from ``deliveries``: the
``queries.`` names are the job machinery's, ``deliveries.jobs.statements``, the others the
outbound product's, ``deliveries.statements``), on the service's tables and indexes, and
nothing else:

* ``scheduler``: one scan of due rows (``SCAN_DUE``, nothing left out) and
  one ``ENQUEUE`` (pending → enqueued and an outbox row each) per page;
  no ceilings, no fairness, no in-flight count, no sweeps;
* ``relay`` (not part of the database broker's floor, whose workers take the outbox
  themselves; kept for a relay run beside them): in one transaction,
  ``queries.PUBLISH_OUTBOX_PAGE`` marking the page published and
  ``queries.ENQUEUE_MESSAGES``, as the service's relay does with the database broker;
* ``worker`` (one process per core, lanes of one asyncio connection each): in one
  transaction ``queries.TAKE`` claiming outbox rows (and any relay's messages) and
  ``LEASE`` (the service's take; ``queries.SETTLE_MESSAGES`` only when messages came);
  a signed POST per delivery through one bare ``aiohttp.ClientSession`` (no egress
  checks); then in one transaction ``RECORD``: the successes, the attempt rows and
  their tallies. No ceilings, no rate limits, no retries (any answer but 200 stops the
  run), no metrics, no logs.

So the service's distance to this floor is what its Python costs (Django, the thread
hop to the database, the egress checks, classification, ceilings, fairness, metrics),
and this floor's distance to the bare loop is what the design's writes cost.

    python bench/floor.py scheduler|worker [--lanes N --batch N]  # DATABASE_URL set
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IDLE_SLEEP = 0.005  # seconds between polls of an empty table


def setup() -> None:
    """Django only to import the service's statements and settings; then the heap is
    frozen as the service's loops freeze theirs (deliveries.jobs.loop.settle_heap)."""
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    import django

    django.setup()
    from deliveries.jobs import loop

    loop.settle_heap()


def connect_url() -> str:
    """DATABASE_URL as bench/outbound.py sets it (its application_name included)."""
    return os.environ["DATABASE_URL"]


# The LoopRun row bench/outbound.py waits for before it starts the clock.
REGISTER_SQL = (
    "INSERT INTO deliveries_looprun (id, kind, host, pid, started_at, heartbeat_at,"
    " ticks, counts) VALUES (%s, %s, %s, %s, now(), now(), 0, '{}')"
)


def registration(kind: str) -> list:
    return [uuid.uuid4(), kind, socket.gethostname()[:200], os.getpid()]


def register(conn, kind: str) -> None:
    conn.execute(REGISTER_SQL, registration(kind))


def now() -> datetime:
    return datetime.now(UTC)


def run_scheduler(page: int) -> None:
    import psycopg

    from deliveries.statements.admit import ENQUEUE, SCAN_DUE

    with psycopg.connect(connect_url(), autocommit=True) as conn:
        register(conn, "floor-sched")
        while True:
            with conn.transaction():
                t = now()
                ids = [
                    r[0]
                    for r in conn.execute(
                        SCAN_DUE.sql,
                        {"now": t, "tenants": [], "endpoints": [], "limit": page},
                    ).fetchall()
                ]
                if ids:
                    conn.execute(ENQUEUE.sql, {"ids": ids, "now": t})
            if not ids:
                time.sleep(IDLE_SLEEP)


def run_relay(page: int) -> None:
    import psycopg
    from django.conf import settings

    from deliveries.jobs import brokers as broker
    from deliveries.jobs import statements as queries

    queue = settings.QUEUE_NAME
    with psycopg.connect(connect_url(), autocommit=True) as conn:
        register(conn, "floor-relay")
        take = queries.PUBLISH_OUTBOX_PAGE.sql
        while True:
            with conn.transaction():
                t = now()
                rows = conn.execute(take, {"value": t, "now": t, "limit": page}).fetchall()
                if rows:
                    tasks = [broker.Message(r[1], r[2], r[3], r[4]).encode() for r in rows]
                    conn.execute(
                        queries.ENQUEUE_MESSAGES.sql,
                        [queue, t, t, json.dumps(tasks), [r[3] for r in rows]],
                    )
            if not rows:
                time.sleep(IDLE_SLEEP)


# The worker's database work, written once as generators of steps that a driver runs:
# ("query", sql, params) answers the rows ("binary" likewise, the rows in binary format,
# as the service leases), ("copy", sql, rows) answers None. The async
# driver runs them on an asyncio connection in the event loop (the floor); the thread
# driver on a blocking connection in a thread pool, one trip per generator, as the
# service's worker runs Django's (``--db-thread``: what that way costs).


def take_steps(queue: str, batch: int):
    """Take a batch and lease it in one transaction, claiming the outbox rows, as the
    service's worker does with the database broker: (leased, token), or None when
    there is nothing to take."""
    from deliveries.jobs import brokers as broker
    from deliveries.jobs import statements as queries
    from deliveries.statements.worker import LEASE

    t = now()
    until = t + timedelta(seconds=60)
    yield ("query", "BEGIN", None)
    params = {"kinds": ["delivery"], "now": t, "limit": batch, "queue": queue}
    taken = yield ("query", queries.TAKE.sql, params)
    if not taken:
        yield ("query", "COMMIT", None)
        return None
    direct = [broker.Message(r[1], r[2], r[3], r[4]) for r in taken if r[5] is None]
    queued = [(r[0], r[5]) for r in taken if r[5] is not None]
    messages = direct + [broker.Message.decode(payload) for _, payload in queued]
    token = uuid.uuid4()
    params = {
        "ids": [m.job_id for m in messages],
        "dispatches": [m.dispatch for m in messages],
        "until": until,
        "token": token,
        "now": t,
    }
    leased = yield ("binary", LEASE.sql, params)
    if queued:
        spent = {"spent": [i for i, _ in queued], "hidden": [], "until": until}
        yield ("query", queries.SETTLE_MESSAGES.sql, spent)
    yield ("query", "COMMIT", None)
    return leased, token


def record_steps(leased: list, token, rows: list):
    """The successes, their attempt rows and tallies in one transaction, one statement."""
    from deliveries.statements.worker import ATTEMPT_COLUMNS, RECORD

    ids = [r[0] for r in leased]
    params = {"now": now(), "ids": ids, "tokens": [token] * len(ids), "statuses": [200] * len(ids)}
    params["freed"] = False  # no failures; the successes wake the scheduler as the service's
    for i, column in enumerate(ATTEMPT_COLUMNS):
        params[column] = [row[i] for row in rows]
    yield ("query", "BEGIN", None)
    yield ("query", RECORD.sql, params)
    yield ("query", "COMMIT", None)


def endpoint_steps(endpoint_id):
    """The endpoint's URL and active secrets (the service's statement), once per process."""
    from deliveries.core import encryption
    from deliveries.statements.publish import ACTIVE_SECRETS

    url = yield ("query", "SELECT url FROM deliveries_endpoint WHERE id = %s", [endpoint_id])
    secrets = yield ("query", ACTIVE_SECRETS.sql, [[endpoint_id], now()])
    # (id, endpoint_id, token, legacy plain text): decrypted, as the service does.
    return url[0][0], [encryption.reveal(r[2], r[3]) for r in secrets]


async def run_async(conn, steps):
    answer = None
    while True:
        try:
            kind, sql, params = steps.send(answer)
        except StopIteration as done:
            return done.value
        cursor = conn.cursor()
        if kind == "copy":
            async with cursor.copy(sql) as copy:
                for row in params:
                    await copy.write_row(row)
            answer = None
        else:
            await cursor.execute(sql, params, binary=kind == "binary")
            answer = await cursor.fetchall() if cursor.description else None


def run_blocking(conn, steps):
    answer = None
    while True:
        try:
            kind, sql, params = steps.send(answer)
        except StopIteration as done:
            return done.value
        cursor = conn.cursor()
        if kind == "copy":
            with cursor.copy(sql) as copy:
                for row in params:
                    copy.write_row(row)
            answer = None
        else:
            cursor.execute(sql, params, binary=kind == "binary")
            answer = cursor.fetchall() if cursor.description else None


async def run_worker(lanes: int, batch: int, *, egress: bool, db_thread: bool) -> None:
    import aiohttp
    import psycopg
    from django.conf import settings
    from psycopg.types.json import Jsonb

    from deliveries import signing

    queue = settings.QUEUE_NAME
    worker_name = f"floor:{os.getpid()}"
    if egress:
        from deliveries.core.egress import EgressSession

        client = EgressSession(pool_size=lanes * batch)
    else:
        client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=lanes * batch))
    secrets: dict = {}
    urls: dict = {}
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(max_workers=lanes) if db_thread else None

    async def send(item: tuple) -> None:
        delivery_id, endpoint_id, body = item[0], item[2], item[5]
        headers = signing.delivery_headers(
            {}, secrets[endpoint_id], msg_id=str(delivery_id), timestamp=int(time.time()), body=body
        )
        if egress:
            response = await client.post(urls[endpoint_id], body=body, headers=headers, timeout=10)
            status = response.status
        else:
            async with client.post(urls[endpoint_id], data=body, headers=headers) as answer:
                await answer.read()
                status = answer.status
        if status != 200:
            raise RuntimeError(f"receiver answered {status}")

    async def post(item: tuple) -> tuple:
        started = now()
        t0 = time.perf_counter()
        await send(item)
        return (
            item[0], item[2], item[6], started, (time.perf_counter() - t0) * 1000,
            200, "success", "", "", False, "", False, Jsonb({}), True, worker_name,
        )  # fmt: skip

    async def lane() -> None:
        if db_thread:
            conn = await loop.run_in_executor(
                pool, lambda: psycopg.connect(connect_url(), autocommit=True)
            )

            async def run(steps):
                return await loop.run_in_executor(pool, run_blocking, conn, steps)
        else:
            conn = await psycopg.AsyncConnection.connect(connect_url(), autocommit=True)

            async def run(steps):
                return await run_async(conn, steps)

        try:
            while not stopping.is_set():
                took = await run(take_steps(queue, batch))
                if took is None:
                    await asyncio.sleep(IDLE_SLEEP)
                    continue
                leased, token = took
                for item in leased:
                    if item[2] not in urls:
                        urls[item[2]], secrets[item[2]] = await run(endpoint_steps(item[2]))
                rows = await asyncio.gather(*(post(item) for item in leased))
                await run(record_steps(leased, token, rows))
        finally:
            if db_thread:
                await loop.run_in_executor(pool, conn.close)
            else:
                await conn.close()

    async with await psycopg.AsyncConnection.connect(connect_url(), autocommit=True) as conn:
        await conn.execute(REGISTER_SQL, registration("floor-worker"))
    # SIGTERM ends the lanes between batches, as the service's worker stops: an exception
    # raised by a signal handler at an arbitrary point could leave a lock of the thread
    # pool held and the process hung at exit.
    stopping = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    try:
        await asyncio.gather(*(lane() for _ in range(lanes)))
    finally:
        await client.close()
        if pool is not None:
            pool.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=("scheduler", "relay", "worker"))
    parser.add_argument("--page", type=int, default=2000, help="scheduler and relay page")
    parser.add_argument("--lanes", type=int, default=2, help="worker: connections")
    parser.add_argument("--batch", type=int, default=128, help="worker: messages per lane")
    parser.add_argument(
        "--egress", action="store_true", help="worker: post through deliveries.core.egress"
    )
    parser.add_argument(
        "--db-thread",
        action="store_true",
        help="worker: blocking connections in a thread pool, as the service's worker",
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the worker's loop takes it over
    setup()
    if args.role == "scheduler":
        run_scheduler(args.page)
    elif args.role == "relay":
        run_relay(args.page)
    else:
        asyncio.run(
            run_worker(args.lanes, args.batch, egress=args.egress, db_thread=args.db_thread)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
