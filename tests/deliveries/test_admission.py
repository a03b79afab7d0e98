"""Admission control: ceilings, fairness across tenants, priorities, rate buckets."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from deliveries import admission, services
from deliveries.models import Delivery, EndpointThrottle, Tenant

pytestmark = [pytest.mark.django_db, pytest.mark.sqlite]


def limits(total=1000, tenant=1000, endpoint=1000):
    return admission.Limits(
        max_in_flight=total, tenant_max_in_flight=tenant, endpoint_max_concurrency=endpoint
    )


def admit(page=100, **kw):
    return admission.admit_due(now=timezone.now(), page_size=page, limits=limits(**kw))


def fill(tenant, n, *, url="http://127.0.0.1:9/x", **endpoint_options):
    endpoint, _ = services.endpoint_create(tenant=tenant, url=url, **endpoint_options)
    for i in range(n):
        services.publish_event(tenant=tenant, event_type="t", payload={"i": i})
    return endpoint


def test_a_noisy_tenant_cannot_starve_a_quiet_one():
    noisy = Tenant.objects.create(name="noisy")
    quiet = Tenant.objects.create(name="quiet")
    fill(noisy, 300)
    fill(quiet, 1)

    # The noisy tenant's older backlog fills its own share; the pass's next scan skips
    # it and reaches the quiet tenant's row in the same pass.
    first = admit(page=50, tenant=20)
    second = admit(page=50, tenant=20)

    assert first.admitted == 21
    assert second.admitted == 0
    quiet_delivery = Delivery.objects.get(tenant=quiet)
    assert quiet_delivery.state == "enqueued"
    assert Delivery.objects.filter(tenant=noisy, state="enqueued").count() == 20


def test_tenants_in_the_scanned_rows_share_a_page_round_robin():
    a = Tenant.objects.create(name="a")
    b = Tenant.objects.create(name="b")
    fill(a, 15)
    fill(b, 15)
    # The scan reads twice the page (20 rows: 15 of a, then 5 of b); in age order a
    # would take the whole page, round-robin splits it.
    admit(page=10)
    counts = {t.name: Delivery.objects.filter(tenant=t, state="enqueued").count() for t in (a, b)}
    assert counts == {"a": 5, "b": 5}


def test_priority_goes_first():
    t = Tenant.objects.create(name="t")
    fill(t, 30)
    urgent = services.publish_event(tenant=t, event_type="password.reset", payload={}, priority=10)
    admit(page=1)
    assert Delivery.objects.get(event=urgent).state == "enqueued"


def test_global_and_endpoint_ceilings_count_rows_in_flight():
    t = Tenant.objects.create(name="t")
    capped = fill(t, 10, url="http://127.0.0.1:9/capped", max_concurrency=3)
    assert admit().admitted == 3
    assert admit().admitted == 0  # still three in flight
    Delivery.objects.filter(endpoint=capped, state="enqueued").update(state="succeeded")
    assert admit().admitted == 3

    assert admit(total=4).admitted == 0  # 3 in flight + the ceiling of 4 leaves 1...
    # ...but the endpoint's own ceiling (3) is already reached, so nothing moves.


def test_start_rate_bucket_limits_admissions_per_second():
    t = Tenant.objects.create(name="t")
    fill(t, 20, rate_limit=5)
    now = timezone.now()
    lim = limits()
    assert admission.admit_due(now=now, page_size=100, limits=lim).admitted == 5
    assert admission.admit_due(now=now, page_size=100, limits=lim).admitted == 0
    later = now + timezone.timedelta(seconds=1)
    assert admission.admit_due(now=later, page_size=100, limits=lim).admitted == 5


def queries_of_one_pass(endpoints: int) -> int:
    t = Tenant.objects.create(name=f"t{endpoints}")
    for i in range(endpoints):
        services.endpoint_create(tenant=t, url=f"http://127.0.0.1:9/{i}", rate_limit=100)
    for i in range(2):  # each to every endpoint
        services.publish_event(tenant=t, event_type="t", payload={"i": i})
    with CaptureQueriesContext(connection) as queries:
        assert admit(page=1000).admitted == 2 * endpoints
    Delivery.objects.update(state="succeeded")  # out of the next pass's way
    return len(queries)


def test_rate_buckets_cost_a_pass_the_same_queries_for_many_endpoints_as_for_few():
    # Loading and saving the buckets are one statement each, however many endpoints
    # are limited (one upsert per endpoint made the scheduler the bottleneck).
    assert queries_of_one_pass(3) == queries_of_one_pass(30)
    assert EndpointThrottle.objects.count() == 33


def test_a_bucket_nothing_was_taken_from_is_not_written():
    t = Tenant.objects.create(name="t")
    for i in range(2):
        services.endpoint_create(tenant=t, url=f"http://127.0.0.1:9/{i}", rate_limit=5)
    services.publish_event(tenant=t, event_type="t", payload={})  # one delivery to each

    # A page of one: the pass reads both rows, so both buckets, and admits one of them.
    assert admit(page=1).admitted == 1

    taken = Delivery.objects.get(state="enqueued").endpoint_id
    assert list(EndpointThrottle.objects.values_list("endpoint_id", "tokens")) == [(taken, 4.0)]


def test_not_yet_due_deliveries_wait():
    t = Tenant.objects.create(name="t")
    services.endpoint_create(tenant=t, url="http://127.0.0.1:9/x")
    services.publish_event(
        tenant=t,
        event_type="t",
        payload={},
        deliver_at=timezone.now() + timezone.timedelta(hours=1),
    )
    assert admit().admitted == 0
    assert Delivery.objects.get().state == "pending"


def test_rows_an_endpoint_at_its_ceiling_cannot_take_are_read_once_per_pass():
    t = Tenant.objects.create(name="t")
    fill(t, 600, max_concurrency=10)

    first = admit(page=1000)
    assert first.admitted == 10
    # One chunk was read: the endpoint filled up in it and left the next scan.
    assert first.held_back == admission.ADMISSION_CHUNK - 10
    # While it stays full, a pass reads none of its rows.
    assert admit(page=1000).held_back == 0


def _reference_scan(now, tenants, endpoints, limit):
    """The admission scan's meaning, as one ORM query (the SQLite path's)."""
    rows = (
        Delivery.objects.filter(state="pending", next_attempt_at__lte=now)
        .exclude(tenant_id__in=tenants)
        .exclude(endpoint_id__in=endpoints)
        .order_by("-priority", "next_attempt_at")
        .values_list("id", "tenant_id", "endpoint_id", "priority")[:limit]
    )
    return [(str(i), str(t), str(e), p) for i, t, e, p in rows]


@pytest.mark.parametrize("by_endpoint_max", [500, 2])
def test_the_scan_by_window_by_endpoint_or_past_the_rows_gives_the_one_answer(
    by_endpoint_max, monkeypatch
):
    """On PostgreSQL a scan that leaves tenants or endpoints out reads a window of the
    due rows, then, if that window was all rows left out, reads by endpoint, or, with
    more endpoints waiting than SCAN_BY_ENDPOINT_MAX, past the rows left out. Whichever
    way, the rows are the reference query's, in its order."""
    monkeypatch.setattr(admission, "SCAN_BY_ENDPOINT_MAX", by_endpoint_max)
    import random
    from datetime import timedelta

    rng = random.Random(7)
    now = timezone.now()
    tenants = [Tenant.objects.create(name=f"t{i}") for i in range(3)]
    endpoints = []
    for i, tenant in enumerate(tenants * 2):  # two endpoints per tenant
        endpoint, _ = services.endpoint_create(tenant=tenant, url=f"http://127.0.0.1:9/{i}")
        endpoints.append(endpoint)
    # One hot endpoint with most of the backlog, the others a few rows each; some
    # priorities, some rows not yet due.
    for n, endpoint in zip([300, 5, 3, 8, 1, 0], endpoints, strict=True):
        for _ in range(n):
            services.publish_event(
                tenant=endpoint.tenant,
                event_type="t",
                payload={},
                endpoint_ids=[endpoint.id],
                priority=rng.choice([0, 0, 0, 5]),
            )
    for k, d in enumerate(Delivery.objects.all()):  # distinct times: one right order
        d.next_attempt_at = now + timedelta(seconds=rng.randint(-3600, 60), microseconds=k)
        d.save(update_fields=["next_attempt_at"])

    hot, hot_tenant = str(endpoints[0].id), str(tenants[0].id)
    cases = [
        ([], [], 10),
        ([], [hot], 4),  # the window is all the hot endpoint's: read by endpoint
        ([], [hot], 20),
        ([hot_tenant], [], 6),
        ([hot_tenant], [str(endpoints[2].id)], 50),
        ([str(t.id) for t in tenants], [], 10),  # nothing left
        ([], [str(e.id) for e in endpoints[1:]], 10),
    ]
    for left_out_tenants, left_out_endpoints, limit in cases:
        got = admission._scan_due(now, left_out_tenants, left_out_endpoints, limit)
        want = _reference_scan(now, left_out_tenants, left_out_endpoints, limit)
        assert got == want, (left_out_tenants, left_out_endpoints, limit)


def test_the_global_ceiling_binds_when_no_tenant_or_endpoint_ceiling_is_near():
    a = Tenant.objects.create(name="a")
    b = Tenant.objects.create(name="b")
    fill(a, 10, url="http://127.0.0.1:9/a")
    fill(b, 10, url="http://127.0.0.1:9/b")
    # No tenant or endpoint ceiling is near: only the global one can stop admission.
    assert admit(total=4).admitted == 4
    assert admit(total=4).admitted == 0
    assert admit(total=7).admitted == 3  # 4 in flight, room for 3 more in all
    in_flight = Delivery.objects.filter(state="enqueued")
    assert in_flight.count() == 7
    Delivery.objects.filter(id=in_flight.first().id).update(state="succeeded")
    assert admit(total=7).admitted == 1


def test_a_pass_that_takes_the_last_global_slot_says_the_ceiling_is_filled():
    """``filled``: the next pass can admit only what the workers free meanwhile (the
    scheduler then paces itself, deliveries.scheduler.refill_pause). A pass stopped by
    its page, by an endpoint's ceiling or by running out of due rows has not filled it."""
    t = Tenant.objects.create(name="t")
    fill(t, 10, url="http://127.0.0.1:9/a")

    by_page = admit(page=2, total=100)
    assert (by_page.admitted, by_page.filled, by_page.in_flight) == (2, False, 0)
    by_ceiling = admit(page=100, total=5)  # room for 3 more in all
    assert (by_ceiling.admitted, by_ceiling.filled, by_ceiling.in_flight) == (3, True, 2)
    saturated = admit(page=100, total=5)
    assert (saturated.admitted, saturated.saturated, saturated.filled) == (0, True, True)
    assert saturated.in_flight == 5
    # The same room as the page: the ceiling is what stopped it.
    assert admit(page=2, total=7).filled

    Delivery.objects.filter(state="enqueued").update(state="succeeded")
    other = Tenant.objects.create(name="other")
    fill(other, 3, url="http://127.0.0.1:9/capped", max_concurrency=1)
    # The three rows of t left, and one of the capped endpoint's three.
    by_endpoint = admit(page=100, total=100)
    assert (by_endpoint.admitted, by_endpoint.held_back, by_endpoint.filled) == (4, 2, False)
