import pytest
from django.utils.module_loading import import_string
from django_q.models import Schedule
from django_q.tasks import async_task  # noqa: F401  (django-q2 is importable and configured)

from deliveries import services
from deliveries.jobs.models import QueueMessage
from deliveries.models import Delivery, Tenant

pytestmark = [pytest.mark.django_db, pytest.mark.sqlite]


def test_schedule_rows_can_call_the_loop_units():
    tenant = Tenant.objects.create(name="t")
    services.endpoint_create(tenant=tenant, url="http://127.0.0.1:9/x")
    services.publish_event(tenant=tenant, event_type="t", payload={})
    schedule = Schedule.objects.create(
        func="deliveries.schedules.scheduler_pass", schedule_type=Schedule.MINUTES, minutes=1
    )
    assert import_string(schedule.func)()["enqueued"] == 1
    assert import_string("deliveries.schedules.relay_pass")()["published"] == 1
    assert Delivery.objects.get().state == "enqueued"
    assert QueueMessage.objects.count() == 1
