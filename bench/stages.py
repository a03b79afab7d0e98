"""Where the outbound pipeline's time goes: each stage alone, timed and CPU-accounted.

``bench/outbound.py`` measures the pipeline end to end; this runs its stages one after
the other in one process, on the same bench database and receiver, so each one's cost
per delivery can be read on its own:

1. **bare**: the bare aiohttp POST loop (the baseline's client CPU per request);
2. **scheduler**: ``scheduler_tick()`` until all N deliveries are admitted (outbox rows);
3. **relay**: ``relay_tick()`` until all N outbox rows are on the broker;
4. **worker**: one ``deliveries.worker.Worker`` until the queue is empty, with its steps
   wrapped to record wall time and the CPU time of the thread running them (the take:
   lock, lease, load endpoints and secrets, settle; HTTP send, signing, record).

CPU is per thread (``time.thread_time``): the event loop's thread versus the database
threads, plus the PostgreSQL server's CPU over each stage. The in-flight ceilings are
raised to N here so that stages 2 and 3 can run to completion alone; the worker's own
knobs come from ``--lanes``, ``--batch-size``, ``--concurrency``.

    python bench/stages.py --events 20000 [--json bench/results/stages.json]
"""

import argparse
import asyncio
import functools
import json
import os
import re
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import outbound  # the bench directory is not a package


class Meter:
    """Sums of wall and thread-CPU seconds by step name, safe across threads."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.lock = threading.Lock()

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                w, c = time.perf_counter() - w0, time.thread_time() - c0
                with self.lock:
                    self.wall[name] += w
                    self.cpu[name] += c
                    self.calls[name] += 1

        return timed

    def wrap_async(self, name: str, fn):
        @functools.wraps(fn)
        async def timed(*args, **kwargs):
            w0 = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                self.wall[name] += time.perf_counter() - w0
                self.calls[name] += 1

        return timed

    def table(self, n: int) -> dict:
        return {
            name: {
                "calls": self.calls[name],
                "wall_s": round(self.wall[name], 3),
                "thread_cpu_s": round(self.cpu[name], 3) if name in self.cpu else None,
                "thread_cpu_us_per_delivery": round(self.cpu[name] / n * 1e6, 1)
                if name in self.cpu
                else None,
            }
            for name in sorted(self.wall)
        }


_TABLE = re.compile(r'(?:FROM|INTO|UPDATE)\s+"?(\w+)"?', re.IGNORECASE)


def sql_key(sql: str) -> str:
    """A statement's shape: verb, first table, and the clauses that change its cost."""
    verb = sql.lstrip().split(None, 1)[0].upper()
    table = _TABLE.search(sql)
    key = f"{verb} {table.group(1) if table else ''}".strip()
    if verb == "SELECT":
        if "FOR UPDATE" in sql:
            key += " FOR UPDATE"
        if "COUNT(" in sql.upper():
            key += " count"
        if "JOIN" in sql:
            key += " +join"
    if "UNNEST" in sql.upper():
        key += " (unnest)"
    return key


class SqlMeter:
    """Wall and thread-CPU time per statement shape, across all threads: wraps Django's
    ``CursorWrapper._execute``. Wall includes the server's work and the round trip; the
    CPU is this process's (building, binding and sending the statement, reading the
    result), fetching rows after ``execute`` excluded."""

    def __init__(self) -> None:
        self.meter = Meter()
        self.saved = None

    def __enter__(self) -> "SqlMeter":
        from django.db.backends.utils import CursorWrapper

        self.saved = CursorWrapper._execute
        saved, meter = self.saved, self.meter

        def _execute(cursor, sql, params, *args):
            return meter.wrap(sql_key(sql), saved)(cursor, sql, params, *args)

        CursorWrapper._execute = _execute
        return self

    def __exit__(self, *exc) -> None:
        from django.db.backends.utils import CursorWrapper

        CursorWrapper._execute = self.saved


def stage(name: str, fn, n: int) -> dict:
    pg0 = outbound.postgres_cpu_seconds()
    w0, c0 = time.perf_counter(), time.thread_time()
    with SqlMeter() as queries:
        extra = fn() or {}
    wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
    pg = outbound.postgres_cpu_seconds() - pg0
    out = {
        "wall_s": round(wall, 3),
        "per_second": round(n / wall, 1),
        "main_thread_cpu_us_per_delivery": round(cpu / n * 1e6, 1),
        "postgres_all_cpu_us_per_delivery": round(pg / n * 1e6, 1),  # machine-wide
        **extra,
        "statements": queries.meter.table(n),
    }
    brief = {k: v for k, v in out.items() if k not in ("statements", "steps")}
    print(f"{name:>9}: {out['per_second']:>8,.0f}/s  " + json.dumps(brief), flush=True)
    for title in ("steps", "statements"):
        for key, row in sorted(out.get(title, {}).items(), key=lambda kv: -kv[1]["wall_s"]):
            print(f"    {key:<44} {json.dumps(row)}")
    return out


def run_scheduler(n: int) -> dict:
    from deliveries.scheduler import scheduler_tick

    admitted = ticks = 0
    while admitted < n:
        admitted += scheduler_tick().counts["enqueued"]
        ticks += 1
    return {"ticks": ticks}


def run_relay(n: int) -> dict:
    from deliveries.jobs import broker
    from deliveries.jobs.relay import relay_tick

    b = broker.get_broker()
    published = ticks = 0
    while published < n:
        published += relay_tick(b=b).counts["published"]
        ticks += 1
    return {"ticks": ticks}


def run_worker(
    n: int,
    lanes: int,
    batch_size: int | None,
    concurrency: int | None,
    profile: Path | None = None,
) -> dict:
    from deliveries import state, worker
    from deliveries.egress import EgressSession
    from deliveries.jobs import broker

    meter = Meter()
    patches = [
        (worker, "_take"),
        (broker.DatabaseBroker, "lock"),
        (broker.DatabaseBroker, "settle"),
        (worker, "_claim"),
        (worker, "_record_and_acknowledge"),
        (worker, "delivery_headers"),
        (worker, "active_secrets"),
        (state, "lease"),
        (state, "record"),
    ]
    saved = [(mod, attr, getattr(mod, attr)) for mod, attr in patches]
    for mod, attr, fn in saved:
        setattr(mod, attr, meter.wrap(f"{mod.__name__.split('.')[-1]}.{attr}", fn))
    post = EgressSession.post
    EgressSession.post = meter.wrap_async("egress.post (wall, overlapping)", post)
    w = worker.Worker(lanes=lanes, batch_size=batch_size, concurrency=concurrency)

    async def main():
        return await w.run(stop=asyncio.Event(), until_idle=True)

    profiler = None
    if profile is not None:
        import cProfile

        profiler = cProfile.Profile()  # profiles this thread only: the event loop's
        profiler.enable()
    try:
        counts = asyncio.run(main())
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile)
        for mod, attr, fn in saved:
            setattr(mod, attr, fn)
        EgressSession.post = post
    # What the database threads ran: the takes and the recordings (the steps above are
    # parts of these two).
    db_thread_cpu = meter.cpu["worker._take"] + meter.cpu["worker._record_and_acknowledge"]
    return {
        "counts": dict(counts),
        "db_threads_cpu_us_per_delivery": round(db_thread_cpu / n * 1e6, 1),
        "steps": meter.table(n),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=256, help="bare loop in flight")
    parser.add_argument("--lanes", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--worker-concurrency", type=int, default=None)
    parser.add_argument("--db-name", default="webhooks_bench")
    parser.add_argument(
        "--answer",
        type=int,
        default=200,
        help="the receiver's status for the deliveries (e.g. 503: every one fails once and "
        "is recorded as a retry, the failure path's cost)",
    )
    parser.add_argument(
        "--body-bytes", type=int, default=outbound.BODY_SIZE, help="every request's JSON body"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="cProfile the worker's event-loop thread; write the stats here (pstats format)",
    )
    args = parser.parse_args(argv)
    n = args.events
    outbound.BODY_SIZE = args.body_bytes  # payload() and the bare loop's body read it

    base_url = os.environ.get("DATABASE_URL") or "postgres://webhooks@127.0.0.1:5432/webhooks"
    db_url = outbound.with_db(base_url, args.db_name, "bench-stages")
    for name in (
        "DELIVERY_MAX_IN_FLIGHT",
        "DELIVERY_TENANT_MAX_IN_FLIGHT",
        "DELIVERY_ENDPOINT_MAX_CONCURRENCY",
    ):
        os.environ[name] = str(max(n, 5000))
    outbound.ensure_database(base_url, args.db_name)
    outbound.migrate({**os.environ, "DATABASE_URL": db_url})
    outbound.setup_django(db_url)
    receiver = outbound.start_receiver(None)
    result: dict = {"events": n, "versions": outbound.versions(args.db_name)}
    try:
        bare = outbound.run_bare(receiver, n, args.concurrency)
        result["bare"] = {
            **bare,
            "client_cpu_us_per_request": round(bare["cpu_seconds"]["client"] / n * 1e6, 1),
        }
        print(
            f"{'bare':>9}: {bare['per_second']:>8,.0f}/s  client CPU "
            f"{result['bare']['client_cpu_us_per_request']} us/request",
            flush=True,
        )
        outbound.truncate()
        hook = "/hook" if args.answer == 200 else f"/status/{args.answer}/hook"
        result["answer"] = args.answer
        result["publish"] = outbound.publish(n, receiver.url(hook))
        print(f"{'publish':>9}: {result['publish']['per_second']:>8,.0f}/s", flush=True)
        result["scheduler"] = stage("scheduler", lambda: run_scheduler(n), n)
        result["relay"] = stage("relay", lambda: run_relay(n), n)
        receiver.reset()
        result["worker"] = stage(
            "worker",
            lambda: run_worker(
                n, args.lanes, args.batch_size, args.worker_concurrency, profile=args.profile
            ),
            n,
        )
        got = receiver.counts()
        if got["distinct_webhook_ids"] < n:
            raise outbound.BenchError(f"the worker delivered {got} of {n}")
    finally:
        outbound.stop_all()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
