"""Inbound processing alone: stored events drained by one worker process, no HTTP.

    .venv/bin/python bench/inbound_process.py [--events 2000] [--entities distinct|shared|none]

Stores ``--events`` Stripe-style events of a source ``benchin`` (one batch
``inbound_store_many``, as a poller does), publishes their processing jobs with the relay,
then drains the broker in this process with the real worker
(``Worker.run(until_idle=True)``, ``--lanes``, 4 as ``run_workers``) and the no-op handler
of ``bench/inbound_noop.py``. Prints events/s (wall) and the CPU of this process and of
its PostgreSQL backends per event. ``--entities``: a distinct entity per event (each
takes and gives back its own entity lock and version row), 50 entities shared by all
events (two lanes applying events of one entity at once make one of them wait
``LOCK_BUSY_RETRY`` and come back through the scheduler, and an event older than one
already applied is skipped as stale), or none (no lock, no version). Runs in the
dedicated database ``webhooks_bench`` next to the one ``DATABASE_URL`` names, with its
ingest and queue tables truncated first. This is where processing's own cost shows;
``bench/run.py --scenarios inbound`` measures it with the service's own processes, both
together with the receive view on the same cores and on a stored backlog.
"""

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import outbound as ob

SLUG = "benchin"


def store_backlog(n: int, entities: str) -> None:
    """Empty the inbound tables and store ``n`` events of source ``benchin`` with their
    processing jobs (outbox rows), in one ``inbound_store_many``: a stored backlog, as a
    poller's page or a burst received by many web processes leaves it. ``entities``: a
    distinct entity per event, 50 shared by all, or none."""
    from django.db import transaction
    from django.utils import timezone

    from ingest.models import Source
    from ingest.services import NewEvent, inbound_store_many, source_create

    ob.truncate_inbound()
    source = Source.objects.filter(slug=SLUG).first() or source_create(
        slug=SLUG, scheme="stripe", secrets=["whsec_bench_inbound"]
    )
    now = timezone.now()

    def entity(i: int) -> str:
        return {"distinct": f"cus_{i}", "shared": f"cus_{i % 50}", "none": ""}[entities]

    events = [
        NewEvent(
            event_id=f"evt_{i}",
            event_type="invoice.paid",
            entity_id=entity(i),
            occurred_at=now + timedelta(milliseconds=i),
            body=json.dumps(
                {"id": f"evt_{i}", "type": "invoice.paid", "data": {"object": {"id": entity(i)}}}
            ).encode(),
        )
        for i in range(n)
    ]
    with transaction.atomic():
        inbound_store_many(source=source, events=events)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--entities", choices=("distinct", "shared", "none"), default="distinct")
    parser.add_argument("--lanes", type=int, default=4, help="as run_workers (default 4)")
    args = parser.parse_args()
    base = ob.database_url()
    ob.ensure_database(ob.with_db(base, "postgres"), "webhooks_bench")
    url = ob.with_db(base, "webhooks_bench", "bench-inbound")
    os.environ["INGEST_HANDLER_MODULES"] = "bench.inbound_noop"
    ob.migrate({**os.environ, "DATABASE_URL": url})
    ob.setup_django(url)
    from deliveries.jobs.relay import relay_tick
    from deliveries.scheduler import scheduler_tick
    from deliveries.worker import Worker
    from ingest.models import InboundEvent
    from ingest.services import LOCK_BUSY_RETRY

    store_backlog(args.events, args.entities)
    while not relay_tick(page_size=2000).idle:
        pass

    cpu0, wall0, pg0 = (
        time.process_time(),
        time.perf_counter(),
        ob.postgres_cpu_seconds(reaped=True),
    )
    counts: Counter = Counter()
    for _ in range(60):
        counts += asyncio.run(
            Worker(lanes=args.lanes).run(stop=asyncio.Event(), until_idle=True, idle_sleep=0)
        )
        done = InboundEvent.objects.filter(state__in=["processed", "skipped"]).count()
        if done == args.events:
            break
        # Events whose entity another lane was applying wait LOCK_BUSY_RETRY and come
        # back through the scheduler, as in the service.
        time.sleep(LOCK_BUSY_RETRY)
        scheduler_tick()
        relay_tick()
    wall = time.perf_counter() - wall0
    cpu = time.process_time() - cpu0
    pg = ob.postgres_cpu_seconds(reaped=True) - pg0
    if done != args.events:
        raise SystemExit(f"only {done} of {args.events} events processed: {dict(counts)}")
    print(
        f"{args.events:,} events, entities {args.entities}: {args.events / wall:,.0f} events/s; "
        f"CPU per event: this process {cpu / args.events * 1e6:,.0f} us, "
        f"PostgreSQL {pg / args.events * 1e6:,.0f} us; {dict(counts)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
