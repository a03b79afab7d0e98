"""The event catalogue: prefix wildcards in endpoint filters, payloads checked against
their type's JSON Schema at publish (reject, warn, off), and GET /api/v1/event-types/."""

import json
import logging

import pytest
from django.core.exceptions import ValidationError
from rest_framework.test import APIClient

from deliveries import catalogue, services
from deliveries.models import Delivery, Endpoint, Event, EventType, EventTypeVersion
from tests.conftest import scrape, value

INVOICE_SCHEMA = {
    "type": "object",
    "required": ["invoice_id", "amount"],
    "properties": {
        "invoice_id": {"type": "string"},
        "amount": {"type": "integer", "minimum": 0},
        "lines": {
            "type": "array",
            "items": {"type": "object", "properties": {"sku": {"type": "string"}}},
        },
    },
}


def catalogued(name="invoice.paid", *, validation="reject", versions=None):
    event_type = EventType.objects.create(
        name=name, owner="billing", description="An invoice was paid.", validation=validation
    )
    for version, schema in (versions or {1: INVOICE_SCHEMA}).items():
        EventTypeVersion.objects.create(
            event_type=event_type,
            version=version,
            schema=schema,
            example={"invoice_id": "in_1", "amount": 42},
        )
    return event_type


# --- Wildcard filters ---------------------------------------------------------------------


@pytest.mark.sqlite
@pytest.mark.django_db
def test_a_prefix_wildcard_selects_every_type_under_the_prefix_and_nothing_else(tenant):
    group, _ = services.endpoint_create(
        tenant=tenant, url="https://example.com/group", event_types=["invoice.*"]
    )
    deep, _ = services.endpoint_create(
        tenant=tenant, url="https://example.com/deep", event_types=["invoice.payment.*"]
    )
    exact, _ = services.endpoint_create(
        tenant=tenant, url="https://example.com/exact", event_types=["invoice.paid", "x.*"]
    )
    every, _ = services.endpoint_create(tenant=tenant, url="https://example.com/all")

    def receivers(event_type: str) -> set[str]:
        event = services.publish_event(tenant=tenant, event_type=event_type, payload={})
        ids = Delivery.objects.filter(event=event).values_list("endpoint_id", flat=True)
        return {Endpoint.objects.get(id=i).url.rsplit("/", 1)[1] for i in ids}

    assert receivers("invoice.paid") == {"group", "exact", "all"}
    assert receivers("invoice.payment.failed") == {"group", "deep", "all"}
    assert receivers("invoice") == {"all"}  # the prefix itself is not under it
    assert receivers("invoices.paid") == {"all"}  # nor a longer word
    assert receivers("customer.invoice.paid") == {"all"}
    assert receivers("x.y") == {"exact", "all"}
    # The model's rule is the one the statement applies.
    for endpoint in (group, deep, exact, every):
        assert endpoint.subscribes_to("invoice.payment.failed") == (
            endpoint in (group, deep, every)
        )


def test_filter_patterns_are_the_name_and_each_prefix_wildcard():
    assert catalogue.filter_patterns("a.b.c") == ["a.b.c", "a.*", "a.b.*"]
    assert catalogue.filter_patterns("ping") == ["ping"]
    assert catalogue.group_of("a.b.c") == "a.b" and catalogue.group_of("ping") == ""


BAD_FILTERS = ["inv*", "*", "*.paid", ".*", "invoice.*.paid", "invoice..*", " ", "a*.*"]


@pytest.mark.django_db
@pytest.mark.parametrize("pattern", BAD_FILTERS)
def test_a_filter_that_could_never_match_is_refused_everywhere(tenant, pattern):
    _, key = services.api_key_create(tenant=tenant)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    r = client.post(
        "/api/v1/endpoints/",
        {"url": "https://example.com/h", "event_types": ["ok.type", pattern]},
        format="json",
    )
    assert r.status_code == 400, r.content
    said = json.dumps(r.json()["error"]["details"]["event_types"])
    assert repr(pattern) in said or (not pattern.strip() and "blank" in said), said
    with pytest.raises(services.DomainError, match="event_types"):
        services.endpoint_create(tenant=tenant, url="https://example.com/h", event_types=[pattern])
    endpoint = Endpoint(tenant=tenant, url="https://example.com/h", event_types=[pattern])
    with pytest.raises(ValidationError):
        endpoint.full_clean()
    assert not Endpoint.objects.exists()


@pytest.mark.django_db
def test_a_published_type_may_not_hold_the_wildcard(tenant):
    with pytest.raises(services.DomainError, match=r"must not hold \*"):
        services.publish_event(tenant=tenant, event_type="invoice.*", payload={})
    assert not Event.objects.exists()


# --- Schemas at publish ---------------------------------------------------------------


@pytest.mark.django_db
def test_reject_refuses_a_payload_naming_the_failing_path_and_writes_nothing(tenant):
    catalogued()
    services.endpoint_create(tenant=tenant, url="https://example.com/h")
    with pytest.raises(services.PayloadInvalid) as refused:
        services.publish_event(
            tenant=tenant,
            event_type="invoice.paid",
            payload={"invoice_id": "in_1", "amount": 1, "lines": [{"sku": 7}]},
        )
    assert refused.value.details["path"] == "$.lines[0].sku"
    assert "$.lines[0].sku: 7 is not of type 'string'" in refused.value.message
    with pytest.raises(services.PayloadInvalid) as missing:
        services.publish_event(
            tenant=tenant, event_type="invoice.paid", payload={"invoice_id": "in_1"}
        )
    assert missing.value.details["path"] == "$.amount"
    assert missing.value.message.endswith("$.amount: is required")
    assert not Event.objects.exists() and not Delivery.objects.exists()
    # A matching payload goes through.
    services.publish_event(
        tenant=tenant, event_type="invoice.paid", payload={"invoice_id": "in_1", "amount": 5}
    )
    assert Delivery.objects.count() == 1


@pytest.mark.django_db
def test_reject_refuses_a_version_the_catalogue_does_not_have(tenant):
    catalogued(versions={1: INVOICE_SCHEMA, 2: {"type": "object"}})
    with pytest.raises(services.PayloadInvalid, match=r"no payload version 3 \(versions: 1, 2\)"):
        services.publish_event(
            tenant=tenant, event_type="invoice.paid", payload={}, payload_version=3
        )
    event = services.publish_event(
        tenant=tenant, event_type="invoice.paid", payload={}, payload_version=2
    )
    assert event.payload_version == 2


@pytest.mark.django_db
def test_warn_publishes_and_logs_the_path_but_never_the_value(tenant, caplog):
    catalogued(validation="warn")
    before = value(
        scrape(), "webhooks_event_schema_mismatches_total", event_type="invoice.paid", mode="warn"
    )
    with caplog.at_level(logging.WARNING, logger="deliveries.services"):
        event = services.publish_event(
            tenant=tenant,
            event_type="invoice.paid",
            payload={"invoice_id": "in_1", "amount": "secret-amount-77"},
        )
    assert Event.objects.filter(id=event.id).exists()
    (record,) = [r for r in caplog.records if getattr(r, "action", "") == "event.schema_mismatch"]
    assert record.path == "$.amount" and record.event_type == "invoice.paid"
    assert "'type'" in record.reason
    assert "secret-amount-77" not in repr(vars(record))
    after = value(
        scrape(), "webhooks_event_schema_mismatches_total", event_type="invoice.paid", mode="warn"
    )
    assert after == before + 1


@pytest.mark.django_db
def test_off_and_uncatalogued_types_are_not_checked(tenant):
    catalogued(validation="off")
    services.publish_event(tenant=tenant, event_type="invoice.paid", payload={"amount": "x"})
    services.publish_event(tenant=tenant, event_type="not.catalogued", payload={"amount": "x"})
    assert Event.objects.count() == 2


@pytest.mark.django_db
def test_a_catalogue_change_in_this_process_applies_to_the_next_publish(tenant, settings):
    settings.EVENT_SCHEMA_CACHE_SECONDS = 3600
    services.publish_event(tenant=tenant, event_type="invoice.paid", payload={"amount": "x"})
    catalogued()  # cached as uncatalogued a moment ago; the save clears the cache
    with pytest.raises(services.PayloadInvalid):
        services.publish_event(tenant=tenant, event_type="invoice.paid", payload={"amount": "x"})
    EventType.objects.filter(name="invoice.paid").first().delete()
    services.publish_event(tenant=tenant, event_type="invoice.paid", payload={"amount": "x"})


@pytest.mark.django_db
def test_the_api_answers_a_refused_payload_with_422_and_the_path(tenant):
    catalogued()
    _, key = services.api_key_create(tenant=tenant)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    r = client.post(
        "/api/v1/events/",
        {"event_type": "invoice.paid", "payload": {"invoice_id": "in_1", "amount": -1}},
        format="json",
    )
    assert r.status_code == 422, r.content
    error = r.json()["error"]
    assert error["code"] == "payload_invalid"
    assert error["details"]["path"] == "$.amount"
    assert error["details"]["schema_path"] == "/properties/amount/minimum"
    assert not Event.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("schema", "example", "field"),
    [
        ({"type": "nonsense"}, {}, "schema"),
        ([], {}, "schema"),
        ({"type": "object", "required": ["a"]}, {}, "example"),
    ],
)
def test_the_catalogue_refuses_a_bad_schema_and_an_example_that_does_not_match(
    schema, example, field
):
    event_type = EventType.objects.create(name="invoice.paid")
    version = EventTypeVersion(event_type=event_type, schema=schema, example=example)
    with pytest.raises(ValidationError) as refused:
        version.full_clean()
    assert field in refused.value.message_dict


@pytest.mark.django_db
def test_an_event_type_name_may_not_hold_the_wildcard():
    with pytest.raises(ValidationError) as refused:
        EventType(name="invoice.*").full_clean()
    assert "name" in refused.value.message_dict


# --- GET /api/v1/event-types/ --------------------------------------------------------------


@pytest.mark.django_db
def test_the_catalogue_route_lists_types_with_schemas_and_examples(tenant):
    catalogued(versions={1: INVOICE_SCHEMA, 2: {"type": "object"}})
    catalogued("invoice.voided", validation="warn")
    catalogued("customer.deleted", validation="off")
    # The service's own types (migration 0030) may be there, or flushed by an earlier test.
    EventType.objects.filter(name__startswith="endpoint.").delete()
    _, key = services.api_key_create(tenant=tenant)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")

    body = client.get("/api/v1/event-types/").json()
    assert [t["name"] for t in body["results"]] == [
        "customer.deleted",
        "invoice.paid",
        "invoice.voided",
    ]
    paid = body["results"][1]
    assert paid["group"] == "invoice" and paid["owner"] == "billing"
    assert paid["validation"] == "reject"
    assert [v["version"] for v in paid["versions"]] == [1, 2]
    assert paid["versions"][0]["schema"] == INVOICE_SCHEMA
    assert paid["versions"][0]["example"] == {"invoice_id": "in_1", "amount": 42}

    grouped = client.get("/api/v1/event-types/", {"group": "invoice"}).json()
    assert [t["name"] for t in grouped["results"]] == ["invoice.paid", "invoice.voided"]
    first = client.get("/api/v1/event-types/", {"limit": 2}).json()
    rest = client.get(first["next"]).json()
    assert [t["name"] for t in first["results"] + rest["results"]] == [
        "customer.deleted",
        "invoice.paid",
        "invoice.voided",
    ]
    assert client.get("/api/v1/event-types/", {"page_size": 2}).status_code == 400
    assert APIClient().get("/api/v1/event-types/").status_code == 401
