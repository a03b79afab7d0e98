"""Inbound processing alone: stored events drained by one worker process, no HTTP.

    .venv/bin/python bench/inbound_process.py [--events 2000] [--entities distinct|shared|none]

Stores ``--events`` Stripe-style events of a source ``benchin`` (one batch
``inbound_store_many``, as a poller does), publishes their processing jobs with the relay,
then drains the broker in this process with the real worker (``Worker.run(until_idle=True)``,
2 lanes) and the no-op handler of ``bench/inbound_noop.py``. Prints events/s (wall) and
the CPU of this process and of its PostgreSQL backends per event. ``--entities``: a
distinct entity per event (each takes and gives back its own entity lock and version
row), 50 entities shared by all events (events of one entity wait for each other), or
none (no lock, no version). Runs in the dedicated database ``webhooks_bench`` next to
the one ``DATABASE_URL`` names, with its ingest and queue tables truncated first. This
is where processing's own cost shows; ``bench/run.py --scenarios inbound`` measures it
together with the receive view on the same cores.
"""

import argparse
import asyncio
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import outbound as ob


def postgres_cpu() -> float:
    """CPU seconds of PostgreSQL's processes, the backends that exited included (the
    worker's connections close when it stops): each process's own time plus the time of
    the children it reaped, which the postmaster keeps. Other databases count too, so run
    it on a quiet machine."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/comm") as f:
                if not f.read().startswith("postgres"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in fields[11:15]) / ob.CLK_TCK
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--entities", choices=("distinct", "shared", "none"), default="distinct")
    args = parser.parse_args()
    base = ob.database_url()
    ob.ensure_database(ob.with_db(base, "postgres"), "webhooks_bench")
    url = ob.with_db(base, "webhooks_bench", "bench-inbound")
    os.environ["INGEST_HANDLER_MODULES"] = "bench.inbound_noop"
    ob.migrate({**os.environ, "DATABASE_URL": url})
    ob.setup_django(url)
    from django.db import transaction
    from django.utils import timezone

    from deliveries.loops import relay_tick
    from deliveries.worker import Worker
    from ingest.models import InboundEvent, Source
    from ingest.services import NewEvent, inbound_store_many, source_create

    ob.sql(
        "TRUNCATE ingest_handlerrun, ingest_entityversion, ingest_inboundevent, "
        "deliveries_outbox, deliveries_queuemessage, deliveries_entitylock CASCADE"
    )
    source = Source.objects.filter(slug="benchin").first() or source_create(
        slug="benchin", scheme="stripe", secrets=["whsec_bench_inbound"]
    )
    now = timezone.now()

    def entity(i: int) -> str:
        return {"distinct": f"cus_{i}", "shared": f"cus_{i % 50}", "none": ""}[args.entities]

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
        for i in range(args.events)
    ]
    with transaction.atomic():
        inbound_store_many(source=source, events=events)
    while not relay_tick(page_size=2000).idle:
        pass

    cpu0, wall0, pg0 = time.process_time(), time.perf_counter(), postgres_cpu()
    counts = asyncio.run(
        Worker(lanes=2, batch_size=200).run(stop=asyncio.Event(), until_idle=True, idle_sleep=0)
    )
    wall = time.perf_counter() - wall0
    cpu = time.process_time() - cpu0
    pg = postgres_cpu() - pg0
    done = InboundEvent.objects.filter(state__in=["processed", "skipped"]).count()
    if done != args.events:
        raise SystemExit(f"only {done} of {args.events} events processed: {dict(counts)}")
    print(
        f"{args.events:,} events, entities {args.entities}: {args.events / wall:,.0f} events/s; "
        f"CPU per event: this process {cpu / args.events * 1e6:,.0f} us, "
        f"PostgreSQL {pg / args.events * 1e6:,.0f} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
