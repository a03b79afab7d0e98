"""Data steps of migrations, run on rows the current models write."""

import importlib
from datetime import timedelta

import pytest
from django.apps import apps
from django.db import connection
from django.utils import timezone

from deliveries import services
from deliveries.models import Attempt, Delivery, Tenant

pytestmark = pytest.mark.django_db

attempt_endpoint = importlib.import_module("deliveries.migrations.0012_attempt_endpoint")


def test_0012_fills_in_the_endpoint_of_the_last_24_hours_of_attempts(monkeypatch):
    monkeypatch.setattr(attempt_endpoint, "BATCH", 2)  # several batches
    tenant = Tenant.objects.create(name="acme")
    a, _ = services.endpoint_create(tenant=tenant, url="https://a.example/hook")
    b, _ = services.endpoint_create(tenant=tenant, url="https://b.example/hook")
    services.publish_event(tenant=tenant, event_type="x.y", payload={})
    now = timezone.now()
    for delivery in Delivery.objects.all():
        for number, age in enumerate([1, 5, 23, 25], start=1):
            Attempt.objects.create(
                delivery=delivery,
                number=number,
                started_at=now - timedelta(hours=age),
                duration_ms=1,
                outcome="retry",
            )

    with connection.schema_editor(atomic=False) as editor:
        attempt_endpoint.fill_recent(apps, editor)

    filled = {
        (e, n)
        for e, n in Attempt.objects.filter(endpoint__isnull=False).values_list(
            "endpoint_id", "number"
        )
    }
    assert filled == {(a.id, 1), (a.id, 2), (a.id, 3), (b.id, 1), (b.id, 2), (b.id, 3)}
    assert Attempt.objects.filter(endpoint__isnull=True).count() == 2  # the 25-hour-old
    for attempt in Attempt.objects.filter(endpoint__isnull=False).select_related("delivery"):
        assert attempt.endpoint_id == attempt.delivery.endpoint_id
