"""CPU per no-op inbound event processed from a stored backlog: the processing process's
and its PostgreSQL backends', per 1,000 events.

The inbound scenario's backlog (``bench/run.py``: N events of the bench's Stripe-scheme
source, each of an entity of its own, stored with their outbox rows by one
``inbound_store_many``), then the real ``Worker`` of ``run_workers`` in this process, at
the product's defaults (``WORKER_BATCH_SIZE``), taking batches until the backlog is
processed, with ``bench/inbound_noop.py``'s handler. CPU, not a rate, so that a machine
shared with other work still gives comparable figures: the process's own CPU
(``time.process_time``: every thread) and that of the database's backends (read from
``/proc`` while the worker's connections are still open), on a database of its own beside
the one ``DATABASE_URL`` names (``<name>_bench_inbound``), which nothing else uses.
``--lanes`` lanes take batches concurrently, as a worker process's lanes do.

``--statements`` also counts the statements a batch runs, each with its time from the
client and the CPU its backend spent on it (``/proc/<pid>/schedstat``, nanoseconds):
measure the CPU figures without it, the accounting costs a little of both.

    python bench/inbound_cpu.py [--events 20000] [--repeat 3] [--lanes 1] [--statements]
"""

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import outbound as ob  # noqa: E402 - bench/ is not a package


class Accounts:
    """Calls, client nanoseconds and backend CPU nanoseconds by statement, from any
    thread: every named ``Statement``, every other query on Django's connections by its
    first words, and every COMMIT."""

    def __init__(self) -> None:
        import threading

        self.rows: dict[str, list[int]] = {}
        self.on = False
        self._lock = threading.Lock()
        self._depth = threading.local()

    def install(self) -> None:
        from django.db import connections
        from django.db.backends.signals import connection_created
        from statements import named_statements, other_sql_name

        from deliveries.core.sql import Statement

        names = named_statements()
        call = Statement.__call__
        accounts = self

        def timed_call(self, params=None, *, using=None):
            db = connections[using or "default"]
            with accounts.timing(db, names.get(id(self), "unnamed Statement")):
                return call(self, params, using=using)

        Statement.__call__ = timed_call

        def wrapper(execute, sql, params, many, context):
            with accounts.timing(context["connection"], other_sql_name(sql)):
                return execute(sql, params, many, context)

        def wrap(connection, **_kwargs):
            if wrapper not in connection.execute_wrappers:
                connection.execute_wrappers.append(wrapper)

        connection_created.connect(wrap, weak=False)
        for connection in connections.all():
            wrap(connection)
        wrapper_class = connections["default"].__class__
        commit = wrapper_class._commit

        def timed_commit(db):
            with accounts.timing(db, "COMMIT"):
                return commit(db)

        wrapper_class._commit = timed_commit

    @staticmethod
    def _backend_ns(db) -> int:
        pid = db.connection.info.backend_pid if db.connection is not None else None
        if pid is None:
            return 0
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0])

    def timing(self, db, name: str):
        from contextlib import contextmanager

        @contextmanager
        def timed():
            depth = getattr(self._depth, "n", 0)
            self._depth.n = depth + 1
            outer = depth == 0 and self.on
            if outer:
                db.ensure_connection()
                cpu0, t0 = self._backend_ns(db), time.perf_counter_ns()
            try:
                yield
            finally:
                self._depth.n = depth
                if outer:
                    t, cpu = time.perf_counter_ns() - t0, self._backend_ns(db) - cpu0
                    with self._lock:
                        row = self.rows.setdefault(name, [0, 0, 0])
                        row[0] += 1
                        row[1] += t
                        row[2] += cpu

        return timed()


def drain(lanes: int) -> tuple[int, dict[int, float], dict[int, float]]:
    """Process the stored backlog with the real Worker's take; returns the batches taken
    and the database's backend CPU (by pid) before and after, read while the worker's
    connections are open."""
    from deliveries.worker import Worker, close_thread_connections

    worker = Worker(lanes=lanes)
    db_name = urlsplit(os.environ["DATABASE_URL"]).path.lstrip("/")
    batches = 0

    async def lane() -> None:
        nonlocal batches
        while await worker.process_batch():
            batches += 1

    async def run() -> tuple[dict, dict]:
        # Every lane's connection open before the CPU is first read.
        await asyncio.gather(*(worker._in_db(ob.sql, "SELECT 1") for _ in range(lanes + 1)))
        before = ob.database_backends_cpu(db_name)
        await asyncio.gather(*(lane() for _ in range(lanes)))
        return before, ob.database_backends_cpu(db_name)

    try:
        before, after = asyncio.run(run())
    finally:
        close_thread_connections(worker.db, lanes + 1)
    return batches, before, after


def run_once(n: int, lanes: int, accounts: Accounts | None = None, analyze: bool = False) -> dict:
    from run import store_backlog

    store_backlog(n)
    if analyze:
        ob.sql("ANALYZE ingest_inboundevent, deliveries_outbox")
    if accounts is not None:
        accounts.on = True
    cpu0, wall0 = time.process_time(), time.perf_counter()
    batches, pg_before, pg_after = drain(lanes)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    if accounts is not None:
        accounts.on = False
    postgres = sum(after - pg_before.get(pid, 0.0) for pid, after in pg_after.items())
    runs, events = ob.sql("SELECT count(*), count(DISTINCT event_id) FROM ingest_handlerrun")[0]
    states = dict(ob.sql("SELECT state, count(*) FROM ingest_inboundevent GROUP BY state"))
    if (runs, events) != (n, n) or states != {"processed": n}:
        raise ob.BenchError(f"{runs} handler runs for {events} events; states {states}")
    return {
        "batches": batches,
        "wall_seconds": round(wall, 3),
        "process_cpu_seconds": round(cpu, 3),
        "postgres_cpu_seconds": round(postgres, 3),
        "process_ms_per_1000": round(cpu * 1e6 / n, 1),
        "postgres_ms_per_1000": round(postgres * 1e6 / n, 1),
        "total_ms_per_1000": round((cpu + postgres) * 1e6 / n, 1),
        "per_second_wall": round(n / wall, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000, help="N (default 20,000)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--lanes", type=int, default=1, help="lanes taking batches (1)")
    parser.add_argument("--statements", action="store_true", help="count statements per batch")
    parser.add_argument(
        "--analyze",
        action="store_true",
        help="ANALYZE the stored backlog first (bench/run.py does not: its tables are as stored)",
    )
    parser.add_argument("--db-name", default=None, help="default: <DATABASE_URL's>_bench_inbound")
    parser.add_argument("--json", type=Path, default=None, help="write the runs here")
    args = parser.parse_args(argv)
    os.environ["INGEST_HANDLER_MODULES"] = "bench.inbound_noop"
    os.environ.setdefault("DEBUG", "0")
    base_url = ob.database_url()
    db_name = args.db_name or f"{urlsplit(base_url).path.lstrip('/') or 'webhooks'}_bench_inbound"
    ob.ensure_database(ob.with_db(base_url, "postgres"), db_name)
    db_url = ob.with_db(base_url, db_name, "bench-inbound-cpu")
    ob.migrate({**os.environ, "DATABASE_URL": db_url})
    ob.setup_django(db_url)

    accounts = None
    if args.statements:
        accounts = Accounts()
        accounts.install()
    runs = []
    for i in range(args.repeat):
        run = run_once(args.events, args.lanes, accounts, args.analyze)
        runs.append(run)
        print(f"run {i + 1}: {json.dumps(run)}", flush=True)
    keys = ("process_ms_per_1000", "postgres_ms_per_1000", "total_ms_per_1000")
    summary = {
        k: {"median": statistics.median(r[k] for r in runs), "min": min(r[k] for r in runs),
            "max": max(r[k] for r in runs)}
        for k in keys
    }  # fmt: skip
    print(f"N = {args.events:,}, lanes {args.lanes}, CPU ms per 1,000 events:")
    for k, v in summary.items():
        print(f"  {k}: median {v['median']}, min {v['min']}, max {v['max']}")
    if accounts is not None:
        batches = sum(r["batches"] for r in runs)
        events = args.events * args.repeat
        print(f"statements ({batches} batches over {args.repeat} runs), per event: client µs,")
        print("backend CPU µs; per batch: calls")
        for name, (calls, ns, cpu) in sorted(accounts.rows.items(), key=lambda x: -x[1][2]):
            print(
                f"  {ns / 1000 / events:7.2f} {cpu / 1000 / events:7.2f}"
                f" {calls / batches:6.2f}  {name}"
            )
    if args.json:
        args.json.write_text(json.dumps({"events": args.events, "runs": runs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
