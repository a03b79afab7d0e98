"""Backfill memory stays flat: peak RSS of ``manage.py backfill`` for 10,000 and for
100,000 records (target: within 20% of each other).

    DATABASE_URL=postgres://webhooks@127.0.0.1:5432/webhooks_bench_backfill \\
        .venv/bin/python bench/backfill_memory.py [--sizes 10000,100000]

The database is created if missing and migrated. The fake provider API of the tests
(tests/ingest/fake_provider.py) serves computed records on 127.0.0.1 from a thread of
this process; each backfill is a real child process whose own peak RSS is read with
``os.wait4`` by the small process of ``bench/peak_rss.py`` that starts it. Writes
bench/results/backfill_memory.json.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import peak_rss  # noqa: E402

DEFAULT_URL = "postgres://webhooks@127.0.0.1:5432/webhooks_bench_backfill"


def ensure_database(url: str) -> None:
    import psycopg

    base, _, name = url.rpartition("/")
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000")
    parser.add_argument("--page-size", type=int, default=1000)
    args = parser.parse_args()
    url = os.environ.setdefault("DATABASE_URL", DEFAULT_URL)
    os.environ["EGRESS_ALLOW_NETWORKS"] = "127.0.0.0/8"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    ensure_database(url)
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, check=True)
    import django

    django.setup()
    from deliveries.jobs.models import Outbox
    from ingest.models import Source
    from ingest.poll_sources import poll_source_create
    from tests.ingest.fake_provider import FakeProvider, StaticRecords

    results = []
    for n in [int(s) for s in args.sizes.split(",")]:
        Source.objects.filter(slug="bench-crm").delete()  # its events and runs too
        Outbox.objects.filter(kind="inbound").delete()
        provider = FakeProvider(StaticRecords(n, per_ts=10)).start()
        try:
            poll_source_create(
                slug="bench-crm",
                config=provider.config(page_size=args.page_size),
                auth_secret="Bearer test-token",
                schedule=False,
            )
            started = time.monotonic()
            # Its own peak, not this process's (bench/peak_rss.py says why).
            code, peak_mib, out, _ = peak_rss.run(
                [
                    *(sys.executable, "manage.py", "backfill", "bench-crm"),
                    *("--since", "2024-01-01", "--until", "2030-01-01", "--rate", "1000/s"),
                ],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            elapsed = time.monotonic() - started
            summary = (out.strip().splitlines() or [""])[-1]
        finally:
            provider.stop()
        if code != 0:
            raise SystemExit(f"backfill of {n} failed: {summary}")
        results.append({"records": n, "peak_rss_mib": round(peak_mib, 1), "seconds": elapsed})
        print(f"{n:>7,} records: peak RSS {peak_mib:6.1f} MiB in {elapsed:5.1f} s  | {summary}")
    if len(results) >= 2:
        ratio = results[-1]["peak_rss_mib"] / results[0]["peak_rss_mib"]
        print(f"ratio {results[-1]['records']:,} / {results[0]['records']:,}: {ratio:.3f}")
    out = ROOT / "bench" / "results" / "backfill_memory.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
