"""Property-based tests of the customer API against its own OpenAPI schema.

schemathesis reads the schema that drf-spectacular serves at /api/schema/, generates
requests for every operation in it (valid ones and, on purpose, invalid ones) and sends
them to the Django WSGI app in this process. No answer may be a server error, and every
answer with a documented status must match the documented shape.

The app runs in this thread, on the test's database connection, so the requests see the
rows the test made, and pytest-django rolls everything back at the end.
"""

import pytest
import schemathesis
from django.core.cache import cache
from django.core.signals import request_finished, request_started
from django.db import close_old_connections, transaction
from django.utils import timezone
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from rest_framework.test import APIClient
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from deliveries import services
from deliveries.models import Attempt, Delivery, Outcome
from project.wsgi import application

# schemathesis leaves out the route it loaded the schema from (/api/schema/ itself).
schema = schemathesis.openapi.from_wsgi("/api/schema/", application)


@pytest.fixture
def wsgi_keeps_the_test_connection():
    """Django's request signals close a connection that is not in autocommit mode, and
    inside the test's transaction it never is. Django's test client unhooks them for the
    same reason; calling the WSGI app directly has to do it here."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def api_tenant(db, wsgi_keeps_the_test_connection):
    """A tenant with an endpoint, an event, its delivery and an attempt: the ids of
    existing rows for the detail routes. Returns the API key and the id per route."""
    tenant, key = services.tenant_create(name="schemathesis")
    endpoint, _secret = services.endpoint_create(tenant=tenant, url="https://example.com/hook")
    event = services.publish_event(tenant=tenant, event_type="invoice.paid", payload={"n": 1})
    delivery = Delivery.objects.get(event=event)
    # Attempt rows are append-only evidence with no service to write one outside the
    # worker; this one exists only so that the attempts route has something to show.
    Attempt.objects.create(
        delivery=delivery,
        number=1,
        started_at=timezone.now(),
        duration_ms=12.5,
        status_code=503,
        outcome=Outcome.RETRY,
        response_body="try later",
        request_headers={"content-type": "application/json"},
    )
    from tests.deliveries.test_api import backfill_run_of

    run = backfill_run_of(tenant)
    return key, {
        "/api/v1/backfill-runs/{id}/": str(run.id),
        "/api/v1/endpoints/{id}/": str(endpoint.id),
        "/api/v1/events/{id}/": str(event.id),
        "/api/v1/deliveries/{id}/": str(delivery.id),
    }


def existing_id_for(path: str, ids: dict[str, str]) -> str | None:
    return next((value for route, value in ids.items() if path.startswith(route)), None)


@schema.parametrize()
@schema.given(use_an_existing_id=st.booleans())
@settings(
    max_examples=40,
    deadline=None,
    # `api_tenant` is made once per operation and shared by its examples, which is the
    # point: the rows only have to exist. Each example's writes are rolled back below.
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
def test_no_generated_request_gets_a_server_error_or_an_undocumented_answer(
    case, use_an_existing_id, api_tenant
):
    key, ids = api_tenant
    existing_id = existing_id_for(case.path, ids)
    if use_an_existing_id and existing_id and "id" in (case.path_parameters or {}):
        case.path_parameters["id"] = existing_id
    # The per-key throttle (50/s) counts in the default cache and examples come faster
    # than that: each starts from an empty count instead of a flaky 429.
    cache.clear()
    # Some negative cases drop the Authorization header on purpose (schemathesis removes
    # it after this one is merged): their 401 is checked like any other answer.
    # A savepoint per example: one example's writes (a deleted endpoint) do not leak into
    # the next, and a database error in one does not abort the test's transaction.
    with transaction.atomic():
        try:
            response = case.call(headers={"Authorization": f"Bearer {key}"})
        finally:
            transaction.set_rollback(True)
    case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])


# --- What the generated requests found, pinned as plain tests -------------------------


@pytest.fixture
def client_and_delivery_id(db):
    tenant, key = services.tenant_create(name="found")
    services.endpoint_create(tenant=tenant, url="https://example.com/hook")
    event = services.publish_event(tenant=tenant, event_type="invoice.paid", payload={"n": 1})
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client, Delivery.objects.get(event=event).id


@pytest.mark.parametrize(
    "url",
    [
        "/api/v1/events/?created_after={t}",
        "/api/v1/events/?created_before={t}",
        "/api/v1/deliveries/?created_after={t}",
        "/api/v1/deliveries/?created_before={t}",
        # The delivery filters also narrow the object lookup of the detail routes.
        "/api/v1/deliveries/{delivery_id}/?created_after={t}",
        "/api/v1/deliveries/{delivery_id}/attempts/?created_after={t}",
    ],
)
def test_a_time_filter_with_an_offset_postgresql_cannot_store_is_not_a_server_error(
    client_and_delivery_id, url
):
    # Python's datetime takes UTC offsets up to ±23:59, PostgreSQL's timestamptz only up
    # to ±15:59:59: django-filter hands the parsed value to the query with its offset and
    # PostgreSQL refuses it (DataError). DRF's DateTimeField (recover's `since`, an
    # event's `deliver_at`) converts to the current time zone first and is not affected.
    client, delivery_id = client_and_delivery_id
    response = client.get(url.format(t="2026-01-01T00:00:00%2B18:00", delivery_id=delivery_id))
    assert response.status_code in (200, 400), response.content


def test_an_event_whose_payload_is_not_an_object_is_answered_in_the_documented_shape(
    api_tenant,
):
    # The API takes any JSON value as the payload; the schema says the answer's payload
    # is an object.
    key, _ids = api_tenant
    case = schema["/api/v1/events/"]["POST"].Case(
        body={"event_type": "invoice.paid", "payload": 0.5}, media_type="application/json"
    )
    response = case.call(headers={"Authorization": f"Bearer {key}"})
    case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])
