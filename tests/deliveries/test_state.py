"""Transitions of the state machine that the pipeline tests do not reach directly."""

import uuid

import pytest
from django.utils import timezone

from deliveries import services, state
from deliveries.core.retry import RetryPolicy
from deliveries.jobs.loop import start_run
from deliveries.jobs.models import Outbox
from deliveries.jobs.relay import relay_tick
from deliveries.models import Delivery, Endpoint
from deliveries.scheduler import scheduler_tick
from deliveries.selectors import delivery_explain
from tests.conftest import drain, run_workers

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.sqlite]

NOW = timezone.now


def publish(tenant, n=1, **kw):
    return [
        services.publish_event(tenant=tenant, event_type="t", payload={"i": i}, **kw)
        for i in range(n)
    ]


def test_lease_skips_copies_of_a_message_that_lost_the_race(tenant, make_endpoint):
    make_endpoint("http://127.0.0.1:9/x")
    publish(tenant)
    scheduler_tick()
    d = Delivery.objects.get()
    first, skipped = state.lease([(d.id, 1)], now=NOW(), lease_seconds=60)
    again, skipped_again = state.lease([(d.id, 1)], now=NOW(), lease_seconds=60)
    assert (len(first), skipped) == (1, 0)
    assert (len(again), skipped_again) == (0, 1)


def test_a_stale_dispatch_cannot_lease_a_newer_one(tenant, make_endpoint):
    make_endpoint("http://127.0.0.1:9/x")
    publish(tenant)
    scheduler_tick()
    d = Delivery.objects.get()
    leased, skipped = state.lease([(d.id, 0)], now=NOW(), lease_seconds=60)
    assert leased == [] and skipped == 1


def test_only_the_lease_holder_records_an_outcome(tenant, make_endpoint):
    make_endpoint("http://127.0.0.1:9/x")
    publish(tenant)
    scheduler_tick()
    d = Delivery.objects.get()
    [leased], _ = state.lease([(d.id, 1)], now=NOW(), lease_seconds=60)
    # The lease runs out and the scheduler hands the delivery on.
    Delivery.objects.filter(id=d.id).update(lease_until=NOW() - timezone.timedelta(seconds=1))
    policy = RetryPolicy(schedule=(0,), jitter=0)
    assert state.expire_leases(now=NOW(), limit=10, policy=policy) == 1

    from deliveries.policy import classify

    result = state.AttemptResult(
        leased=leased,
        classification=classify(status=200),
        started_at=NOW(),
        duration_ms=1.0,
        status_code=200,
    )
    summary = state.record([result], now=NOW(), policy=policy)

    d.refresh_from_db()
    assert summary.stale == 1 and summary.succeeded == 0
    assert d.state == "pending"
    attempt = d.attempts.get()
    assert attempt.recorded is False  # kept as evidence of what reached the wire


def test_an_expired_lease_with_the_schedule_spent_is_dead(tenant, make_endpoint):
    make_endpoint("http://127.0.0.1:9/x")
    publish(tenant)
    scheduler_tick()
    d = Delivery.objects.get()
    state.lease([(d.id, 1)], now=NOW(), lease_seconds=-1)
    assert state.expire_leases(now=NOW(), limit=10, policy=RetryPolicy(schedule=())) == 1
    d.refresh_from_db()
    assert d.state == "dead"
    assert d.last_outcome == "lease_expired"
    assert d.lease_expiries == 1


def test_a_lost_dispatch_is_recovered_with_a_new_outbox_row(tenant, make_endpoint, receiver):
    make_endpoint(receiver.url("/ok"))
    publish(tenant)
    scheduler_tick()
    relay_tick()
    d = Delivery.objects.get()
    # The transport lost the message (a broker without acknowledgements, a purge...).
    from deliveries.jobs.models import QueueMessage

    QueueMessage.objects.all().delete()
    assert state.recover_lost_dispatches(now=NOW(), older_than=3600, limit=10) == 0
    assert state.recover_lost_dispatches(now=NOW(), older_than=0, limit=10) == 1
    d.refresh_from_db()
    assert d.state == "pending" and d.last_outcome == "transport_lost"

    drain()

    d.refresh_from_db()
    assert d.state == "succeeded"
    assert d.dispatch_count == 2
    assert Outbox.objects.filter(ref_id=d.id).count() == 2
    assert [r.webhook_id for r in receiver.received] == [str(d.id)]


def test_replay_sends_again_with_the_same_identity_and_a_fresh_budget(tenant, receiver):
    services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
    publish(tenant)
    drain()
    d = Delivery.objects.get()
    assert d.state == "succeeded"

    assert services.delivery_replay(delivery_ids=[d.id, uuid.uuid4()]) == 1
    d.refresh_from_db()
    assert d.state == "pending" and d.policy_attempts == 0
    drain()

    d.refresh_from_db()
    assert d.state == "succeeded" and d.attempt_count == 2
    assert [r.webhook_id for r in receiver.received] == [str(d.id)] * 2


def test_replay_leaves_in_flight_deliveries_alone(tenant, make_endpoint):
    make_endpoint("http://127.0.0.1:9/x")
    publish(tenant)
    scheduler_tick()
    d = Delivery.objects.get()
    assert services.delivery_replay(delivery_ids=[d.id]) == 0
    d.refresh_from_db()
    assert d.state == "enqueued"


def test_cancel_stops_unsent_deliveries_only(tenant, make_endpoint, receiver):
    make_endpoint(receiver.url("/ok"))
    publish(tenant, 2)
    a, b = Delivery.objects.order_by("created_at")
    scheduler_tick()
    Delivery.objects.filter(id=b.id).update(state="pending")  # b not yet admitted
    state.lease([(a.id, 1)], now=NOW(), lease_seconds=60)

    assert services.delivery_cancel(delivery_ids=[a.id, b.id]) == 1
    b.refresh_from_db()
    a.refresh_from_db()
    assert b.state == "dead" and b.last_outcome == "cancelled"
    assert a.state == "leased"


def test_every_transition_is_explained(tenant, make_endpoint, receiver, settings):
    settings.DELIVERY_RETRY_SCHEDULE = [3600]
    receiver.behaviours["/down"] = lambda n: (503, {}, b"")
    endpoint = make_endpoint(receiver.url("/down"))
    [event] = publish(tenant)
    d = Delivery.objects.get(event=event)

    assert delivery_explain(d).kind == "stalled"  # due, but no scheduler is running
    start_run("scheduler")  # a running loop: fresh heartbeat
    assert delivery_explain(d).kind == "due"
    scheduler_tick()
    d.refresh_from_db()
    assert delivery_explain(d).kind == "stalled"  # in the outbox, but no relay
    start_run("relay")
    assert delivery_explain(d).kind == "outbox"
    relay_tick()
    d.refresh_from_db()
    assert delivery_explain(d).kind == "stalled"  # in transport, but no worker
    start_run("workers")
    assert delivery_explain(d).kind == "in_transport"
    run_workers()
    d.refresh_from_db()
    explanation = delivery_explain(d)
    assert explanation.kind == "waiting"
    assert "HTTP 503" in explanation.sentence

    settings.DELIVERY_RETRY_SCHEDULE = []
    endpoint.refresh_from_db()
    Delivery.objects.filter(id=d.id).update(next_attempt_at=NOW())
    drain()
    d.refresh_from_db()
    assert delivery_explain(d).kind == "dead"
    assert "Replay" in delivery_explain(d).sentence


def test_release_gives_a_lease_back_without_counting_the_attempt(tenant, make_endpoint):
    make_endpoint("http://127.0.0.1:9/x")
    publish(tenant, n=2)
    scheduler_tick()
    ids = list(Delivery.objects.values_list("id", flat=True))
    leased, _ = state.lease([(i, 1) for i in ids], now=NOW(), lease_seconds=60)
    held, lost = leased
    # The second lease runs out and another worker takes it: its old holder cannot
    # give it back.
    Delivery.objects.filter(id=lost.id).update(lease_token=uuid.uuid4())

    assert state.release([held, lost], now=NOW()) == 1

    held_row = Delivery.objects.get(id=held.id)
    assert held_row.state == "pending" and held_row.lease_token is None
    assert (held_row.attempt_count, held_row.policy_attempts) == (0, 0)
    assert held_row.next_attempt_at <= NOW()
    lost_row = Delivery.objects.get(id=lost.id)
    assert lost_row.state == "leased" and lost_row.attempt_count == 1


def test_the_scheduler_admits_on_every_pass_and_sweeps_once_an_interval(
    tenant, make_endpoint, monkeypatch
):
    """SchedulerPasses (run_scheduler's loop): admission every pass, the sweeps (here a
    lease running out) at most every sweep_every seconds of its clock."""
    from deliveries import scheduler

    clock = [1000.0]
    monkeypatch.setattr(scheduler.time, "monotonic", lambda: clock[0])
    passes = scheduler.SchedulerPasses(sweep_every=0.5)
    make_endpoint("http://127.0.0.1:9/x")

    def expired_lease() -> None:
        publish(tenant)
        scheduler_tick(sweep=False)
        d = Delivery.objects.get(state="enqueued")
        state.lease([(d.id, 1)], now=NOW(), lease_seconds=-1)

    expired_lease()
    assert passes().counts["lease_expired"] == 1

    expired_lease()
    publish(tenant)
    second = passes()
    assert second.counts["enqueued"] == 1  # admitted at once
    assert "lease_expired" not in second.counts  # the sweep waits for its interval
    assert Delivery.objects.filter(state="leased").count() == 1

    clock[0] += 0.5
    assert passes().counts["lease_expired"] == 1
    assert not Delivery.objects.filter(state="leased").exists()


def test_a_sweep_that_filled_its_page_runs_again_on_the_next_pass(
    tenant, make_endpoint, monkeypatch
):
    from deliveries import scheduler

    monkeypatch.setattr(scheduler.time, "monotonic", lambda: 1000.0)  # the clock stands still
    make_endpoint("http://127.0.0.1:9/x")
    publish(tenant, n=3)
    scheduler_tick(sweep=False)
    state.lease([(d.id, 1) for d in Delivery.objects.all()], now=NOW(), lease_seconds=-1)
    passes = scheduler.SchedulerPasses(page_size=2, sweep_every=60)

    assert passes().counts["lease_expired"] == 2  # a full page: more may wait
    assert passes().counts["lease_expired"] == 1  # not a full page: swept dry
    assert "lease_expired" not in passes().counts  # the next sweep waits 60 s


def test_the_refill_pause_is_the_time_to_free_a_tenth_of_the_ceiling():
    from deliveries.jobs.loop import SOON_WAIT
    from deliveries.scheduler import REFILL_MAX_WAIT, refill_pause

    # 5,000 in flight at most; 500 freed in the last 0.1 s: a tenth frees in 0.1 s.
    assert refill_pause(500, 0.1, 5000) == pytest.approx(0.1)
    assert refill_pause(250, 0.1, 5000) == pytest.approx(0.2)
    # A small ceiling on fast workers looks again as soon as any pass that did work.
    assert refill_pause(500, 0.1, 100) == SOON_WAIT
    # Slow workers, or none freed anything (another scheduler admitted meanwhile, say):
    # never longer than the cap.
    assert refill_pause(10, 1.0, 5000) == REFILL_MAX_WAIT
    assert refill_pause(0, 0.1, 5000) == REFILL_MAX_WAIT
    assert refill_pause(-40, 0.1, 5000) == REFILL_MAX_WAIT
    assert refill_pause(500, 0.0, 5000) == REFILL_MAX_WAIT


def test_a_pass_that_fills_the_global_ceiling_pauses_by_the_rate_slots_came_free(
    tenant, make_endpoint, monkeypatch, settings
):
    """SchedulerPasses: once the global ceiling is full, the next pass waits for a
    tenth of it to come free (at the workers' rate since the last pass) instead of
    passing at every recording; a pass with room left does not pause."""
    from deliveries import scheduler

    settings.DELIVERY_MAX_IN_FLIGHT = 10
    clock = [1000.0]
    monkeypatch.setattr(scheduler.time, "monotonic", lambda: clock[0])
    make_endpoint("http://127.0.0.1:9/x")
    publish(tenant, n=20)
    passes = scheduler.SchedulerPasses(sweep_every=60)

    first = passes()
    # Filled, but with no pass before it there is no rate yet: no pause asked.
    assert (first.counts["enqueued"], first.admission.filled, first.pause) == (10, True, 0.0)
    # The workers finish 4 in the next 0.5 s: 8 a second, a tenth of 10 in 0.125 s.
    clock[0] += 0.5
    done = Delivery.objects.filter(state="enqueued").values_list("id", flat=True)[:4]
    Delivery.objects.filter(id__in=list(done)).update(state="succeeded")
    second = passes()
    assert (second.counts["enqueued"], second.admission.in_flight) == (4, 6)
    assert second.pause == pytest.approx(0.125)
    # Nothing freed since: the longest pause.
    clock[0] += 0.125
    assert passes().pause == scheduler.REFILL_MAX_WAIT
    # The last six due, room for ten: no pause.
    clock[0] += 0.2
    Delivery.objects.filter(state="enqueued").update(state="succeeded")
    last = passes()
    assert (last.counts["enqueued"], last.admission.filled, last.pause) == (6, False, 0.0)


def failed_batch(tenant, make_endpoint, answers):
    """Lease one delivery per answer (each to its own endpoint) and build the results."""
    from deliveries.policy import classify

    for i, _ in enumerate(answers):
        make_endpoint(f"http://127.0.0.1:9/{i}")
    publish(tenant)
    scheduler_tick()
    messages = [(d.id, 1) for d in Delivery.objects.order_by("endpoint__url")]
    leased, _ = state.lease(messages, now=NOW(), lease_seconds=60)
    by_url = {lease.endpoint_id: lease for lease in leased}
    ordered = [by_url[d.endpoint_id] for d in Delivery.objects.order_by("endpoint__url")]
    return [
        state.AttemptResult(
            leased=lease,
            classification=classify(status=status, error_kind=kind),
            started_at=NOW(),
            duration_ms=1.0,
            status_code=status,
            error_kind=kind,
            error=kind,
        )
        for lease, (status, kind) in zip(ordered, answers, strict=True)
    ]


def test_a_batch_of_failures_moves_each_delivery_its_own_way(tenant, make_endpoint):
    answers = [(503, ""), (400, ""), (410, ""), (None, "connect")]
    results = failed_batch(tenant, make_endpoint, answers)
    # The third lease ran out and went to another worker: its result changes nothing.
    stale = results[2].leased.id
    Delivery.objects.filter(id=stale).update(lease_token=uuid.uuid4())
    now = NOW()
    policy = RetryPolicy(schedule=(30,), jitter=0)

    summary = state.record(results, now=now, policy=policy)

    assert (summary.retrying, summary.dead, summary.stale) == (2, 1, 1)
    rows = {d.id: d for d in Delivery.objects.all()}
    retry, permanent, _, connect = (rows[r.leased.id] for r in results)
    assert (retry.state, retry.last_status_code, retry.last_outcome) == ("pending", 503, "retry")
    assert retry.next_attempt_at == now + timezone.timedelta(seconds=30)
    assert retry.finished_at is None and retry.lease_token is None
    assert (permanent.state, permanent.last_status_code) == ("dead", 400)
    assert permanent.finished_at == now and permanent.last_outcome == "permanent"
    assert (connect.state, connect.last_status_code, connect.last_error) == (
        "pending",
        None,
        "connect",
    )
    assert rows[stale].state == "leased" and rows[stale].last_status_code is None
    assert Delivery.objects.get(id=stale).endpoint.enabled  # a stale 410 disables nothing


def test_recording_a_batch_of_failures_costs_the_same_statements_for_30_as_for_3(
    tenant, make_endpoint
):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    if connection.vendor != "postgresql":
        pytest.skip("on SQLite each failure is its own UPDATE")
    policy = RetryPolicy(schedule=(30,), jitter=0)
    counts = []
    for n in (3, 30):
        Endpoint.objects.all().delete()  # and their deliveries
        results = failed_batch(tenant, make_endpoint, [(503, "")] * n)
        with CaptureQueriesContext(connection) as queries:
            assert state.record(results, now=NOW(), policy=policy).retrying == n
        counts.append(len(queries))
    assert counts[0] == counts[1]


def test_a_mixed_batch_records_every_attempt_its_tallies_and_who_held_the_lease(
    tenant, make_endpoint
):
    from deliveries.models import Attempt, AttemptMinute, EndpointHour
    from deliveries.policy import classify

    answers = [(200, ""), (200, ""), (503, ""), (503, "")]
    results = failed_batch(tenant, make_endpoint, answers)
    for r in results[:2]:
        r.classification = classify(status=200)
    # One success and one failure lost their leases: kept as attempts, nothing moved.
    lost = {results[1].leased.id, results[3].leased.id}
    Delivery.objects.filter(id__in=lost).update(lease_token=uuid.uuid4())
    policy = RetryPolicy(schedule=(30,), jitter=0)

    summary = state.record(results, now=NOW(), policy=policy)

    assert (summary.succeeded, summary.retrying, summary.stale) == (1, 1, 2)
    states = dict(Delivery.objects.values_list("id", "state"))
    assert [states[r.leased.id] for r in results] == ["succeeded", "leased", "pending", "leased"]
    recorded = dict(Attempt.objects.values_list("delivery_id", "recorded"))
    assert [recorded[r.leased.id] for r in results] == [True, False, True, False]
    assert Attempt.objects.get(delivery_id=results[0].leased.id).status_code == 200
    outcomes = dict(AttemptMinute.objects.values_list("outcome", "attempts"))
    assert outcomes == {"success": 2, str(results[2].classification.outcome): 2}
    assert sum(EndpointHour.objects.values_list("attempts", flat=True)) == 4
