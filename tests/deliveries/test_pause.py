"""Pausing an endpoint holds its deliveries (pending, never dead-lettered, never
attempted) and resuming lets them flow; whatever was already on its way when the pause
landed is neither lost nor dead-lettered."""

import pytest
from django.core.management import call_command
from django.utils import timezone

from deliveries import admission, services, state
from deliveries.core.retry import RetryPolicy
from deliveries.jobs.loop import start_run
from deliveries.jobs.relay import relay_tick
from deliveries.models import Attempt, AuditEntry, Delivery, Endpoint, Tenant
from deliveries.policy import Classification
from deliveries.scheduler import scheduler_tick
from deliveries.selectors import delivery_explain
from tests.conftest import drain, make_due, run_workers

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.sqlite]


def publish(tenant, n=1, **kw):
    return [
        services.publish_event(tenant=tenant, event_type="t", payload={"i": i}, **kw)
        for i in range(n)
    ]


def states(**filters) -> dict[str, int]:
    found: dict[str, int] = {}
    for s in Delivery.objects.filter(**filters).values_list("state", flat=True):
        found[s] = found.get(s, 0) + 1
    return found


def test_a_paused_endpoint_holds_its_deliveries_and_resuming_sends_them(
    tenant, make_endpoint, receiver
):
    endpoint = make_endpoint(receiver.url("/ok"))
    before = publish(tenant, n=5)
    assert services.endpoint_pause(endpoint=endpoint, reason="receiver migration")

    drain()  # scheduler, relay, workers until idle: nothing may move
    published_meanwhile = publish(tenant, n=3)
    drain()

    assert states() == {"pending": 8}  # every event got its delivery; none dead
    # Held rows are not work the scheduler waits for: `run_scheduler --until-idle` ends.
    assert scheduler_tick().idle
    assert receiver.received == []
    assert Attempt.objects.count() == 0
    assert Delivery.objects.filter(attempt_count__gt=0).count() == 0

    assert services.endpoint_resume(endpoint=endpoint)
    drain()

    assert states() == {"succeeded": 8}
    sent = {r.webhook_id for r in receiver.received}
    assert sent == {str(d.id) for d in Delivery.objects.all()}
    assert len(receiver.received) == 8
    assert {d.event_id for d in Delivery.objects.all()} == {
        e.id for e in before + published_meanwhile
    }


def test_pause_and_resume_are_audited_once_each_and_repeat_harmlessly(tenant, make_endpoint):
    endpoint = make_endpoint("http://127.0.0.1:9/x")
    assert services.endpoint_pause(endpoint=endpoint, actor=None, reason="why", via="portal")
    paused_at = Endpoint.objects.get().paused_at
    assert not services.endpoint_pause(endpoint=endpoint, reason="again")
    endpoint.refresh_from_db()
    assert (endpoint.paused_at, endpoint.paused_reason) == (paused_at, "why")
    assert endpoint.paused

    assert services.endpoint_resume(endpoint=endpoint, via="admin")
    assert not services.endpoint_resume(endpoint=endpoint)
    endpoint.refresh_from_db()
    assert (endpoint.paused_at, endpoint.paused_reason, endpoint.paused) == (None, "", False)

    audit = list(AuditEntry.objects.order_by("id").values_list("action", "details"))
    assert audit == [
        ("endpoint.pause", {"endpoint": str(endpoint.id), "reason": "why", "via": "portal"}),
        ("endpoint.resume", {"endpoint": str(endpoint.id), "via": "admin"}),
    ]


def test_a_delivery_enqueued_before_the_pause_goes_back_to_pending_unattempted(
    tenant, make_endpoint, receiver
):
    """The scan admitted it before the pause committed: the worker that takes its message
    returns it to pending without sending it and without counting an attempt."""
    endpoint = make_endpoint(receiver.url("/ok"))
    publish(tenant, n=3)
    scheduler_tick()
    relay_tick()
    assert states() == {"enqueued": 3}

    services.endpoint_pause(endpoint=endpoint)
    run_workers()

    assert receiver.received == []
    assert states() == {"pending": 3}
    assert Attempt.objects.count() == 0
    for d in Delivery.objects.all():
        assert (d.attempt_count, d.policy_attempts, d.lease_token) == (0, 0, None)
        assert d.last_outcome == "" and d.finished_at is None
        assert delivery_explain(d).kind == "held"
    drain()
    assert states() == {"pending": 3}

    services.endpoint_resume(endpoint=endpoint)
    drain()
    assert states() == {"succeeded": 3}
    assert sorted(r.webhook_id for r in receiver.received) == sorted(
        str(i) for i in Delivery.objects.values_list("id", flat=True)
    )
    assert set(Delivery.objects.values_list("attempt_count", flat=True)) == {1}
    assert set(Delivery.objects.values_list("dispatch_count", flat=True)) == {2}


def test_a_delivery_leased_when_the_pause_lands_is_recorded_and_its_retry_is_held(
    tenant, make_endpoint
):
    """Mid-request when the pause lands: the attempt is recorded as usual (a success
    stays a success); a retry waits for the resume even once due."""
    endpoint = make_endpoint("http://127.0.0.1:9/x")
    publish(tenant, n=2)
    scheduler_tick()
    ids = list(Delivery.objects.order_by("id").values_list("id", flat=True))
    now = timezone.now()
    leased, _ = state.lease([(i, 1) for i in ids], now=now, lease_seconds=60)
    services.endpoint_pause(endpoint=endpoint)
    assert (
        "a retry waits for the resume" in delivery_explain(Delivery.objects.get(id=ids[0])).sentence
    )

    results = [
        state.AttemptResult(
            leased=item,
            classification=Classification(outcome),
            started_at=now,
            duration_ms=5.0,
            status_code=status,
        )
        for item, (outcome, status) in zip(leased, [("success", 200), ("retry", 503)], strict=True)
    ]
    summary = state.record(results, now=now, policy=RetryPolicy(schedule=(30,), jitter=0))
    assert (summary.succeeded, summary.retrying, summary.dead) == (1, 1, 0)
    assert Delivery.objects.get(id=leased[0].id).state == "succeeded"

    make_due()
    drain()
    retry = Delivery.objects.get(id=leased[1].id)
    assert (retry.state, retry.attempt_count, retry.last_status_code) == ("pending", 1, 503)
    assert delivery_explain(retry).kind == "held"

    services.endpoint_resume(endpoint=endpoint)
    assert states() == {"succeeded": 1, "pending": 1}
    assert (
        admission.admit_due(
            now=timezone.now(), page_size=10, limits=admission.Limits.from_settings()
        ).admitted
        == 1
    )


def test_other_endpoints_flow_past_a_paused_endpoints_backlog(tenant, make_endpoint):
    """Admission leaves the paused endpoint out of its scans, as it does a full one, so
    its backlog neither takes the page nor hides the others' rows."""
    other_tenant = Tenant.objects.create(name="other")
    paused = make_endpoint("http://127.0.0.1:9/paused")
    for i in range(300):
        services.publish_event(
            tenant=tenant, event_type="t", payload={"i": i}, endpoint_ids=[paused.id]
        )
    services.endpoint_pause(endpoint=paused)
    services.endpoint_create(tenant=other_tenant, url="http://127.0.0.1:9/other")
    publish(other_tenant, n=5)
    # A running one of the same tenant too: the pause is the endpoint's, not the tenant's.
    sibling = make_endpoint("http://127.0.0.1:9/sibling")
    for i in range(4):
        services.publish_event(
            tenant=tenant, event_type="t", payload={"i": i}, endpoint_ids=[sibling.id]
        )

    limits = admission.Limits.from_settings()
    result = admission.admit_due(now=timezone.now(), page_size=10, limits=limits)

    assert result.admitted == 9
    assert states(endpoint=paused) == {"pending": 300}
    assert states(endpoint=sibling) == {"enqueued": 4}
    assert states(tenant=other_tenant) == {"enqueued": 5}


def test_disabling_a_paused_endpoint_still_dead_letters_what_it_finds_queued(tenant, make_endpoint):
    """Disabling stays what it is: its queued deliveries go dead when a worker reaches
    them, paused or not."""
    endpoint = make_endpoint("http://127.0.0.1:9/x")
    publish(tenant, n=2)
    scheduler_tick()
    relay_tick()
    services.endpoint_pause(endpoint=endpoint)
    services.endpoint_disable(endpoint=endpoint, reason="staff")
    run_workers()
    assert states() == {"dead": 2}
    assert set(Delivery.objects.values_list("last_outcome", flat=True)) == {"endpoint_disabled"}


def test_the_status_sentence_and_delivery_status_say_the_delivery_is_held(
    tenant, make_endpoint, capsys
):
    endpoint = make_endpoint("http://127.0.0.1:9/x")
    [event] = publish(tenant)
    start_run("scheduler")
    d = Delivery.objects.get(event=event)
    assert delivery_explain(d).kind == "due"

    services.endpoint_pause(endpoint=endpoint, reason="maintenance window")
    d = Delivery.objects.select_related("endpoint").get(event=event)
    explanation = delivery_explain(d)
    assert explanation.kind == "held"
    assert "paused" in explanation.sentence and "(maintenance window)" in explanation.sentence
    assert "resumed" in explanation.sentence

    call_command("delivery_status", str(d.id))
    out = capsys.readouterr().out
    assert out.splitlines()[0] == explanation.sentence

    services.endpoint_resume(endpoint=endpoint)
    assert delivery_explain(Delivery.objects.get(event=event)).kind == "due"
