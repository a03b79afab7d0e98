import asyncio

import pytest
from django.utils import timezone

from deliveries import services
from deliveries.loops import relay_tick, scheduler_tick
from deliveries.models import Tenant
from deliveries.worker import Worker
from tests.receiver import Receiver


@pytest.fixture(autouse=True)
def _egress_allows_loopback(settings):
    # The tests' receivers listen on loopback, which the egress guard refuses by default.
    settings.EGRESS_ALLOW_NETWORKS = ["127.0.0.0/8"]


@pytest.fixture
def receiver():
    r = Receiver().start()
    yield r
    r.stop()


@pytest.fixture
def tenant(db):
    return Tenant.objects.create(name="acme")


@pytest.fixture
def make_endpoint(tenant):
    def make(url, **options):
        endpoint, _secret = services.endpoint_create(tenant=tenant, url=url, **options)
        return endpoint

    return make


def run_workers(**options) -> dict:
    """Run the real worker until the broker is empty."""
    worker = Worker(lanes=options.pop("lanes", 2), **options)
    return asyncio.run(worker.run(stop=asyncio.Event(), until_idle=True, idle_sleep=0))


def drain(rounds: int = 20) -> None:
    """Scheduler, relay and workers in turn until nothing is due or in flight now."""
    for _ in range(rounds):
        scheduler_tick()
        relay_tick()
        run_workers()
        if scheduler_tick().idle:
            return
    raise AssertionError("the pipeline did not drain")


def make_due(**filters) -> int:
    """Skip the backoff wait: make waiting pending deliveries due now (the test's clock)."""
    from deliveries.models import Delivery

    return Delivery.objects.filter(state="pending", **filters).update(
        next_attempt_at=timezone.now()
    )
