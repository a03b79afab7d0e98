"""What a client generated from the OpenAPI schema relies on: every error answer is
documented in the one shape, unknown routes and query parameters are refused in it, a
201 says where the new object is, and a time without an offset is refused."""

import typing
from datetime import timedelta

import pytest
from django.test import override_settings
from django.utils import timezone
from jsonschema import Draft202012Validator
from rest_framework.test import APIClient

from deliveries import client as client_module
from deliveries import services
from deliveries.api.errors import ERROR_SCHEMA
from deliveries.models import Event

pytestmark = pytest.mark.django_db


@pytest.fixture
def client(tenant):
    _, key = services.api_key_create(tenant=tenant)
    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return c


@pytest.fixture(scope="module")
def openapi(django_db_blocker):
    with django_db_blocker.unblock():
        return APIClient().get("/api/schema/", {"format": "json"}).json()


def operations(openapi):
    for path, methods in openapi["paths"].items():
        for method, operation in methods.items():
            yield path, method, operation


def test_every_operation_documents_its_errors_in_the_one_shape_with_examples(openapi):
    assert openapi["components"]["schemas"]["Error"] == ERROR_SCHEMA
    shape = Draft202012Validator(ERROR_SCHEMA)
    seen = 0
    for path, method, operation in operations(openapi):
        responses = operation["responses"]
        expected = {"400", "401", "429"} | ({"404"} if "{" in path else set())
        if "requestBody" in operation:
            expected.add("415")
        assert expected <= set(responses), (method, path, sorted(responses))
        for status, response in responses.items():
            if not status.startswith(("4", "5")):
                continue
            content = response["content"]["application/json"]
            assert content["schema"] == {"$ref": "#/components/schemas/Error"}
            assert content["examples"], (method, path, status)
            for example in content["examples"].values():
                shape.validate(example["value"])
                seen += 1
    assert seen > 50
    events = openapi["paths"]["/api/v1/events/"]["post"]["responses"]
    assert {"409", "413", "422"} <= set(events)


def test_the_schema_gives_realistic_request_bodies(openapi):
    event_input = openapi["components"]["schemas"]["EventInput"]["properties"]
    assert event_input["payload"]["type"] == "object"
    assert isinstance(event_input["payload"]["example"], dict)
    examples = openapi["paths"]["/api/v1/events/"]["post"]["requestBody"]["content"][
        "application/json"
    ]["examples"]
    (example,) = examples.values()
    assert isinstance(example["value"]["payload"], dict)


def test_every_request_example_in_the_schema_works_as_written(client, openapi):
    sent = 0
    for path, method, operation in operations(openapi):
        content = operation.get("requestBody", {}).get("content", {}).get("application/json")
        for example in (content or {}).get("examples", {}).values():
            r = getattr(client, method)(path, example["value"], format="json")
            assert r.status_code in (200, 201, 202), (method, path, r.content)
            sent += 1
    assert sent >= 2


# The Python client's answer types, and the schema component each is written on.
CLIENT_TYPES = {
    "Endpoint": "EndpointOutput",
    "EndpointWithSecret": "EndpointWithSecret",
    "SecretRotation": "SecretOutput",
    "Event": "EventOutput",
    "Delivery": "DeliveryOutput",
    "Attempt": "AttemptOutput",
    "EventType": "EventTypeOutput",
    "EventTypeVersion": "EventTypeVersionOutput",
    "PortalLink": "PortalLinkOutput",
}


def test_the_python_clients_types_have_the_schemas_fields(openapi):
    typed = {
        name: value
        for name, value in vars(client_module).items()
        if typing.is_typeddict(value) and value.__module__ == client_module.__name__
    }
    assert set(typed) == set(CLIENT_TYPES)  # a new answer type is written on the schema too
    components = openapi["components"]["schemas"]
    for name, component in CLIENT_TYPES.items():
        fields = set(typing.get_type_hints(typed[name]))
        assert fields == set(components[component]["properties"]), name


@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("urlconf", ["project.urls", "tests.host_urls"])
def test_an_unknown_route_under_the_api_is_the_json_404(client, urlconf, debug):
    with override_settings(ROOT_URLCONF=urlconf, DEBUG=debug):
        for url in ["/api/v1/nope/", "/api/v1/endpoints/a/b/c/", "/api/v2/", "/api/nope"]:
            r = client.get(url)
            assert r.status_code == 404, url
            assert r["Content-Type"] == "application/json", url
            assert r.json() == {"error": {"code": "not_found", "message": "Not found."}}


def test_a_201_carries_the_location_of_what_it_made(client):
    r = client.post("/api/v1/endpoints/", {"url": "https://example.com/h"}, format="json")
    assert r.status_code == 201
    assert r["Location"] == f"http://testserver/api/v1/endpoints/{r.json()['id']}/"
    assert client.get(r["Location"]).json()["id"] == r.json()["id"]
    body = {"event_type": "t", "payload": {}}
    for key in (None, "k1", "k1"):  # plain, then under a key, then its replay
        headers = {"HTTP_IDEMPOTENCY_KEY": key} if key else {}
        r = client.post("/api/v1/events/", body, format="json", **headers)
        assert r.status_code == 201
        assert r["Location"] == f"http://testserver/api/v1/events/{r.json()['id']}/"
        assert client.get(r["Location"]).status_code == 200


def test_every_get_route_refuses_a_query_parameter_it_does_not_read(client, openapi, tenant):
    endpoint, _ = services.endpoint_create(tenant=tenant, url="https://example.com/h")
    event = services.publish_event(tenant=tenant, event_type="t", payload={})
    ids = {"endpoints": endpoint.id, "events": event.id, "deliveries": event.deliveries.get().id}
    checked = []
    for path, method, operation in operations(openapi):
        if method != "get" or ("{id}" in path and path.split("/")[3] not in ids):
            continue
        url = path.replace("{id}", str(ids.get(path.split("/")[3], "")))
        documented = {p["name"] for p in operation.get("parameters", []) if p["in"] == "query"}
        r = client.get(url, {"page_size": "2", "evnt_type": "x"})
        assert r.status_code == 400, (url, r.content)
        error = r.json()["error"]
        assert error["code"] == "unknown_parameter"
        assert error["details"]["unknown"] == ["evnt_type", "page_size"]
        # What the route says it reads is what the schema documents (and format).
        assert set(error["details"]["known"]) == documented | {"format"}, url
        checked.append(url)
    assert len(checked) >= 8


@pytest.mark.parametrize(
    ("method", "url", "body"),
    [
        ("post", "/api/v1/events/", {"event_type": "t", "payload": {}, "deliver_at": "X"}),
        ("post", "/api/v1/deliveries/recover/", {"since": "X"}),
        ("get", "/api/v1/events/?created_after=X", None),
        ("get", "/api/v1/deliveries/?created_before=X", None),
    ],
)
def test_a_time_without_an_offset_is_refused_not_guessed(client, method, url, body):
    naive = (timezone.now() - timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%S")
    if body:
        body = {k: naive if v == "X" else v for k, v in body.items()}
        r = getattr(client, method)(url, body, format="json")
    else:
        r = client.get(url.replace("X", naive))
    assert r.status_code == 400, r.content
    assert "UTC offset" in str(r.json()["error"]["details"])
    assert not Event.objects.exists()
    aware = naive + "+02:00"
    if body:
        r = getattr(client, method)(
            url, {k: aware if v == naive else v for k, v in body.items()}, format="json"
        )
    else:
        r = client.get(url.replace("X", aware.replace("+", "%2B")))
    assert r.status_code < 300, r.content


def test_deliver_at_with_an_offset_holds_the_deliveries_until_that_instant(client, tenant):
    services.endpoint_create(tenant=tenant, url="https://example.com/h")
    r = client.post(
        "/api/v1/events/",
        {"event_type": "t", "payload": {}, "deliver_at": "2999-01-01T10:00:00+02:00"},
        format="json",
    )
    assert r.status_code == 201
    delivery = Event.objects.get(id=r.json()["id"]).deliveries.get()
    assert delivery.next_attempt_at.isoformat() == "2999-01-01T08:00:00+00:00"


def test_an_endpoint_may_not_ask_past_the_operators_ceilings(client, settings):
    settings.DELIVERY_ENDPOINT_RATE_CEILING = 100
    settings.DELIVERY_ENDPOINT_CONCURRENCY_CEILING = 50
    for field, asked in (("rate_limit", 101), ("max_concurrency", 51)):
        r = client.post(
            "/api/v1/endpoints/", {"url": "https://example.com/h", field: asked}, format="json"
        )
        assert r.status_code == 400, r.content
        assert "ceiling" in r.json()["error"]["message"] and field in r.json()["error"]["message"]
    r = client.post(
        "/api/v1/endpoints/",
        {"url": "https://example.com/h", "rate_limit": 100, "max_concurrency": 50},
        format="json",
    )
    assert r.status_code == 201
    r = client.patch(r["Location"], {"rate_limit": 1000}, format="json")
    assert r.status_code == 400
