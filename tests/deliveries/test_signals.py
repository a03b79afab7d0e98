"""The signals a host connects to: once per object, after commit, never on a rollback."""

import pytest
from django.db import connection, transaction
from django.utils import timezone

from deliveries import services, signals
from deliveries.models import Delivery, Endpoint
from tests.conftest import drain
from tests.receiver import always

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.sqlite]


@pytest.fixture
def heard():
    """Connect a recorder to every signal; yields {signal name: [instances]}."""
    seen: dict[str, list] = {}
    connected = []
    for name in ("delivery_succeeded", "delivery_dead", "endpoint_disabled"):

        def record(sender, instance, _name=name, **kwargs):
            seen.setdefault(_name, []).append(instance)

        getattr(signals, name).connect(record, weak=False)
        connected.append((getattr(signals, name), record))
    yield seen
    for signal, record in connected:
        signal.disconnect(record)


def publish(tenant, n=1):
    return [
        services.publish_event(tenant=tenant, event_type="t", payload={"i": i}) for i in range(n)
    ]


def test_a_delivered_event_is_announced_once_per_delivery(tenant, make_endpoint, receiver, heard):
    make_endpoint(receiver.url("/ok"))
    make_endpoint(receiver.url("/also"))
    publish(tenant, 2)
    drain()
    succeeded = heard["delivery_succeeded"]
    assert sorted(d.id for d in succeeded) == sorted(Delivery.objects.values_list("id", flat=True))
    assert {d.state for d in succeeded} == {"succeeded"}  # read after the commit
    assert "delivery_dead" not in heard


def test_a_gone_endpoint_announces_the_dead_delivery_and_the_disabled_endpoint(
    tenant, make_endpoint, receiver, heard
):
    receiver.behaviours["/gone"] = always(410)
    endpoint = make_endpoint(receiver.url("/gone"))
    [event] = publish(tenant)
    drain()
    [dead] = heard["delivery_dead"]
    assert (dead.event_id, dead.state, dead.last_outcome) == (event.id, "dead", "endpoint_gone")
    [disabled] = heard["endpoint_disabled"]
    assert disabled.id == endpoint.id and disabled.enabled is False
    assert disabled.disabled_reason


def test_deliveries_reaching_a_disabled_endpoint_are_announced_dead(
    tenant, make_endpoint, receiver, heard
):
    endpoint = make_endpoint(receiver.url("/ok"))
    publish(tenant, 2)
    from deliveries.scheduler import scheduler_tick

    scheduler_tick()  # admitted (enqueued) before the endpoint is disabled
    services.endpoint_disable(endpoint=endpoint, reason="maintenance")
    drain()
    assert [e.id for e in heard["endpoint_disabled"]] == [endpoint.id]
    assert len(heard["delivery_dead"]) == 2
    assert {d.last_outcome for d in heard["delivery_dead"]} == {"endpoint_disabled"}
    assert receiver.received == []


def test_a_cancel_is_announced_after_commit_and_not_at_all_on_rollback(
    tenant, make_endpoint, heard
):
    make_endpoint("http://127.0.0.1:9/x")
    [kept, undone] = publish(tenant, 2)
    kept_id = Delivery.objects.get(event=kept).id
    undone_id = Delivery.objects.get(event=undone).id

    with transaction.atomic():
        services.delivery_cancel(delivery_ids=[kept_id])
        assert "delivery_dead" not in heard  # not before the commit
    assert [d.id for d in heard["delivery_dead"]] == [kept_id]

    with pytest.raises(RuntimeError), transaction.atomic():
        services.delivery_cancel(delivery_ids=[undone_id])
        raise RuntimeError("the caller's transaction rolls back")
    assert [d.id for d in heard["delivery_dead"]] == [kept_id]
    assert Delivery.objects.get(id=undone_id).state == "pending"


def test_retries_spent_by_expired_leases_are_announced_dead(tenant, make_endpoint, heard):
    from deliveries import state
    from deliveries.core.retry import RetryPolicy
    from deliveries.jobs.relay import relay_tick
    from deliveries.scheduler import scheduler_tick

    make_endpoint("http://127.0.0.1:9/x")
    publish(tenant)
    scheduler_tick()
    relay_tick()
    d = Delivery.objects.get()
    state.lease([(d.id, 1)], now=timezone.now(), lease_seconds=-1)
    state.expire_leases(now=timezone.now(), limit=10, policy=RetryPolicy(schedule=(), jitter=0))
    assert [x.id for x in heard["delivery_dead"]] == [d.id]


def test_a_receiver_that_raises_stops_nothing(tenant, make_endpoint, receiver, caplog):
    def broken(sender, instance, **kwargs):
        raise ValueError("the host's bug")

    signals.delivery_succeeded.connect(broken, weak=False)
    try:
        make_endpoint(receiver.url("/ok"))
        publish(tenant, 3)
        drain()
    finally:
        signals.delivery_succeeded.disconnect(broken)
    assert set(Delivery.objects.values_list("state", flat=True)) == {"succeeded"}
    failed = [r for r in caplog.records if getattr(r, "action", "") == "signal.receiver_failed"]
    assert len(failed) == 3 and "broken" in failed[0].receiver


def test_with_nothing_connected_nothing_waits_for_the_commit(tenant, make_endpoint):
    assert not signals.delivery_dead.has_listeners(Delivery)
    assert not signals.endpoint_disabled.has_listeners(Endpoint)
    endpoint = make_endpoint("http://127.0.0.1:9/x")
    publish(tenant)
    with transaction.atomic():
        services.delivery_cancel(delivery_ids=Delivery.objects.values_list("id", flat=True))
        services.endpoint_disable(endpoint=endpoint, reason="r")
        assert connection.run_on_commit == []
