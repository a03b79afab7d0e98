"""What PostgreSQL's compression of stored bodies costs: pglz (its default) against lz4.

A body over about 2 KB is compressed when it is stored: an event's at publish, inside
the caller's transaction, and an inbound event's in the receive view, before the 2xx.
This inserts the same realistic JSON bodies (an order with line items) into a scratch
table with each method, one INSERT each, then reads them back three times, and prints
the backend's CPU per row (from /proc) and the table's size.

    python bench/toast_compression.py [--bytes 65536] [--rows 300]
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

import outbound as ob  # bench/ is not a package


def body(size: int, rng: random.Random) -> bytes:
    items: list[dict] = []
    while len(json.dumps(items)) < size:
        items.append(
            {
                "id": rng.randrange(10**12),
                "sku": f"SKU-{rng.randrange(10**6):06d}",
                "title": f"{rng.choice(['Blue shirt', 'Red hat', 'Green socks'])} {rng.random()}",
                "price": round(rng.random() * 100, 2),
                "quantity": rng.randrange(10),
            }
        )
    order = {"order": {"id": rng.randrange(10**9), "line_items": items}}
    return json.dumps(order).encode()[:size]


def backend_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=65536)
    parser.add_argument("--rows", type=int, default=300)
    args = parser.parse_args(argv)
    rng = random.Random(1)
    bodies = [body(args.bytes, rng) for _ in range(args.rows)]
    base = ob.database_url()
    ob.ensure_database(base, "webhooks_bench")
    with psycopg.connect(
        ob.with_db(base, "webhooks_bench", "bench-toast"), autocommit=True
    ) as conn:
        pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        for method in ("pglz", "lz4"):
            conn.execute("DROP TABLE IF EXISTS bench_toast")
            conn.execute(f"CREATE TABLE bench_toast (id serial, body bytea COMPRESSION {method})")
            cpu0, wall0 = backend_cpu(pid), time.perf_counter()
            for b in bodies:
                conn.execute("INSERT INTO bench_toast (body) VALUES (%s)", [b])
            cpu1, wall1 = backend_cpu(pid), time.perf_counter()
            for _ in range(3):
                conn.execute("SELECT body FROM bench_toast", binary=True).fetchall()
            cpu2 = backend_cpu(pid)
            size = conn.execute("SELECT pg_total_relation_size('bench_toast')").fetchone()[0]
            print(
                f"{method}: insert {(cpu1 - cpu0) / args.rows * 1000:.2f} ms CPU per row "
                f"({(wall1 - wall0) / args.rows * 1000:.2f} ms wall), read "
                f"{(cpu2 - cpu1) / (3 * args.rows) * 1000:.3f} ms CPU per row, "
                f"{size / args.rows / 1024:.1f} KiB per row stored",
                flush=True,
            )
        conn.execute("DROP TABLE bench_toast")
    return 0


if __name__ == "__main__":
    sys.exit(main())
