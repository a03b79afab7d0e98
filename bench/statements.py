"""What each statement of the outbound fast path costs per delivery on PostgreSQL.

The real pipeline code, in process and one stage after another, on N published events to
one endpoint (the throughput scenario's layout): ``publish_event`` in transactions of
1,000, then ``scheduler_tick`` until nothing is admitted, ``relay_tick`` until nothing
is published (with a broker outside the database only: the database broker's workers
take the outbox rows themselves), and the real ``Worker`` (the product's lanes, batch
and concurrency) until the queue is empty, posting to ``bench/receiver.py``. So every
statement runs in its place, with the batches a loaded pipeline runs it with (pages of
``SCHEDULER_PAGE_SIZE`` and ``RELAY_PAGE_SIZE``, takes of ``WORKER_BATCH_SIZE``), in
rounds of the three loops until every delivery has succeeded (admission stops at
``DELIVERY_MAX_IN_FLIGHT``). The endpoint and tenant ceilings are the throughput
scenario's (``bench/run.py``). Then the host's background jobs the same way: N no-op
jobs ``enqueue``d in transactions of 1,000 (stage ``enqueue``), run by the real
``JobWorker`` (``JOBS_CONCURRENCY``) until none is left (stage ``jobs``); their figures
are per job.

Every named ``Statement`` of the modules in ``STATEMENT_MODULES`` is found by name at
start (a statement that is gone is simply not reported; one that appears is), and each
call is timed from the client: the round trip, the server's work and the reading of the
rows. The rest of the SQL (the ORM's, Django's cursor) is timed by a wrapper on every
connection and shown by its first words, and every COMMIT too. Reported per stage and
statement: calls, statements per delivery, µs per call and µs per delivery (the median
over the repeats).

    python bench/statements.py [--events 20000] [--repeat 3]   # bench/results/statements.json
"""

import argparse
import asyncio
import importlib
import json
import os
import re
import statistics
import sys
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import outbound as ob  # noqa: E402 - bench/ is not a package
from run import SERVICE_ENV  # noqa: E402

# The modules whose module-level ``Statement`` objects are the fast path's, each with
# the name of the kind its statements are reported under ("deliveries.LEASE").
STATEMENT_MODULES = {
    "deliveries.statements.admit": "deliveries",
    "deliveries.statements.worker": "deliveries",
    "deliveries.statements.publish": "deliveries",
    "deliveries.statements.reads": "deliveries",
    "deliveries.jobs.statements": "deliveries.jobs",
    "deliveries.jobs.background.statements": "deliveries.jobs",
    "ingest.statements": "ingest",
}
DELIVERY_STAGES = ("publish", "scheduler", "relay", "worker")
JOB_STAGES = ("enqueue", "jobs")
STAGES = DELIVERY_STAGES + JOB_STAGES
NOOP_JOB = "bench.statements.noop"


async def noop() -> None:
    """The no-op job: what a job costs the machinery, and nothing else."""


COMMIT = "COMMIT"


def named_statements() -> dict[int, str]:
    """Every ``Statement`` bound to a name in STATEMENT_MODULES: id -> "module.NAME"."""
    from deliveries.core.sql import Statement

    names = {}
    for module_name, kind in STATEMENT_MODULES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, value in vars(module).items():
            if isinstance(value, Statement):
                names.setdefault(id(value), f"{kind}.{name}")
    return names


class Tally:
    """Calls and nanoseconds by (stage, statement), from any thread."""

    def __init__(self) -> None:
        self.stage = "setup"
        self.calls: dict[tuple[str, str], list[int]] = defaultdict(list)
        self._lock = threading.Lock()
        self._depth = threading.local()

    def add(self, name: str, ns: int) -> None:
        with self._lock:
            self.calls[(self.stage, name)].append(ns)

    @contextmanager
    def timing(self, name: str):
        """Time the block as ``name``, unless it runs inside another timed block of this
        thread (a Statement's call runs Django's cursor for ``bound=False`` ones)."""
        depth = getattr(self._depth, "n", 0)
        self._depth.n = depth + 1
        started = time.perf_counter_ns()
        try:
            yield
        finally:
            self._depth.n = depth
            if depth == 0:
                self.add(name, time.perf_counter_ns() - started)


def other_sql_name(sql: str) -> str:
    """The ORM's and Django cursor's SQL by its first words (table names kept)."""
    # Savepoints are named after their thread and depth: one row for all of them.
    words = re.sub(r'"s\d+_x\d+"', "…", re.sub(r"\s+", " ", sql).strip())
    return "other: " + (words[:60] + "…" if len(words) > 60 else words)


def instrument(tally: Tally):
    """Time every named Statement's call, every other query on Django's connections and
    every commit; returns the function that undoes it."""
    from django.db import connections
    from django.db.backends.signals import connection_created

    from deliveries.core.sql import Statement

    names = named_statements()
    call = Statement.__call__

    def timed_call(self, params=None, *, using=None):
        with tally.timing(names.get(id(self), "unnamed Statement")):
            return call(self, params, using=using)

    Statement.__call__ = timed_call

    def wrapper(execute, sql, params, many, context):
        with tally.timing(other_sql_name(sql)):
            return execute(sql, params, many, context)

    def wrap(connection, **_kwargs):
        if wrapper not in connection.execute_wrappers:
            connection.execute_wrappers.append(wrapper)

    connection_created.connect(wrap, weak=False)
    for connection in connections.all():
        wrap(connection)
    wrapper_class = connections["default"].__class__
    commit = wrapper_class._commit

    def timed_commit(self):
        with tally.timing(COMMIT):
            return commit(self)

    wrapper_class._commit = timed_commit

    def restore() -> None:
        Statement.__call__ = call
        wrapper_class._commit = commit
        connection_created.disconnect(wrap)
        for connection in connections.all():
            if wrapper in connection.execute_wrappers:
                connection.execute_wrappers.remove(wrapper)

    return restore


def run_once(n: int, receiver, tally: Tally) -> dict:
    """One pass of the four stages over N events; the time each stage took."""
    from django.db import transaction

    from deliveries.jobs.brokers import get_broker, takes_outbox
    from deliveries.jobs.relay import relay_tick
    from deliveries.models import Delivery, Tenant
    from deliveries.scheduler import scheduler_tick
    from deliveries.services import endpoint_create, publish_event
    from deliveries.worker import Worker

    tally.stage = "setup"
    ob.truncate()
    tenant = Tenant.objects.create(name="bench-statements")
    endpoint_create(tenant=tenant, url=receiver.url("/hook"))
    bodies = [ob.payload(i) for i in range(n)]
    seconds = {}

    def stage(name: str, work) -> None:
        tally.stage = name
        started = time.perf_counter()
        work()
        seconds[name] = round(seconds.get(name, 0) + time.perf_counter() - started, 3)
        tally.stage = "between"

    def publish() -> None:
        for start in range(0, n, ob.PUBLISH_BATCH):
            with transaction.atomic():
                for i in range(start, min(n, start + ob.PUBLISH_BATCH)):
                    publish_event(tenant=tenant, event_type="bench.event", payload=bodies[i])

    def schedule() -> None:
        while scheduler_tick().counts["enqueued"]:
            pass

    def relay() -> None:
        # The database broker's workers take the outbox rows themselves: no relay runs,
        # and the stage counts nothing (a broker outside the database has one).
        if takes_outbox(get_broker()):
            return
        while relay_tick().counts.get("published"):
            pass

    def work() -> None:
        worker = Worker()
        asyncio.run(worker.run(stop=asyncio.Event(), until_idle=True))

    stage("publish", publish)
    tally.stage = "between"
    ob.analyze()  # as the throughput scenario does after publishing
    receiver.reset()
    # Rounds of the three stages: admission stops at DELIVERY_MAX_IN_FLIGHT.
    for _ in range(2 + n // 100):
        for name, step in (("scheduler", schedule), ("relay", relay), ("worker", work)):
            stage(name, step)
        if not Delivery.objects.exclude(state="succeeded").exists():
            break
    succeeded = Delivery.objects.filter(state="succeeded").count()
    counts = receiver.counts()
    if succeeded != n or counts["distinct_webhook_ids"] != n or counts["requests"] != n:
        raise ob.BenchError(f"{succeeded} of {n} succeeded; the receiver counted {counts}")
    seconds.update(run_jobs(n, tally))
    return seconds


def run_jobs(n: int, tally: Tally) -> dict:
    """N no-op jobs enqueued, then run by the real JobWorker until none is left."""
    from django.db import transaction

    from deliveries.jobs.background import JOB_TYPES, enqueue, job
    from deliveries.jobs.background.worker import JobWorker
    from deliveries.jobs.models import Job, JobRun

    if NOOP_JOB not in JOB_TYPES:
        job(NOOP_JOB, queue="default")(noop)
    tally.stage = "setup"
    ob.sql(f"TRUNCATE {Job._meta.db_table}, {JobRun._meta.db_table}")
    seconds = {}
    started = time.perf_counter()
    tally.stage = "enqueue"
    for start in range(0, n, ob.PUBLISH_BATCH):
        with transaction.atomic():
            for _ in range(start, min(n, start + ob.PUBLISH_BATCH)):
                enqueue(NOOP_JOB)
    seconds["enqueue"] = round(time.perf_counter() - started, 3)
    tally.stage = "between"
    ob.sql(f"ANALYZE {Job._meta.db_table}")  # as the jobs scenario does
    started = time.perf_counter()
    tally.stage = "jobs"
    JobWorker(queues=["default"]).run(until_idle=True)
    seconds["jobs"] = round(time.perf_counter() - started, 3)
    tally.stage = "between"
    done = Job.objects.filter(state="done").count()
    if done != n:
        raise ob.BenchError(f"jobs: {done} of {n} done")
    return seconds


def summarize(runs: list[dict[tuple[str, str], list[int]]], n: int) -> list[dict]:
    """One row per (stage, statement): the median over the repeats of its calls, µs per
    call and µs per delivery."""
    keys = {k for r in runs for k in r if k[0] in STAGES}
    rows = []
    for stage, name in keys:
        samples = [r.get((stage, name), []) for r in runs]
        calls = statistics.median(len(s) for s in samples)
        total_us = statistics.median(sum(s) / 1000 for s in samples)
        rows.append(
            {
                "stage": stage,
                "statement": name,
                "calls": calls,
                "per_delivery": round(calls / n, 4),
                "us_per_call": round(total_us / calls, 1) if calls else None,
                "us_per_delivery": round(total_us / n, 2),
            }
        )
    # By stage in pipeline order, the costliest statement first.
    return sorted(rows, key=lambda r: (STAGES.index(r["stage"]), -r["us_per_delivery"]))


def markdown(result: dict) -> str:
    n = result["events"]
    lines = [
        f"Statements per delivery, N = {n:,} to one endpoint (then N no-op background "
        f"jobs: per job), median of {result['repeat']} repeat(s); µs from the client "
        "(round trip included).",
        "",
        "| stage | statement | calls | per delivery | µs per call | µs per delivery |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['stage']} | `{r['statement']}` | {r['calls']:,.0f} | {r['per_delivery']:.3f} "
            f"| {r['us_per_call'] or 0:,.1f} | {r['us_per_delivery']:,.2f} |"
        )
    for stage, t in result["totals"].items():
        lines.append(
            f"| **{stage}** | all, commits included | | **{t['per_delivery']:.3f}** | "
            f"| **{t['us_per_delivery']:,.2f}** |"
        )
    return "\n".join(lines)


def totals(rows: list[dict]) -> dict:
    out: dict = {}
    for r in rows:
        t = out.setdefault(r["stage"], {"per_delivery": 0.0, "us_per_delivery": 0.0})
        t["per_delivery"] = round(t["per_delivery"] + r["per_delivery"], 4)
        t["us_per_delivery"] = round(t["us_per_delivery"] + r["us_per_delivery"], 2)
    for label, stages in (("a delivery", DELIVERY_STAGES), ("a job", JOB_STAGES)):
        mine = [out[stage] for stage in stages if stage in out]
        if mine:
            out[label] = {
                k: round(sum(t[k] for t in mine), 4) for k in ("per_delivery", "us_per_delivery")
            }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000, help="N (default 20,000)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="N = 2,000, one repeat")
    parser.add_argument("--db-name", default=None, help="default: <DATABASE_URL's>_bench_stmt")
    parser.add_argument("--output", type=Path, default=ob.RESULTS / "statements.json")
    args = parser.parse_args(argv)
    n = 2000 if args.quick else args.events
    repeat = 1 if args.quick else args.repeat
    base_url = ob.database_url()
    db_name = args.db_name or f"{urlsplit(base_url).path.lstrip('/') or 'webhooks'}_bench_stmt"
    ob.ensure_database(ob.with_db(base_url, "postgres"), db_name)
    db_url = ob.with_db(base_url, db_name, "bench-statements")
    ob.migrate({**os.environ, "DATABASE_URL": db_url})
    # The throughput scenario's ceilings (bench/run.py says why): one endpoint takes all.
    os.environ.update(SERVICE_ENV)
    ob.setup_django(db_url)
    tally = Tally()
    instrument(tally)  # for the rest of this process
    receiver = ob.start_receiver(None)
    runs, seconds = [], []
    try:
        for i in range(repeat):
            tally.calls.clear()
            seconds.append(run_once(n, receiver, tally))
            runs.append(dict(tally.calls))
            print(f"[{i + 1}/{repeat}] stages (s): {json.dumps(seconds[-1])}", flush=True)
    except ob.BenchError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        ob.stop_all()
    rows = summarize(runs, n)
    result = {
        "benchmark": "statements",
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "events": n,
        "repeat": repeat,
        "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "versions": ob.versions(db_name),
        "stage_seconds": seconds,
        "rows": rows,
        "totals": totals(rows),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print("\n" + markdown(result) + f"\n\nresults: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
