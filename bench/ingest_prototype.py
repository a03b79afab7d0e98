"""Prototypes of the receive view's proposed changes, for ``bench/ingest.py``: evidence,
not product code.

The prototype view answers exactly like ``ingest.views.receive`` (same checks, same
statuses, same log line, same rows) with two changes:

1. **The source and its secrets are cached per process** for ``SOURCE_CACHE_SECONDS``
   (today: two queries per request, ``services.source_for`` and
   ``services._live_secrets``). Secrets are cached with their ``expires_at`` and
   filtered at use, so an expiring secret still stops on time; a disabled source or a
   new secret takes effect within the TTL.
2. **The event and its outbox row are written by one statement** in autocommit
   (``WITH ev AS (INSERT ... ON CONFLICT (source_id, event_id) DO NOTHING RETURNING id)
   INSERT INTO deliveries_outbox ... FROM ev``): atomic as one statement, and no ORM
   instance, no savepoint, no ``SELECT dispatch_count`` of the row just written (a new
   event's dispatch is 1), no BEGIN/COMMIT round trips. A duplicate returns no row and
   is counted by an ``UPDATE``, as today.

Two uses:

* ``gunicorn -c project/gunicorn.conf.py bench.ingest_prototype:application`` serves the
  prototype at ``POST /ingest/<slug>/`` (``bench/ingest.py --servers
  trivial,ingest,prototype``);
* ``python bench/ingest_prototype.py`` calls, in one process and through Django's whole
  WSGI handler and middleware (no HTTP), the trivial view, today's view and each
  prototype step in turn, and prints the CPU per request of the process and of its
  PostgreSQL backend, and the queries per request: which change saves what.
"""

import os
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
    sys.path[0] = str(ROOT)  # run as a script: bench/ingest.py would shadow ``ingest``

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

import django  # noqa: E402 - after the sys.path fix above

django.setup()

from django.conf import settings  # noqa: E402
from django.core.wsgi import get_wsgi_application  # noqa: E402
from django.db import connection  # noqa: E402
from django.http import JsonResponse  # noqa: E402
from django.urls import path  # noqa: E402
from django.utils import timezone  # noqa: E402
from django.views.decorators.csrf import csrf_exempt  # noqa: E402

from deliveries.state import message_key  # noqa: E402
from ingest import services, views  # noqa: E402
from ingest.models import InboundState, SourceSecret  # noqa: E402
from ingest.schemes import Request, UnparseableBody, VerificationFailed, get_scheme  # noqa: E402

SOURCE_CACHE_SECONDS = 5.0
_sources: dict[str, tuple[float, object, list]] = {}


def cached_source(slug: str):
    """(source or None, [(secret, expires_at)]) from a per-process cache."""
    now = time.monotonic()
    hit = _sources.get(slug)
    if hit is not None and hit[0] > now:
        return hit[1], hit[2]
    source = services.source_for(slug)
    secrets = []
    if source is not None:
        secrets = list(
            SourceSecret.objects.filter(source=source)
            .order_by("-created_at")
            .values_list("secret", "expires_at")
        )
    _sources[slug] = (now + SOURCE_CACHE_SECONDS, source, secrets)
    return source, secrets


_INSERT = """
WITH ev AS (
    INSERT INTO ingest_inboundevent (
        id, source_id, event_id, event_type, entity_id, occurred_at, body, headers, state,
        received_at, duplicates, next_attempt_at, attempt_count, dispatch_count,
        enqueued_at, last_error
    )
    VALUES (%s, %s, %s, %s, %s, %s, %s, %s::jsonb, %s, %s, 0, %s, 0, 1, %s, '')
    ON CONFLICT (source_id, event_id) DO NOTHING
    RETURNING id
)
INSERT INTO deliveries_outbox (message_key, kind, ref_id, dispatch, priority, created_at)
SELECT %s, %s, ev.id, 1, 0, %s FROM ev
RETURNING ref_id
"""
_DUPLICATE = """
UPDATE ingest_inboundevent SET duplicates = duplicates + 1, last_duplicate_at = %s
WHERE source_id = %s AND event_id = %s
RETURNING id
"""


def insert_one_statement(source, meta, request: Request, now) -> tuple[uuid.UUID, bool]:
    """The event and its outbox row in one autocommit statement; (id, duplicate)."""
    import json

    new_id = uuid.uuid4()
    headers = json.dumps(services._stored_headers(request.headers))
    with connection.cursor() as cursor:
        cursor.execute(
            _INSERT,
            [
                new_id,
                source.id,
                meta.event_id,
                meta.event_type[:200],
                meta.entity_id[:300],
                meta.occurred_at,
                request.body,
                headers,
                InboundState.ENQUEUED,
                now,
                now,
                now,
                message_key(new_id, 1, services.KIND),
                services.KIND,
                now,
            ],
        )
        if cursor.fetchone() is not None:
            return new_id, False
        cursor.execute(_DUPLICATE, [now, source.id, meta.event_id])
        row = cursor.fetchone()
    return (row[0] if row else None), True


def receive_prototype(source, secrets, request: Request, remote: str, *, one_statement: bool):
    """``services.inbound_receive`` with cached secrets and, optionally, one statement."""
    now = timezone.now()
    scheme = get_scheme(source.scheme, source.options or None)
    live = [s for s, expires in secrets if expires is None or expires > now]
    try:
        scheme.verify(request, secrets=live, now=time.time(), tolerance=source.replay_tolerance)
    except VerificationFailed as exc:
        services.count_refusal(source, exc.reason, remote=remote)
        return services.Received(401)
    try:
        meta = scheme.extract(request, scheme.parse(request))
    except UnparseableBody:
        # Rare: today's path (it verifies again) stores the rejected body.
        return services.inbound_receive(source=source, request=request, remote=remote)
    if one_statement:
        event, duplicate = insert_one_statement(source, meta, request, now)
    else:
        event, duplicate = services._insert(
            source,
            event_id=meta.event_id,
            event_type=meta.event_type,
            entity_id=meta.entity_id,
            occurred_at=meta.occurred_at,
            request=request,
            now=now,
            state=InboundState.ENQUEUED,
        )
    services.logger.info(
        "inbound received",
        extra={
            "action": "ingest.received",
            "source": source.slug,
            "event_id": meta.event_id,
            "inbound_id": str(event),
            "duplicate": duplicate,
        },
    )
    return services.Received(200, event, duplicate)


@csrf_exempt
def receive(request, slug: str, one_statement: bool = True):
    """``ingest.views.receive`` with the prototype's service call."""
    if request.method != "POST":
        response = views._error(405, "method_not_allowed", "Use POST.")
        response["Allow"] = "POST"
        return response
    source, secrets = cached_source(slug)
    if source is None:
        return views._error(404, "not_found", "No such source.")
    wait = services.source_throttle(source)
    if wait:
        return views._error(429, "throttled", "Too many requests.", {"Retry-After": str(wait)})
    if request.content_type.lower() not in source.accepted_content_types:
        services.count_refusal(source, "content_type", request)
        return views._error(415, "unsupported_media_type", "Unsupported content type.")
    body = views._read_limited(request, source.max_body_bytes)
    if body is None:
        services.count_refusal(source, "too_large", request)
        return views._error(413, "too_large", "The body is too large.")
    inbound = Request(headers={k.lower(): v for k, v in request.headers.items()}, body=body)
    outcome = receive_prototype(
        source, secrets, inbound, views._remote(request), one_statement=one_statement
    )
    if outcome.status == 401:
        return views._error(401, "unauthorized", "Signature verification failed.")
    if outcome.status == 400:
        return views._error(400, "unparseable", "The body could not be parsed.")
    return JsonResponse(
        {"status": "duplicate" if outcome.duplicate else "accepted", "id": str(outcome.event_id)}
    )


@csrf_exempt
def trivial(request, slug: str):
    request.read()
    return JsonResponse({"ok": True})


urlpatterns = [
    path("ingest/<slug:slug>/", receive),
    path("variant/trivial/<slug:slug>/", trivial),
    path("variant/today/<slug:slug>/", views.receive),
    path("variant/cached/<slug:slug>/", receive, {"one_statement": False}),
    path("variant/cached-one-statement/<slug:slug>/", receive),
]
settings.ROOT_URLCONF = __name__
application = get_wsgi_application()


# --- In-process comparison -----------------------------------------------------------


def _environ(path_: str, body: bytes, headers: dict) -> dict:
    import io

    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": path_,
        "SCRIPT_NAME": "",
        "QUERY_STRING": "",
        "SERVER_NAME": "127.0.0.1",
        "SERVER_PORT": "80",
        "HTTP_HOST": "127.0.0.1",
        "REMOTE_ADDR": "127.0.0.1",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "CONTENT_TYPE": headers["content-type"],
        "CONTENT_LENGTH": str(len(body)),
        "wsgi.input": io.BytesIO(body),
        "wsgi.url_scheme": "http",
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": False,
        "wsgi.multiprocess": True,
        "wsgi.run_once": False,
        "wsgi.version": (1, 0),
    }
    for name, value in headers.items():
        if name != "content-type":
            environ["HTTP_" + name.upper().replace("-", "_")] = value
    return environ


def compare(requests: int, rounds: int, health_checks: bool) -> dict:
    """CPU per request of each variant, alternated ``rounds`` times (the median kept),
    with the PostgreSQL backend's CPU and the number of queries."""
    import statistics

    from django.test.utils import CaptureQueriesContext

    from bench.ingest_load import signed_requests

    def backend_cpu() -> float:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            pid = cursor.fetchone()[0]
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def call(path_: str, body: bytes, headers: dict) -> bytes:
        answer: list = []
        out = application(_environ(path_, body, headers), lambda s, h, e=None: answer.append(s))
        data = b"".join(out)
        out.close()
        if not answer[0].startswith("200"):
            raise RuntimeError(f"{path_}: {answer[0]} {data[:200]!r}")
        return data

    # (name, URL variant, CONN_HEALTH_CHECKS): the last row turns off the per-request
    # "SELECT 1" Django sends before reusing a persistent connection.
    variants = [
        ("trivial", "trivial", health_checks),
        ("today", "today", health_checks),
        ("cached", "cached", health_checks),
        ("cached-one-statement", "cached-one-statement", health_checks),
        ("cached-one-statement-no-health-check", "cached-one-statement", False),
    ]
    first = int(time.time() * 1000) * 1000  # fresh event ids on every invocation
    cpu: dict = {v: [] for v, _, _ in variants}
    backend: dict = {v: [] for v, _, _ in variants}
    queries: dict = {}
    for _ in range(rounds):
        for variant, route, checks in variants:
            batch = signed_requests(first, requests + 2, "whsec_bench")
            first += requests + 2
            url = f"/variant/{route}/stripe/"
            connection.health_check_enabled = checks
            call(url, *batch[0])  # warm: the source cache, the connection
            with CaptureQueriesContext(connection) as captured:
                call(url, *batch[1])
            queries[variant] = [q["sql"][:60] for q in captured.captured_queries]
            b0, c0 = backend_cpu(), time.process_time()
            for body, headers in batch[2:]:
                call(url, body, headers)
            cpu[variant].append((time.process_time() - c0) / requests * 1e6)
            backend[variant].append((backend_cpu() - b0) / requests * 1e6)
    return {
        v: {
            "process_us_per_request": round(statistics.median(cpu[v])),
            "postgres_us_per_request": round(statistics.median(backend[v])),
            "queries_per_request": len(queries[v]),
            "queries": queries[v],
        }
        for v, _, _ in variants
    }


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import logging

    parser = argparse.ArgumentParser(description="in-process CPU per request of each variant")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--no-health-checks", action="store_true", help="CONN_HEALTH_CHECKS off in every row"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    # The product's INFO log line per request stays on (it is part of the cost), but goes
    # nowhere.
    for handler in logging.getLogger().handlers:
        handler.setStream(open(os.devnull, "w"))  # noqa: SIM115 - lives as long as we do
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM ingest_source WHERE slug = 'stripe'")
        if cursor.fetchone()[0] != 1:
            raise SystemExit("run bench/ingest.py first: it creates the stripe source")
    result = compare(args.requests, args.rounds, not args.no_health_checks)
    base = (
        result["trivial"]["process_us_per_request"] + result["trivial"]["postgres_us_per_request"]
    )
    # Queries as Django counts them: the health check's "SELECT 1" is not among them.
    print("| variant | process CPU us/req | PostgreSQL CPU us/req | total / trivial | queries |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, r in result.items():
        total = r["process_us_per_request"] + r["postgres_us_per_request"]
        print(
            f"| {name} | {r['process_us_per_request']:,} | {r['postgres_us_per_request']:,} "
            f"| {total / base:.1f} | {r['queries_per_request']} |"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
