"""The latency scenario's open-model publisher (started by bench/run.py).

Event ``i`` of ``--count`` is scheduled at ``--start-at + i / --rate`` (wall clock); this
process takes its ``--slice k/K`` (every K-th event from the k-th) and, in a loop,
publishes with ``publish_event`` every event of its slice whose scheduled time has come,
all in one transaction, then sleeps until the next one is due. A publisher that falls
behind publishes late, and the lateness counts: latency is measured from the scheduled
time. Writes ``{"scheduled": {event id: scheduled time}, "finished_at": ...}`` as JSON.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenant", required=True)
    parser.add_argument("--rate", type=float, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--start-at", type=float, required=True)
    parser.add_argument("--slice", default="0/1")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    k, of = (int(x) for x in args.slice.split("/"))
    # The repository first: bench/ (this script's directory, already on the path) has
    # modules named like the apps (bench/ingest.py), and outbound.py after it.
    sys.path.insert(0, str(ROOT / "bench"))
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    import django

    django.setup()
    from django.db import transaction
    from outbound import payload

    from deliveries.services import publish_event

    mine = list(range(k, args.count, of))
    bodies = {i: payload(i) for i in mine}
    times = {i: args.start_at + i / args.rate for i in mine}
    scheduled: dict[str, float] = {}
    pos = 0
    while pos < len(mine):
        now = time.time()
        due_end = pos
        while due_end < len(mine) and times[mine[due_end]] <= now:
            due_end += 1
        if due_end == pos:
            time.sleep(max(0.0, min(0.005, times[mine[pos]] - now)))
            continue
        with transaction.atomic():
            for i in mine[pos:due_end]:
                event = publish_event(
                    tenant=args.tenant, event_type="bench.event", payload=bodies[i]
                )
                scheduled[str(event.id)] = times[i]
        pos = due_end
    args.output.write_text(json.dumps({"scheduled": scheduled, "finished_at": time.time()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
