"""Baseline: a bare ``FOR UPDATE SKIP LOCKED`` batch queue on PostgreSQL.

A minimal table (id, message id, the JSON body as text, a claim deadline); one process per
core, each running ``--workers`` asyncio workers with their own connection. A worker
claims a batch (``UPDATE ... SET claimed_until = now() + 30 s WHERE id IN (SELECT ... FOR
UPDATE SKIP LOCKED LIMIT batch) RETURNING``), posts the batch concurrently with aiohttp,
then deletes the rows it delivered: at-least-once, two statements per batch, nothing
else (no states, no attempts, no retries, no ceilings). What a queue costs at the least
on this database; the service's distance to it is the price of its bookkeeping. With
``--workload noop`` each row's body is ``{"seq": i}`` and a worker marks each claimed
row done (``common.mark_done``) instead of posting it: claim a batch, delete it.

    python bench/peers/skiplocked.py --events N --receiver URL --db-url URL   # the driver
    python bench/peers/skiplocked.py --work ...                              # one process
"""

import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.peers import common

TABLE = "bench_skiplocked_job"
CLAIM = f"""
UPDATE {TABLE} SET claimed_until = now() + interval '30 seconds'
WHERE id IN (
    SELECT id FROM {TABLE}
    WHERE claimed_until IS NULL OR claimed_until < now()
    ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED
)
RETURNING id, msg_id, body
"""


async def work(db_url: str, receiver: str, workers: int, batch: int, workload: str) -> None:
    import aiohttp
    import psycopg

    url = receiver + "/hook"

    async def worker(session: aiohttp.ClientSession) -> None:
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
            while True:
                rows = await (await conn.execute(CLAIM, [batch])).fetchall()
                if not rows:
                    # Polled until the driver stops the process, as the other peers'
                    # workers are: its backends must live until the driver reads their CPU.
                    await asyncio.sleep(0.05)
                    continue
                if workload == "noop":
                    for _, _, body in rows:
                        common.mark_done(json.loads(body)["seq"])
                else:
                    await asyncio.gather(
                        *(common.post_async(session, url, body.encode(), m) for _, m, body in rows)
                    )
                done = [r[0] for r in rows]
                await conn.execute(f"DELETE FROM {TABLE} WHERE id = ANY(%s)", [done])

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(worker(session) for _ in range(workers)))


def main() -> int:
    parser = common.arguments(__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4, help="asyncio workers per process")
    parser.add_argument("--batch", type=int, default=100, help="rows per claim")
    parser.add_argument("--work", action="store_true", help="be one worker process")
    args = parser.parse_args()
    if args.work:
        asyncio.run(work(args.db_url, args.receiver, args.workers, args.batch, args.workload))
        return 0
    import psycopg

    def reset() -> None:
        with psycopg.connect(args.db_url, autocommit=True) as conn:
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {TABLE} (id bigserial PRIMARY KEY, "
                "msg_id text NOT NULL, body text NOT NULL, claimed_until timestamptz)"
            )
            conn.execute(f"TRUNCATE {TABLE}")

    def enqueue(n: int) -> None:
        with psycopg.connect(args.db_url) as conn, conn.cursor() as cur:
            with cur.copy(f"COPY {TABLE} (msg_id, body) FROM STDIN") as copy:
                for i in range(n):
                    body = common.payload(i) if args.workload == "post" else {"seq": i}
                    copy.write_row((f"msg_{i}", common.encode(body).decode()))
            cur.execute(f"ANALYZE {TABLE}")

    worker = [
        sys.executable,
        __file__,
        "--work",
        "--receiver",
        args.receiver,
        "--db-url",
        args.db_url,
        "--workers",
        str(args.workers),
        "--batch",
        str(args.batch),
        "--workload",
        args.workload,
    ]
    return common.drive(
        "skip-locked",
        args,
        reset=reset,
        enqueue=enqueue,
        workers=[worker] * args.processes,
        env=common.peer_env(),
        settings={
            "processes": args.processes,
            "workers_per_process": args.workers,
            "batch": args.batch,
            "workload": args.workload,
        },
    )


if __name__ == "__main__":
    sys.exit(main())
