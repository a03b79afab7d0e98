"""bench/outbound.py --tenants/--endpoints: the N events are dealt round-robin over every
tenant's endpoints, one delivery each, so a wide run measures the same N deliveries."""

import pytest
from django.db.models import Count, F

from bench import outbound
from deliveries.models import Delivery, Endpoint, Event, Tenant

pytestmark = pytest.mark.django_db


def test_a_wide_layout_deals_one_delivery_per_event_over_every_endpoint():
    outbound.publish(12, "http://127.0.0.1:9/hook", outbound.Layout(tenants=2, endpoints=3))

    assert Tenant.objects.count() == 2
    assert Endpoint.objects.values("tenant").annotate(n=Count("id")).filter(n=3).count() == 2
    assert Event.objects.count() == Delivery.objects.count() == 12
    per_endpoint = Delivery.objects.values("endpoint").annotate(n=Count("id"))
    assert sorted(r["n"] for r in per_endpoint) == [2] * 6
    # Each delivery belongs to its endpoint's tenant.
    assert not Delivery.objects.exclude(tenant=F("endpoint__tenant")).exists()


def test_the_default_layout_is_one_endpoint_taking_every_event_type():
    outbound.publish(3, "http://127.0.0.1:9/hook")

    endpoint = Endpoint.objects.get()
    assert endpoint.event_types == []
    assert Delivery.objects.filter(endpoint=endpoint).count() == 3


def test_a_layout_needs_a_tenant_and_an_endpoint():
    with pytest.raises(ValueError):
        outbound.Layout(tenants=0)
    with pytest.raises(ValueError):
        outbound.Layout(endpoints=0)


def _delivery_writes() -> tuple[int, int]:
    """Rows inserted into and updated in the delivery table by this transaction so far."""
    return outbound.sql(
        "SELECT n_tup_ins, n_tup_upd FROM pg_stat_xact_user_tables"
        " WHERE relname = 'deliveries_delivery'"
    )[0]


def test_the_drain_starts_from_the_published_rows_each_written_once():
    # Publishing inserts each delivery row once; the drain must start from that, not
    # from rows parked and made due by UPDATEs (three versions of each, and three
    # entries in every index, which cost the drain about a fifth of its rate).
    outbound.publish(5, "http://127.0.0.1:9/hook")
    outbound.snapshot_save()
    published = list(Delivery.objects.order_by("id").values("id", "state", "next_attempt_at"))
    # The bench commits each step; in the test's one transaction the deferred foreign-key
    # checks of the publish must run before a TRUNCATE.
    outbound.sql("SET CONSTRAINTS ALL IMMEDIATE")

    outbound.take_out_published()
    assert not Delivery.objects.exists()
    inserted, updated = _delivery_writes()

    outbound.release_published()

    assert list(Delivery.objects.order_by("id").values("id", "state", "next_attempt_at")) == (
        published
    )
    assert _delivery_writes() == (inserted + 5, updated)
