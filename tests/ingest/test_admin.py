"""The inbound event page: the body as received and the headers, with what the source's
redaction rules (and the console's own) say is masked, and nothing it cannot mask."""

import html
import json

import pytest
from django.urls import reverse
from django.utils import timezone

from ingest.models import InboundEvent, Source
from ingest.receiving import NewEvent, inbound_store_many
from ingest.selectors import BODY_SHOWN_CHARS, body_shown, headers_shown
from ingest.sources import source_create

pytestmark = pytest.mark.django_db


@pytest.fixture
def shop():
    return source_create(slug="shop", scheme="standard", secrets=["whsec_" + "c2VjcmV0" * 4])


def store(source: Source, body: bytes, headers: dict | None = None) -> InboundEvent:
    inbound_store_many(
        source=source, events=[NewEvent("evt_1", "order.created", "order_1", timezone.now(), body)]
    )
    event = InboundEvent.objects.get()
    if headers is not None:
        InboundEvent.objects.filter(id=event.id).update(headers=headers)
        event.refresh_from_db()
    return event


def test_the_event_page_shows_the_body_and_headers_with_the_sources_keys_masked(shop, admin_client):
    Source.objects.filter(id=shop.id).update(redact_keys=["Email", "x-shop-token"])
    shop.refresh_from_db()
    body = {
        "order": {"id": 7, "email": "buyer@example.com", "total": "42.00"},
        "customer": [{"Password": "hunter2", "card_number": "4242424242424242", "name": "Ann"}],
    }
    event = store(
        shop,
        json.dumps(body).encode(),
        {"content-type": "application/json", "x-shop-token": "tok-123", "x-shop-domain": "acme"},
    )

    page = admin_client.get(reverse("admin:ingest_inboundevent_change", args=[event.id]))
    assert page.status_code == 200
    content = html.unescape(page.content.decode())
    for secret in ("buyer@example.com", "hunter2", "4242424242424242", "tok-123"):
        assert secret not in content
    assert "[redacted]" in content and '"total": "42.00"' in content and "Ann" in content
    assert "x-shop-domain: acme" in content and "x-shop-token: [redacted]" in content
    assert "bytes" in content


def test_form_data_is_masked_field_by_field_and_json_inside_a_field_too(shop):
    from urllib.parse import quote

    payload = json.dumps({"token": "xoxb-secret", "user": {"name": "ann"}})
    body = b"team_id=T1&token=verification-token&payload=" + quote(payload).encode()
    event = store(shop, body, {"content-type": "application/x-www-form-urlencoded"})
    shown = body_shown(event, shop)
    assert "verification-token" not in shown.text and "xoxb-secret" not in shown.text
    assert "team_id=T1" in shown.text and '"name": "ann"' in shown.text
    assert shown.text.count("[redacted]") == 2


def test_a_body_that_cannot_be_masked_field_by_field_is_not_shown(shop, admin_client):
    event = store(shop, b"card=4242424242424242; not json", {"content-type": "text/plain"})
    shown = body_shown(event, shop)
    assert shown.text == "" and "not JSON or form data" in shown.note
    page = admin_client.get(reverse("admin:ingest_inboundevent_change", args=[event.id]))
    assert b"4242424242424242" not in page.content and b"not JSON or form data" in page.content


def test_a_long_body_is_cut_and_says_so(shop):
    event = store(shop, json.dumps({"items": ["x" * 100] * 400}).encode())
    shown = body_shown(event, shop)
    assert len(shown.text) == BODY_SHOWN_CHARS
    assert f"the first {BODY_SHOWN_CHARS:,} characters shown" in shown.note


def test_headers_are_sorted_and_the_consoles_own_keys_masked(shop):
    event = store(shop, b"{}", {"X-B": "2", "Cookie": "sid=1", "a": "1"})
    assert headers_shown(event, shop) == {"Cookie": "[redacted]", "X-B": "2", "a": "1"}
