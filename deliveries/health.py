"""Health endpoints for load balancers: ``/healthz`` (the process answers) and
``/readyz`` (the database answers, migrations are applied, the broker answers)."""

from django.db import DatabaseError, connection
from django.db.migrations.executor import MigrationExecutor
from django.http import JsonResponse

from deliveries.jobs import brokers


def healthz(request):
    return JsonResponse({"status": "ok"})


def readyz(request):
    checks = {}
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        checks["database"] = "ok"
        executor = MigrationExecutor(connection)
        pending = executor.migration_plan(executor.loader.graph.leaf_nodes())
        checks["migrations"] = "ok" if not pending else f"{len(pending)} unapplied"
    except DatabaseError:
        checks["database"] = "unavailable"
    try:
        checks["broker"] = "ok" if brokers.get_broker().ping() else "unavailable"
    except Exception:
        checks["broker"] = "unavailable"
    ready = all(v == "ok" for v in checks.values())
    return JsonResponse(
        {"status": "ok" if ready else "unavailable", "checks": checks}, status=200 if ready else 503
    )
