"""Custom endpoint headers: one rule (``deliveries.core.headers``) for the API, the admin's
model form, the services, and the worker at send time."""

import json
import logging

import pytest
from django.contrib import admin
from django.core.exceptions import ValidationError
from django.test import RequestFactory

from deliveries import services
from deliveries.core.headers import sendable_headers, validate_endpoint_headers
from deliveries.models import Attempt, Delivery, Endpoint
from tests.conftest import drain
from tests.deliveries.test_api import client_for
from tests.reliability.test_hostile_egress import RawListener

pytestmark = pytest.mark.django_db

# (name, value, what the refusal names)
REFUSED = [
    ("X-A\r\nX-Injected", "1", "not a valid header name"),
    ("X-A\nX-Injected", "1", "not a valid header name"),
    ("X A", "v", "not a valid header name"),
    ("X-A:", "v", "not a valid header name"),
    ("", "v", "not a valid header name"),
    ("X-\x00", "v", "not a valid header name"),
    ("X-é", "v", "not a valid header name"),
    ("X-A", "v\r\nX-Injected: 1", "not a valid header value"),
    ("X-A", "v\n", "not a valid header value"),
    ("X-A", "v\r", "not a valid header value"),
    ("X-A", "v\x00", "not a valid header value"),
    ("X-A", "v\x7f", "not a valid header value"),
    ("X-A", "caf\u00e9", "not a valid header value"),
    ("Transfer-Encoding", "chunked", "framing or hop-by-hop"),
    ("transfer-encoding", "identity", "framing or hop-by-hop"),
    ("Content-Length", "5", "framing or hop-by-hop"),
    ("Connection", "close", "framing or hop-by-hop"),
    ("Host", "internal.example", "framing or hop-by-hop"),
    ("TE", "trailers", "framing or hop-by-hop"),
    ("Trailer", "X-Sig", "framing or hop-by-hop"),
    ("Upgrade", "h2c", "framing or hop-by-hop"),
    ("Keep-Alive", "timeout=5", "framing or hop-by-hop"),
    ("Proxy-Authorization", "Basic eDp5", "framing or hop-by-hop"),
    ("Proxy-Connection", "keep-alive", "framing or hop-by-hop"),
    ("Expect", "100-continue", "framing or hop-by-hop"),
    ("webhook-signature", "v1,forged", "set by the service"),
    ("Content-Type", "text/plain", "set by the service"),
    ("Idempotency-Key", "k", "set by the service"),
]
ALLOWED = {
    "Authorization": "Bearer abc.def",
    "X-Token": "a b\tc",
    "X-Custom_Name.1": "~!#$%^&*()[]{}<>?/",
    "User-Agent": "acme-relay/2",
}


@pytest.mark.parametrize("name, value, reason", REFUSED)
def test_the_rule_refuses_each_header_and_says_why(name, value, reason):
    with pytest.raises(ValidationError) as refused:
        validate_endpoint_headers({**ALLOWED, name: value})

    assert reason in " ".join(refused.value.messages)


def test_a_refusal_never_quotes_the_value_which_may_be_a_credential():
    with pytest.raises(ValidationError) as refused:
        validate_endpoint_headers({"Authorization": "Bearer s3cret\r\nX-Injected: 1"})

    assert "Authorization" in str(refused.value) and "s3cret" not in str(refused.value)


def test_the_rule_accepts_ordinary_headers():
    validate_endpoint_headers(ALLOWED)
    assert sendable_headers(ALLOWED) == (ALLOWED, [])


@pytest.mark.parametrize(
    "headers, reason",
    [
        ({"X-A": "1", "x-a": "2"}, "more than once"),
        ({f"X-{i}": "v" for i in range(21)}, "at most 20"),
        ({"X-A": 5}, "must be text"),
        ({"X-A": None}, "must be text"),
        (["X-A", "v"], "must be an object"),
        ({"X-" + "a" * 300: "v"}, "not a valid header name"),
        ({"X-A": "v" * 1001}, "at most 1000 characters"),
    ],
)
def test_the_rule_refuses_duplicates_too_many_and_what_is_not_text(headers, reason):
    with pytest.raises(ValidationError) as refused:
        validate_endpoint_headers(headers)

    assert reason in " ".join(refused.value.messages)


@pytest.mark.parametrize("name, value, reason", REFUSED)
def test_the_api_refuses_them_on_create_and_update_and_writes_nothing(name, value, reason):
    client, _tenant, _key = client_for("headers")
    created = client.post(
        "/api/v1/endpoints/",
        {"url": "https://example.com/h", "headers": {"X-Ok": "1"}},
        format="json",
    ).json()

    response = client.post(
        "/api/v1/endpoints/",
        {"url": "https://example.com/h", "headers": {name: value}},
        format="json",
    )
    update = client.patch(
        f"/api/v1/endpoints/{created['id']}/", {"headers": {name: value}}, format="json"
    )

    for answer in (response, update):
        assert answer.status_code == 400, answer.content[:300]
        error = answer.json()["error"]
        if "\x00" in name + value:  # the API's JSON parser refuses NUL anywhere first
            assert error["code"] == "parse_error"
        else:
            assert error["code"] == "invalid"
            assert reason in json.dumps(error["details"]["headers"])
    assert Endpoint.objects.count() == 1
    assert Endpoint.objects.get().headers == {"X-Ok": "1"}


@pytest.mark.parametrize("name, value, reason", REFUSED[::3])
def test_the_services_and_the_model_refuse_them_for_every_other_writer(name, value, reason, tenant):
    with pytest.raises(services.DomainError, match="headers"):
        services.endpoint_create(tenant=tenant, url="https://example.com/h", headers={name: value})
    endpoint, _ = services.endpoint_create(tenant=tenant, url="https://example.com/h")
    with pytest.raises(services.DomainError, match="headers"):
        services.endpoint_update(endpoint=endpoint, headers={name: value})

    endpoint.headers = {name: value}
    with pytest.raises(ValidationError) as refused:
        endpoint.full_clean()
    assert set(refused.value.message_dict) == {"headers"}
    assert Endpoint.objects.get().headers == {}


@pytest.mark.parametrize("name, value, reason", REFUSED[::3])
def test_the_admin_endpoint_form_refuses_them(name, value, reason, tenant, admin_user):
    request = RequestFactory().get("/admin/deliveries/endpoint/add/")
    request.user = admin_user
    form_class = admin.site._registry[Endpoint].get_form(
        request, fields=["tenant", "url", "event_types", "headers"]
    )
    data = {"tenant": str(tenant.id), "url": "https://example.com/h", "event_types": "[]"}

    refused = form_class(data={**data, "headers": json.dumps({name: value})})
    accepted = form_class(data={**data, "headers": json.dumps(ALLOWED)})

    assert not refused.is_valid()
    assert reason in " ".join(refused.errors["headers"])
    assert accepted.is_valid(), accepted.errors


# Rows written before the rule existed, each bad value under a name of its own (PostgreSQL
# cannot hold the NUL ones): the headers that speak for the HTTP client or the protocol,
# which aiohttp would send as given, and the ones that are no valid HTTP, which it refuses
# (and with them the whole request).
STORED = {
    "framing": {name: value for name, value, r in REFUSED if "valid header" not in r},
    "not HTTP": {
        (f"X-Bad-{i}" if name == "X-A" else name): value
        for i, (name, value, r) in enumerate(REFUSED)
        if "valid header" in r and "\x00" not in name + value
    },
}


@pytest.mark.parametrize("kind", STORED)
@pytest.mark.django_db(transaction=True)
def test_at_send_time_stored_forbidden_headers_are_dropped_recorded_and_never_sent(
    kind, tenant, caplog
):
    stored = STORED[kind]
    with RawListener() as listener:
        endpoint, _secret = services.endpoint_create(
            tenant=tenant,
            url=f"http://127.0.0.1:{listener.port}/hook",
            headers={"X-Good": "yes", "Authorization": "Bearer s3cret"},
        )
        # As a row written before validation would hold them (no validator runs here).
        Endpoint.objects.filter(id=endpoint.id).update(
            headers={**stored, "X-Good": "yes", "Authorization": "Bearer s3cret"}
        )
        event = services.publish_event(tenant=tenant, event_type="t", payload={"n": 1})
        with caplog.at_level(logging.WARNING, logger="deliveries.worker"):
            drain()

    [raw] = listener.requests
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = [line.split(":", 1) for line in lines[1:]]
    names = [name.strip().lower() for name, _ in headers]
    sent = {name.strip().lower(): value.strip() for name, value in headers}
    assert body == bytes(event.body)
    assert "transfer-encoding" not in names
    assert names.count("content-length") == 1 and sent["content-length"] == str(len(body))
    assert names.count("host") == 1 and sent["host"] == f"127.0.0.1:{listener.port}"
    for forbidden in ("connection", "te", "trailer", "upgrade", "keep-alive", "expect"):
        assert forbidden not in names
    assert not [n for n in names if n.startswith("proxy-")]
    assert "x-injected" not in names and "injected" not in head.decode("latin-1").lower()
    assert sent["x-good"] == "yes" and sent["authorization"] == "Bearer s3cret"
    assert sent["content-type"] == "application/json"
    assert sent["webhook-signature"].startswith("v1,")

    delivery = Delivery.objects.get(event=event)
    assert delivery.state == "succeeded"
    attempt = Attempt.objects.get(delivery=delivery)
    dropped = {k for k, v in attempt.request_headers.items() if v == "[dropped]"}
    assert dropped == set(stored)
    assert attempt.request_headers["X-Good"] == "[redacted]"
    [warning] = [r for r in caplog.records if getattr(r, "action", "") == "workers.headers_dropped"]
    assert warning.endpoint_id == str(endpoint.id)
    assert sorted(warning.headers) == sorted(stored)
    assert "s3cret" not in caplog.text and "chunked" not in caplog.text
