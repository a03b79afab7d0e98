"""The operator console, through Django's test client."""

import pytest
from django.contrib.auth.models import Permission, User
from django.db.models import Count
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from deliveries import services
from deliveries.core.console import CappedCountPaginator
from deliveries.models import AuditEntry, Delivery, Endpoint, EventType, Tenant

pytestmark = pytest.mark.django_db

CHANGELIST = "/admin/deliveries/delivery/"


@pytest.fixture
def data():
    tenant = Tenant.objects.create(name="acme")
    endpoint, _ = services.endpoint_create(tenant=tenant, url="https://example.com/hook")
    events = [
        services.publish_event(tenant=tenant, event_type=t, payload={"n": i}, entity_id=f"e{i}")
        for i, t in enumerate(["invoice.paid", "invoice.paid", "user.created"])
    ]
    Delivery.objects.update(
        state="dead", last_outcome="permanent", last_status_code=400, finished_at=timezone.now()
    )
    return tenant, endpoint, events


def staff(*perms: str) -> Client:
    user = User.objects.create_user(f"u{User.objects.count()}", password="pw", is_staff=True)
    for codename in ("view_delivery", "view_attempt", "view_endpoint", "view_event", *perms):
        user.user_permissions.add(Permission.objects.get(codename=codename))
    client = Client()
    client.force_login(user)
    return client


def test_the_delivery_log_lists_filters_and_searches(data):
    tenant, endpoint, events = data
    client = staff()
    page = client.get(CHANGELIST)
    assert page.status_code == 200
    assert page.content.count(b"state-badge") == 3

    EventType.objects.create(name="invoice.paid")
    filtered = client.get(
        CHANGELIST,
        {
            "event_type": "invoice.paid",
            "state": "dead",
            "tenant": str(tenant.id),
            "endpoint": str(endpoint.id),
        },
    )
    assert filtered.status_code == 200
    assert filtered.content.count(b"state-badge") == 2

    delivery = Delivery.objects.get(event=events[2])
    for term in (str(delivery.id), str(events[2].id), "e2"):
        found = client.get(CHANGELIST, {"q": term})
        assert found.content.count(b"state-badge") == 1, term
    assert client.get(CHANGELIST, {"q": "not-an-id"}).status_code == 200


def test_a_delivery_page_explains_where_it_stands(data):
    _, _, events = data
    delivery = Delivery.objects.get(event=events[0])
    page = staff().get(reverse("admin:deliveries_delivery_change", args=[delivery.id]))
    assert page.status_code == 200
    assert b"Dead since" in page.content
    assert b"attempt timeline" in page.content.lower()


def test_viewing_does_not_allow_replaying(data):
    client = staff()
    ids = [str(d) for d in Delivery.objects.values_list("id", flat=True)]
    # The whole confirmed form, as a replayer would post it: the action is not there.
    r = client.post(
        CHANGELIST,
        {
            "action": "replay_selected",
            "_selected_action": ids,
            "confirm": "yes",
            "unsafe_confirmed": "yes",
        },
    )
    assert Delivery.objects.filter(state="pending").count() == 0
    assert r.status_code in (200, 302)
    assert b"returned to pending" not in r.content
    one = client.post(reverse("admin:deliveries_delivery_replay", args=[ids[0]]))
    assert one.status_code == 302
    assert Delivery.objects.filter(state="pending").count() == 0
    assert AuditEntry.objects.count() == 0


def test_bulk_replay_confirms_and_needs_more_for_types_not_replay_safe(data):
    client = staff("replay_delivery")
    EventType.objects.create(name="invoice.paid", replay_safe=True)
    ids = [str(d) for d in Delivery.objects.values_list("id", flat=True)]
    form = {"action": "replay_selected", "_selected_action": ids}

    confirm = client.post(CHANGELIST, form)
    assert confirm.status_code == 200
    assert b"Replay 3 deliveries?" in confirm.content
    assert b"user.created" in confirm.content and b"unsafe_confirmed" in confirm.content
    assert Delivery.objects.filter(state="pending").count() == 0

    client.post(CHANGELIST, {**form, "confirm": "yes"})
    assert Delivery.objects.filter(state="pending").count() == 0  # extra confirmation missing

    client.post(CHANGELIST, {**form, "confirm": "yes", "unsafe_confirmed": "yes"})
    assert Delivery.objects.filter(state="pending").count() == 3
    entry = AuditEntry.objects.get(action="delivery.replay")
    assert entry.count == 3 and entry.actor.username.startswith("u")


def test_replay_from_the_delivery_page_is_audited(data):
    """The Replay button follows the bulk action's rule: a confirmation page, and an
    extra confirmation for an event type not marked replay-safe, even for one delivery."""
    client = staff("replay_delivery")
    delivery = Delivery.objects.first()
    url = reverse("admin:deliveries_delivery_replay", args=[delivery.id])
    confirm = client.post(url)
    assert confirm.status_code == 200
    assert b"Replay 1 delivery?" in confirm.content and b"unsafe_confirmed" in confirm.content
    client.post(url, {"confirm": "yes"})
    delivery.refresh_from_db()
    assert delivery.state == "dead"  # the extra confirmation is missing
    r = client.post(url, {"confirm": "yes", "unsafe_confirmed": "yes"})
    assert r.status_code == 302
    delivery.refresh_from_db()
    assert delivery.state == "pending"
    assert AuditEntry.objects.filter(action="delivery.replay", count=1).exists()


def test_every_dead_delivery_of_an_endpoint_since_a_time_is_replayed_by_filter(data):
    """From the filtered log, not a selection: the confirmation counts the matches and
    lists their event types, and the replay-safe rule applies as for a selection."""
    from datetime import timedelta

    tenant, endpoint, _ = data
    other, _ = services.endpoint_create(tenant=tenant, url="https://other.example.com/hook")
    services.publish_event(
        tenant=tenant, event_type="invoice.paid", payload={}, endpoint_ids=[other.id]
    )
    Delivery.objects.filter(endpoint=other).update(state="dead", finished_at=timezone.now())
    # One of the endpoint's dead deliveries ended two days ago: outside "the last 24 hours".
    old = Delivery.objects.filter(endpoint=endpoint, event__event_type="invoice.paid").first()
    Delivery.objects.filter(id=old.id).update(finished_at=timezone.now() - timedelta(days=2))
    url = reverse("admin:deliveries_delivery_replay_matching")
    query = f"?state__exact=dead&endpoint={endpoint.id}&ended=24h"
    client = staff("replay_delivery")

    log = client.get(CHANGELIST + query)
    assert f'href="{url}{query.replace("&", "&amp;")}"'.encode() in log.content
    confirm = client.get(url + query)
    assert confirm.status_code == 200
    body = confirm.content.decode()
    assert "Replay 2 deliveries?" in body
    assert "endpoint: <strong>https://example.com/hook</strong>" in body
    assert "ended: <strong>in the last 24 hours</strong>" in body
    assert "By state: 2 dead." in body
    assert "invoice.paid" in body and "user.created" in body and "unsafe_confirmed" in body

    client.post(url + query, {"confirm": "yes", "shown_at": timezone.now().isoformat()})
    assert Delivery.objects.filter(state="pending").count() == 0  # the extra box is missing
    r = client.post(
        url + query,
        {"confirm": "yes", "unsafe_confirmed": "yes", "shown_at": timezone.now().isoformat()},
    )
    assert r.status_code == 302 and r["Location"] == CHANGELIST + query
    replayed = set(Delivery.objects.filter(state="pending").values_list("id", flat=True))
    assert len(replayed) == 2 and old.id not in replayed
    assert Delivery.objects.filter(endpoint=other, state="dead").count() == 1
    entry = AuditEntry.objects.get(action="delivery.replay")
    assert (entry.count, entry.details["via"]) == (2, "admin, by filter")


def test_replay_by_filter_needs_a_filter_the_permission_and_leaves_rows_changed_since(data):
    from datetime import timedelta

    _, endpoint, _ = data
    url = reverse("admin:deliveries_delivery_replay_matching")
    query = f"?endpoint={endpoint.id}"
    form = {"confirm": "yes", "unsafe_confirmed": "yes"}

    viewer = staff()
    assert (
        viewer.post(url + query, {**form, "shown_at": timezone.now().isoformat()}).status_code
        == 302
    )
    assert b"replay-matching" not in viewer.get(CHANGELIST + query).content
    replayer = staff("replay_delivery")
    r = replayer.post(url, {**form, "shown_at": timezone.now().isoformat()}, follow=True)
    assert b"Filter the log first" in r.content
    # Shown before the rows last changed: they are left alone.
    earlier = (timezone.now() - timedelta(minutes=5)).isoformat()
    r = replayer.post(url + query, {**form, "shown_at": earlier}, follow=True)
    assert b"No delivery matches these filters." in r.content
    assert Delivery.objects.filter(state="pending").count() == 0
    assert not AuditEntry.objects.exists()


def test_dead_letters_are_grouped_by_endpoint_and_reason(data):
    page = staff().get(reverse("admin:deliveries_delivery_dead_letters"))
    assert page.status_code == 200
    assert b"https://example.com/hook" in page.content
    assert b">3</a>" in page.content


def test_endpoint_health_and_actions(data):
    _, endpoint, _ = data
    client = staff("change_endpoint")
    page = client.get("/admin/deliveries/endpoint/")
    assert page.status_code == 200
    client.post(
        "/admin/deliveries/endpoint/", {"action": "disable", "_selected_action": [str(endpoint.id)]}
    )
    endpoint.refresh_from_db()
    assert not endpoint.enabled and endpoint.disabled_reason == "disabled by staff"
    assert AuditEntry.objects.filter(action="endpoint.disable").exists()


def test_pausing_and_resuming_from_the_admin_need_their_own_permission(data):
    tenant, endpoint, _ = data
    services.publish_event(tenant=tenant, event_type="invoice.paid", payload={})
    held = Delivery.objects.get(state="pending")
    form = {"_selected_action": [str(endpoint.id)]}

    editor = staff("change_endpoint")  # may edit the endpoint, not hold its traffic
    offered = editor.get("/admin/deliveries/endpoint/").context["action_form"]
    assert "pause" not in [name for name, _ in offered.fields["action"].choices]
    editor.post("/admin/deliveries/endpoint/", {**form, "action": "pause"})
    endpoint.refresh_from_db()
    assert endpoint.paused_at is None

    operator = staff("pause_endpoint")
    page = operator.post("/admin/deliveries/endpoint/", {**form, "action": "pause"}, follow=True)
    assert b"1 endpoints paused" in page.content
    endpoint.refresh_from_db()
    assert endpoint.paused_at is not None and endpoint.paused_reason == "paused by staff"
    entry = AuditEntry.objects.get(action="endpoint.pause")
    assert str(entry.actor.pk) == operator.session["_auth_user_id"]
    assert entry.details["via"] == "admin"

    # The log and the delivery page say the delivery is held.
    log = operator.get(CHANGELIST, {"state": "pending"})
    assert log.content.count(b"state-badge") == 2 and b">held<" in log.content
    page = operator.get(reverse("admin:deliveries_delivery_change", args=[held.id]))
    assert b"Held: its endpoint was paused" in page.content

    operator.post("/admin/deliveries/endpoint/", {**form, "action": "resume"})
    endpoint.refresh_from_db()
    assert endpoint.paused_at is None
    assert AuditEntry.objects.filter(action="endpoint.resume", details__via="admin").exists()


def test_the_endpoint_and_event_type_filters_are_always_there_and_searchable(data, monkeypatch):
    from deliveries.admin import SearchableFilter

    tenant, endpoint, _ = data
    monkeypatch.setattr(SearchableFilter, "SHOWN", 2)
    others = [
        services.endpoint_create(tenant=tenant, url=f"https://hooks{i}.example.org/in")[0]
        for i in range(3)
    ]
    client = staff()

    def filter_choices(page, title):
        spec = next(s for s in page.context["cl"].filter_specs if s.title == title)
        return [c["display"] for c in spec.choices(page.context["cl"])]

    EventType.objects.all().delete()
    page = client.get(CHANGELIST)
    # No event type in the catalogue: the types published are listed all the same.
    assert filter_choices(page, "event type") == ["All", "invoice.paid", "user.created"]
    assert filter_choices(page, "endpoint") == [
        "All",
        "https://example.com/hook",
        "https://hooks0.example.org/in",
    ]
    assert b'name="endpoint_q"' in page.content and b'name="event_type_q"' in page.content

    # A search narrows the list, keeps the page's other filters, and filters no row.
    page = client.get(CHANGELIST, {"endpoint_q": "hooks2", "state": "dead"})
    assert filter_choices(page, "endpoint") == ["All", "https://hooks2.example.org/in"]
    assert page.content.count(b"state-badge") == 3
    assert b'<input type="hidden" name="state" value="dead">' in page.content
    page = client.get(CHANGELIST, {"event_type_q": "USER"})
    assert filter_choices(page, "event type") == ["All", "user.created"]
    page = client.get(CHANGELIST, {"endpoint_q": str(others[1].id)})
    assert filter_choices(page, "endpoint") == ["All", "https://hooks1.example.org/in"]

    # The one chosen is listed even past the first ones, and it filters.
    page = client.get(CHANGELIST, {"endpoint": str(others[2].id)})
    assert "https://hooks2.example.org/in" in filter_choices(page, "endpoint")
    assert page.content.count(b"state-badge") == 0
    assert client.get(CHANGELIST, {"endpoint": str(endpoint.id)}).content.count(b"state-badge") == 3


def test_the_paginator_counts_at_most_the_cap(data, monkeypatch):
    monkeypatch.setattr(CappedCountPaginator, "CAP", 2)
    assert CappedCountPaginator(Delivery.objects.order_by("id"), 50).count == 3  # "2+" shows as 3
    assert (
        CappedCountPaginator(Delivery.objects.filter(state="pending").order_by("id"), 50).count == 0
    )


@pytest.mark.django_db(transaction=True)
def test_endpoint_health_counts_each_endpoints_attempts_of_the_last_24_hours(settings):
    """Real attempts through the worker: each endpoint's health counts its own attempts
    (endpoint_id on the attempt, read by attempt_endpoint_started) and none older than
    24 hours."""
    from datetime import timedelta

    from deliveries.models import Attempt
    from tests.conftest import drain, make_due
    from tests.receiver import Receiver, fail_first

    settings.EGRESS_ALLOW_NETWORKS = ["127.0.0.0/8"]
    settings.DELIVERY_RETRY_SCHEDULE = [1]
    receiver = Receiver().start()
    try:
        receiver.behaviours["/flaky"] = fail_first(1)
        tenant = Tenant.objects.create(name="acme")
        ok, _ = services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
        flaky, _ = services.endpoint_create(tenant=tenant, url=receiver.url("/flaky"))
        services.publish_event(tenant=tenant, event_type="a.b", payload={}, endpoint_ids=[ok.id])
        services.publish_event(tenant=tenant, event_type="a.b", payload={}, endpoint_ids=[flaky.id])
        drain()
        make_due()
        drain()
    finally:
        receiver.stop()
    assert dict(Attempt.objects.values_list("endpoint_id").annotate(n=Count("id"))) == {
        ok.id: 1,
        flaky.id: 2,
    }
    # The figures come from the tallies the worker kept as it recorded those attempts;
    # a tally of 26 hours ago is out of the window.
    from deliveries.models import EndpointHour

    long_ago = (timezone.now() - timedelta(hours=26)).replace(minute=0, second=0, microsecond=0)
    EndpointHour.objects.create(
        hour=long_ago, endpoint=ok, outcome="retry", writer=1, attempts=7, total_ms=70.0
    )

    page = staff().get("/admin/deliveries/endpoint/")
    assert page.status_code == 200
    assert b"100.0% of 1" in page.content  # ok: the 26-hour-old failures are left out
    assert b"50.0% of 2" in page.content  # flaky: a 500, then a 200


def test_the_delivery_log_is_newest_first_and_filters_through_the_listing():
    tenant = Tenant.objects.create(name="acme")
    first, _ = services.endpoint_create(tenant=tenant, url="https://example.com/first")
    events = [
        services.publish_event(tenant=tenant, event_type="t", payload={"i": i}) for i in range(3)
    ]
    other, _ = services.endpoint_create(tenant=tenant, url="https://example.com/other")
    newer = services.publish_event(tenant=tenant, event_type="t", payload={})
    client = staff()

    page = client.get(CHANGELIST).context["cl"].result_list
    assert [d.event_id for d in page] == [newer.id, newer.id] + [e.id for e in events[::-1]]
    by_endpoint = client.get(CHANGELIST, {"endpoint": str(other.id)}).context["cl"]
    assert [d.endpoint_id for d in by_endpoint.result_list] == [other.id]
    by_first = client.get(CHANGELIST, {"endpoint": str(first.id)}).context["cl"]
    assert [d.event_id for d in by_first.result_list] == [newer.id] + [e.id for e in events[::-1]]
    elsewhere = Tenant.objects.create(name="elsewhere")
    assert len(client.get(CHANGELIST, {"tenant": str(tenant.id)}).context["cl"].result_list) == 5
    assert not client.get(CHANGELIST, {"tenant": str(elsewhere.id)}).context["cl"].result_list


def test_an_endpoint_with_deliveries_is_not_deleted_from_the_admin(data):
    """Delivery history is read-only in the admin, so the confirmation page names the
    endpoint's deliveries (found through the listing) and the deletion is refused."""
    _tenant, endpoint, _events = data
    user = User.objects.create_superuser("root", password="pw")
    client = Client()
    client.force_login(user)
    url = reverse("admin:deliveries_endpoint_delete", args=[endpoint.id])

    confirm = client.get(url)
    assert confirm.status_code == 200
    assert dict(confirm.context["model_count"])["deliveries"] == 3
    assert "delivery" in confirm.context["perms_lacking"]

    assert client.post(url, {"post": "yes"}).status_code == 403
    assert Delivery.objects.count() == 3 and Endpoint.objects.filter(id=endpoint.id).exists()
