"""CPU per request of the receive view and of the trivial view, in one process.

``bench/ingest.py`` measures requests per second under gunicorn, which moves with
whatever else the machine runs. This pushes the signed Stripe requests that
``bench/ingest_load.py`` sends straight through the WSGI application gunicorn serves
(same settings, same middleware; called, read and closed as gunicorn does), one at a
time, and reports per request the process's CPU, its PostgreSQL backend's CPU and the
statements sent (counted at psycopg, so the ORM's and the raw ones alike):

    python bench/ingest_cpu.py --server ingest --runs 3
    python bench/ingest_cpu.py --server trivial --runs 3

One server per process (the trivial view replaces the URLconf). The receive view runs on
its own database beside the one ``DATABASE_URL`` names (``--db-name``, migrated here),
with the ``stripe`` source made afresh and the ingest tables emptied before every run;
every answer must be ``"accepted"`` and every event stored, or the run fails.
``--profile FILE`` writes a cProfile (CPU time) of one more run. ``--async-commit`` is a
diagnostic only: the backend's connection stops waiting for the WAL flush, to show what
the durable commit costs; the product never runs so.

The figures are the CPU of one request at a time: they leave out gunicorn, the network
and the load generator, which cost the two views the same, and a request waiting on the
database runs with cold caches afterwards, which only the receive view pays.
"""

import argparse
import io
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Run as a script, bench/ is sys.path[0], and bench/ingest.py would shadow the project's
# ``ingest`` package.
if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
    sys.path[0] = str(ROOT)

from bench.outbound import (  # noqa: E402
    INBOUND_TABLES,
    database_url,
    ensure_database,
    proc_cpu_seconds,
    with_db,
)

SLUG = "stripe"
SECRET = "whsec_bench"
COUNTED_REQUESTS = 200


def application_for(server: str):
    if server == "trivial":
        from bench.ingest_trivial import application
    else:
        from project.wsgi import application
    return application


def prepare_database() -> None:
    """Migrated, the ingest tables empty, one ``stripe`` source with our secret."""
    from django.core.management import call_command
    from django.db import connection

    from ingest.models import Source
    from ingest.sources import source_create

    call_command("migrate", verbosity=0, interactive=False)
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {', '.join(INBOUND_TABLES)} CASCADE")
    Source.objects.filter(slug=SLUG).delete()
    source_create(slug=SLUG, scheme="stripe", secrets=[SECRET])


def environs(first: int, n: int) -> list[dict]:
    """WSGI environs as gunicorn builds them for ``bench/ingest_load.py``'s requests."""
    from bench.ingest_load import signed_requests

    out = []
    for body, headers in signed_requests(first, n, SECRET):
        environ = {
            "REQUEST_METHOD": "POST",
            "SCRIPT_NAME": "",
            "PATH_INFO": f"/ingest/{SLUG}/",
            "RAW_URI": f"/ingest/{SLUG}/",
            "QUERY_STRING": "",
            "SERVER_NAME": "127.0.0.1",
            "SERVER_PORT": "8000",
            "SERVER_PROTOCOL": "HTTP/1.1",
            "REMOTE_ADDR": "127.0.0.1",
            "REMOTE_PORT": "40000",
            "CONTENT_TYPE": "application/json",
            "CONTENT_LENGTH": str(len(body)),
            "HTTP_HOST": "127.0.0.1:8000",
            "HTTP_ACCEPT": "*/*",
            "HTTP_ACCEPT_ENCODING": "gzip, deflate",
            "HTTP_USER_AGENT": "Python/3 aiohttp/3",
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": "http",
            "wsgi.input": io.BytesIO(body),
            "wsgi.input_terminated": True,
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": True,
            "wsgi.multiprocess": True,
            "wsgi.run_once": False,
        }
        for name, value in headers.items():
            if name.lower() != "content-type":
                environ["HTTP_" + name.upper().replace("-", "_")] = value
        out.append(environ)
    return out


def serve(application, batch: list[dict]) -> list[tuple[str, bytes]]:
    """Each environ through the application as gunicorn does: call, read, close."""
    statuses: list[str] = []

    def start_response(status, headers, exc_info=None):
        statuses.append(status)

    answers = []
    for environ in batch:
        result = application(environ, start_response)
        body = b"".join(result)
        result.close()
        answers.append((statuses[-1], body))
    return answers


def count_statements():
    """Count every statement psycopg sends (the ORM's cursors and ``bound_cursor``)
    until the returned function is called; it returns the count."""
    import psycopg

    counted = [0]
    execute = psycopg.Cursor.execute

    def counting(self, *args, **kwargs):
        counted[0] += 1
        return execute(self, *args, **kwargs)

    psycopg.Cursor.execute = counting

    def stop() -> int:
        psycopg.Cursor.execute = execute
        return counted[0]

    return stop


def check(server: str, answers: list[tuple[str, bytes]], stored: int) -> None:
    wanted = b'"accepted"' if server == "ingest" else b'"ok": true'
    bad = [a for a in answers if not a[0].startswith("200") or wanted not in a[1]]
    if bad:
        raise SystemExit(f"{len(bad)} answers not accepted, e.g. {bad[0]!r}")
    if server == "ingest":
        from ingest.models import InboundEvent

        if InboundEvent.objects.count() != stored:
            raise SystemExit("the stored events differ from the accepted answers")


def backend_pid() -> int | None:
    from django.db import connection

    return connection.connection.info.backend_pid if connection.connection else None


def one_run(args, application, next_id: int, *, profile: str | None = None) -> dict | None:
    if args.server == "ingest":
        prepare_database()
    serve(application, environs(next_id, args.warmup))
    timed = environs(next_id + args.warmup, args.requests)
    pid = backend_pid()
    if profile:
        import cProfile

        profiler = cProfile.Profile(time.process_time)
        profiler.enable()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    pg0 = proc_cpu_seconds(pid) if pid else 0.0
    answers = serve(application, timed)
    cpu1, wall1 = time.process_time(), time.perf_counter()
    pg1 = proc_cpu_seconds(pid) if pid else 0.0
    if profile:
        profiler.disable()
        profiler.dump_stats(profile)
        return None
    check(args.server, answers, args.warmup + args.requests)
    counted = environs(next_id + args.warmup + args.requests, COUNTED_REQUESTS)
    stop = count_statements()
    answers = serve(application, counted)
    statements = stop()
    check(args.server, answers, args.warmup + args.requests + COUNTED_REQUESTS)
    n = args.requests
    return {
        "app_us": (cpu1 - cpu0) / n * 1e6,
        "postgres_us": (pg1 - pg0) / n * 1e6,
        "wall_us": (wall1 - wall0) / n * 1e6,
        "statements": statements / COUNTED_REQUESTS,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=("ingest", "trivial"), default="ingest")
    parser.add_argument("--requests", type=int, default=3000, help="timed, per run")
    parser.add_argument("--warmup", type=int, default=300, help="untimed, before each run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--db-name", default="webhooks_ingest_cpu_bench")
    parser.add_argument("--profile", metavar="FILE", help="cProfile one more run into FILE")
    parser.add_argument("--async-commit", action="store_true", help="diagnostic only")
    args = parser.parse_args()

    base_url = database_url()
    ensure_database(base_url, args.db_name)
    os.environ["DATABASE_URL"] = with_db(base_url, args.db_name)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    os.environ.setdefault("DATABASE_CONN_MAX_AGE", "3600")  # as bench/ingest.py serves
    application = application_for(args.server)
    if args.async_commit:
        from django.db.backends.signals import connection_created

        def no_flush_wait(connection, **kwargs):
            with connection.cursor() as cursor:
                cursor.execute("SET synchronous_commit = off")

        connection_created.connect(no_flush_wait, weak=False)

    next_id = time.time_ns() // 1000  # event ids no earlier invocation used
    step = args.warmup + args.requests + COUNTED_REQUESTS
    rows = []
    for run in range(args.runs):
        row = one_run(args, application, next_id + run * step)
        rows.append(row)
        print(
            f"{args.server} run {run + 1}: app {row['app_us']:.0f} µs/request, "
            f"postgres {row['postgres_us']:.0f} µs/request, wall {row['wall_us']:.0f} "
            f"µs/request, {row['statements']:.2f} statements/request",
            flush=True,
        )
    if args.profile:
        one_run(args, application, next_id + args.runs * step, profile=args.profile)
        print(f"profile of one more run: {args.profile}")
    if rows:
        app = [r["app_us"] for r in rows]
        pg = [r["postgres_us"] for r in rows]
        print(
            f"{args.server}, median of {len(rows)}: app {statistics.median(app):.0f} µs "
            f"({min(app):.0f}-{max(app):.0f}), postgres {statistics.median(pg):.0f} µs "
            f"({min(pg):.0f}-{max(pg):.0f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
