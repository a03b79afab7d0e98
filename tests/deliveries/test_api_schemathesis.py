"""Property-based tests of the customer API against its own OpenAPI schema.

schemathesis reads the schema that drf-spectacular serves at /api/schema/, generates
requests for every operation in it (valid ones and, on purpose, invalid ones) and sends
them to the Django WSGI app in this process. No answer may be a server error, and every
answer with a documented status must match the documented shape.

The app runs in this thread, on the test's database connection, so the requests see the
rows the test made, and pytest-django rolls everything back at the end.
"""

import base64
import json
from dataclasses import dataclass
from urllib.parse import quote, urlencode

import pytest
import schemathesis
from django.core.cache import cache
from django.core.signals import request_finished, request_started
from django.db import close_old_connections, transaction
from django.test import Client
from django.utils import timezone
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from rest_framework.test import APIClient
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core import NOT_SET
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
    # Not the schema's own examples: schemathesis cannot give them the extra argument
    # this test takes (tests/deliveries/test_api_contract.py sends them).
    phases=[Phase.generate, Phase.target, Phase.shrink],
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


# --- Hostile values in every parameter of every operation -------------------------------
#
# For each operation in the schema, a valid request (schemathesis' positive generation)
# is taken as the base, and then every parameter in turn (each path, query and header
# parameter, each property of the JSON body, and the whole body) gets each kind of
# hostile value: text with NUL, lone surrogates, CR/LF or other controls, or very long;
# extreme numbers, offsets and calendar ends; tampered cursors; JSON nested far too deep,
# numbers past a float, and keys no database stores. Every answer must be below 500, and
# every 4xx the one error shape. Values reach Django as a WSGI server hands them over:
# path and query as percent-encoded UTF-8 (a lone surrogate as the bytes it would be),
# header values as Latin-1 text of their bytes.

OPERATIONS = {result.ok().label: result.ok() for result in schema.get_all_operations()}

_BAD_CHARACTERS = ["\x00", "\ud800", "\udfff", "\r\n", "\n", "\x1b", "\x7f", "\u2028", "\ufeff"]
hostile_text = st.one_of(
    st.builds(
        lambda before, bad, after: before + bad + after,
        st.text(max_size=6),
        st.sampled_from(_BAD_CHARACTERS),
        st.text(max_size=6),
    ),
    st.sampled_from(["x" * 10_000, "\x00" * 300]),
)
EXTREMES = [
    "-1",
    "1e999",
    "-1e999",
    "NaN",
    "Infinity",
    str(2**63),
    str(-(2**63) - 1),
    "9" * 50,
    "0001-01-01T00:00:00+23:59",
    "9999-12-31T23:59:59-23:59",
    "2026-01-01T00:00:00-20:00",
    "2026-02-30T25:61:61Z",
]
extreme_value = st.sampled_from(EXTREMES)


def _cursor_of(fields: dict) -> str:
    return base64.b64encode(urlencode(fields).encode()).decode()


TAMPERED_CURSORS = [
    _cursor_of({"p": "2026-01-01 00:00:00-20:00"}),
    _cursor_of({"p": "9999-12-31 23:59:59-15:00"}),
    _cursor_of({"p": "yesterday"}),
    _cursor_of({"p": "\x00"}),
    _cursor_of({"p": "9" * 40}),
    _cursor_of({"o": "-20"}),
    _cursor_of({"o": "-20:00"}),
    _cursor_of({"r": "yes"}),
    "!!!",
    base64.b64encode(b"p=\xff\xfe").decode(),
    "A" * 10_001,
]
tampered_cursor = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "o": st.sampled_from(["-20", "-20:00", "1e9", "x", "99999999999999999999"]),
            "r": st.sampled_from(["yes", "2", "-1"]),
            "p": st.sampled_from(
                [
                    "2026-01-01 00:00:00-20:00",
                    "0001-01-01 00:00:00+15:00",
                    "yesterday",
                    "\x00",
                    "9" * 40,
                    "-1",
                    "",
                ]
            ),
        },
    ).map(_cursor_of),
    st.sampled_from(TAMPERED_CURSORS),
)
PARAMETER_VALUES = {"text": hostile_text, "extreme": extreme_value}


def _deep(levels: int, shape: str) -> str:
    return "[" * levels + "]" * levels if shape == "list" else '{"a":' * levels + "1" + "}" * levels


# Raw JSON text: the body is written by hand, since json.dumps cannot write most of it.
BODY_VALUES = {
    "deep": st.builds(_deep, st.integers(65, 20_000), st.sampled_from(["list", "object"])),
    "text": hostile_text.map(json.dumps),
    "key": hostile_text.map(lambda key: json.dumps({key: [key]})),
    "number": st.sampled_from(["1e999", "-1e999", "1" * 5000, "1" + "0" * 400 + ".0"]),
    "extreme": extreme_value.map(json.dumps),
}
_PLACEHOLDER = "\u0001hostile\u0001"


@dataclass(frozen=True)
class Location:
    where: str  # "path", "query", "header" or "body"
    name: str | None  # None: the whole body


def locations(operation) -> list[Location]:
    found = [Location("path", p.name) for p in operation.path_parameters]
    found += [Location("query", p.name) for p in operation.query]
    found += [Location("header", p.name) for p in operation.headers]
    for body in operation.body:
        if body.media_type == "application/json":
            found += [Location("body", name) for name in body.definition["schema"]["properties"]]
            found.append(Location("body", None))
    return found


# The same kinds as fixed values, each sent to every location on every run.
KNOWN_TEXT = ["\x00", "a\x00b", "\ud800", "a\udfffb", "a/b", "\r\nX-Injected: 1", "x" * 10_000]
KNOWN_BODY = [
    _deep(5000, "list"),
    _deep(5000, "object"),
    _deep(65, "list"),
    '"\\u0000"',
    '"\\ud800"',
    '{"\\u0000": 1}',
    '{"a": ["\\udfff"]}',
    "1e999",
    "1" * 5000,
]


def known_values(location: Location) -> list[str]:
    if location.where == "body":
        return KNOWN_BODY + [json.dumps(value) for value in EXTREMES + KNOWN_TEXT]
    cursors = TAMPERED_CURSORS if location.name == "cursor" else []
    return KNOWN_TEXT + EXTREMES + cursors


def kinds_for(location: Location) -> dict:
    if location.where == "body":
        return BODY_VALUES
    if location.name == "cursor":
        return {**PARAMETER_VALUES, "cursor": tampered_cursor}
    return PARAMETER_VALUES


def _wire(text: str) -> str:
    return quote(text.encode("utf-8", "surrogatepass"), safe="")


@dataclass
class Hostile:
    """One request: the base case with one location's value replaced."""

    method: str
    path: dict
    query: dict
    headers: dict
    body: object  # a dict, or NOT_SET for an operation without one

    def send(self, client, path_template: str, location: Location, value: str):
        path = path_template
        for name, current in self.path.items():
            replaced = value if location == Location("path", name) else str(current)
            path = path.replace("{" + name + "}", _wire(replaced))
        query = {**self.query, **({location.name: value} if location.where == "query" else {})}
        if query:
            path += "?" + "&".join(f"{_wire(k)}={_wire(str(v))}" for k, v in query.items())
        headers = {**self.headers}
        if location.where == "header":
            # A WSGI server decodes header bytes as Latin-1: that is all a view can get.
            headers[location.name] = value.encode("utf-8", "surrogatepass").decode("latin-1")
        meta = {f"HTTP_{k.upper().replace('-', '_')}": v for k, v in headers.items()}
        body = b""
        if location.where == "body" or isinstance(self.body, dict):
            body = self.json_body(location, value).encode("utf-8", "surrogatepass")
        return client.generic(self.method, path, data=body, content_type="application/json", **meta)

    def json_body(self, location: Location, value: str) -> str:
        if location == Location("body", None):
            return value
        fields = dict(self.body) if isinstance(self.body, dict) else {}
        if location.where == "body":
            fields[location.name] = _PLACEHOLDER
        return json.dumps(fields, default=str).replace(json.dumps(_PLACEHOLDER), value)


def assert_below_500_in_the_one_error_shape(response, label: str, location, value) -> None:
    where = f"{label} with {location} = {value[:200]!r}"
    assert response.status_code < 500, where
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"}, where
        assert set(body["error"]) <= {"code", "message", "details"}, where
        assert isinstance(body["error"]["code"], str), where
        assert isinstance(body["error"]["message"], str), where


def send_hostile(base: Hostile, operation, location: Location, value: str) -> None:
    cache.clear()  # the per-key throttle: see the first test
    with transaction.atomic():
        try:
            response = base.send(Client(), operation.path, location, value)
        finally:
            transaction.set_rollback(True)
    assert_below_500_in_the_one_error_shape(response, operation.label, location, value)


def base_request(operation, key: str, ids: dict, *, path=None, query=None, headers=None, body):
    path = dict(path or {})
    if "id" in path or any(p.name == "id" for p in operation.path_parameters):
        # An existing row, so that the hostile value meets the view's own code.
        path["id"] = existing_id_for(operation.path, ids) or path.get("id", "x")
    return Hostile(
        method=operation.method.upper(),
        path=path,
        query=dict(query or {}),
        headers={**(headers or {}), "Authorization": f"Bearer {key}"},
        body=body,
    )


def valid_bodies() -> dict:
    """A valid JSON body per operation that takes one: the base the sweep varies."""
    return {
        "POST /api/v1/endpoints/": {"url": "https://example.com/hook", "headers": {"X-A": "1"}},
        "PATCH /api/v1/endpoints/{id}/": {"description": "d", "event_types": ["t"]},
        "POST /api/v1/endpoints/{id}/pause/": {"reason": "deploying"},
        "POST /api/v1/events/": {"event_type": "t", "payload": {"n": 1}, "entity_id": "e"},
        "POST /api/v1/deliveries/recover/": {"since": timezone.now().isoformat()},
        "POST /api/v1/portal-link/": {"ttl": 60},
    }


def test_the_sweep_has_a_valid_body_for_every_operation_that_takes_one():
    takes_one = {label for label, op in OPERATIONS.items() if list(op.body)}
    assert takes_one == set(valid_bodies())


@pytest.mark.parametrize("label", sorted(OPERATIONS))
def test_the_known_hostile_values_in_every_parameter_of_every_operation_get_a_4xx(
    label, api_tenant
):
    key, ids = api_tenant
    operation = OPERATIONS[label]
    base = base_request(operation, key, ids, body=valid_bodies().get(label, NOT_SET))
    for location in locations(operation):
        for value in known_values(location):
            send_hostile(base, operation, location, value)


@pytest.mark.parametrize("label", sorted(OPERATIONS))
@given(data=st.data())
@settings(
    max_examples=3,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
def test_generated_hostile_values_in_every_parameter_of_every_operation_get_a_4xx(
    label, data, api_tenant
):
    key, ids = api_tenant
    operation = OPERATIONS[label]
    case = data.draw(operation.as_strategy(GenerationMode.POSITIVE), label="base case")
    base = base_request(
        operation,
        key,
        ids,
        path=case.path_parameters,
        query=case.query,
        headers=case.headers,
        body=case.body,
    )
    for location in locations(operation):
        for kind, values in kinds_for(location).items():
            send_hostile(base, operation, location, data.draw(values, label=f"{location} {kind}"))
