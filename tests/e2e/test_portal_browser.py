"""A customer's whole story in the portal, in headless Chromium through a signed link.

The host mints a link; the customer opens it, adds an endpoint (picking a group from the
catalogue), copies the secret shown once, sends a test event and sees it delivered; the
receiver breaks, and the customer sees the retries and the sentence saying where the
delivery stands, with the receiver's answer; the receiver is fixed, the customer replays
it and sees it succeed, then rotates the secret. The app runs on pytest-django's
``live_server``; deliveries go through the real scheduler, relay and workers to a real
local receiver. Every log line of the run is captured: the link's token is in none.
Screenshots of each step go to ``test-output/portal/``.
"""

import json
import re

import pytest
from playwright.sync_api import Page, expect
from standardwebhooks.webhooks import Webhook

from deliveries import services
from deliveries.models import AuditEntry, Delivery, EventType, EventTypeVersion
from deliveries.portal import portal_url
from tests.conftest import drain, make_due
from tests.e2e.browser import TEST_OUTPUT, chromium_page, in_a_thread
from tests.e2e.test_no_secrets_in_logs import assert_clean, captured  # noqa: F401 (a fixture)
from tests.receiver import always

SCREENSHOTS = TEST_OUTPUT / "portal"

pytestmark = pytest.mark.slow


def shot(page: Page, name: str) -> None:
    page.screenshot(path=SCREENSHOTS / f"{name}.png", full_page=True)


@pytest.mark.django_db(transaction=True)
def test_a_customer_runs_its_webhooks_from_the_portal(
    live_server,
    settings,
    tenant,
    receiver,
    captured,  # noqa: F811 (the fixture imported above)
):
    # The live server speaks plain HTTP: no secure-only cookies.
    settings.SESSION_COOKIE_SECURE = False
    settings.CSRF_COOKIE_SECURE = False
    # Failures wait an hour: the test moves the clock (make_due) when it wants a retry.
    settings.DELIVERY_RETRY_SCHEDULE = [3600, 3600, 3600]
    settings.PORTAL_TITLE = "Acme webhooks"
    settings.PORTAL_COLORS = {"accent": "#8a2be2"}
    receiver.behaviours["/hook"] = always(200)
    paid = EventType.objects.create(
        name="invoice.paid", owner="billing", description="An invoice was paid in full."
    )
    EventTypeVersion.objects.create(
        event_type=paid,
        schema={"type": "object", "required": ["invoice_id"]},
        example={"invoice_id": "in_1029", "amount": 4200},
    )
    EventType.objects.create(name="invoice.voided", description="An invoice was voided.")
    url = portal_url(tenant, ttl=120, base_url=live_server.url)
    token = url.split("#")[1]
    portal = live_server.url + "/portal/"

    with chromium_page(SCREENSHOTS) as page:
        # The link: the entry page posts the token from the fragment, then the portal.
        page.goto(url)
        page.wait_for_url(portal)
        assert "#" not in page.url
        expect(page.locator("h1")).to_have_text("Your endpoints")
        assert "Acme webhooks" in page.locator("header").inner_text()
        # The first Tab reaches the skip link, which moves the focus to the content.
        page.keyboard.press("Tab")
        assert page.evaluate("document.activeElement.textContent") == "Skip to content"
        shot(page, "01-signed-in")

        # Add an endpoint, picking the invoice group from the catalogue.
        page.get_by_role("link", name="Add an endpoint").click()
        page.get_by_label("URL").fill(receiver.url("/hook"))
        page.get_by_label("Description").fill("Billing sync")
        page.get_by_label("Every invoice event (invoice.*)").check()
        page.get_by_label("Rate limit (requests per second)").fill("10")
        shot(page, "02-add-an-endpoint")
        page.get_by_role("button", name="Add the endpoint").click()
        expect(page.locator("h1")).to_have_text("Endpoint added")
        first_secret = page.get_by_role("textbox", name="Signing secret").input_value()
        assert first_secret.startswith("whsec_")
        shot(page, "03-secret-shown-once")

        # A test send: its delivery's page follows it until it is delivered.
        page.get_by_role("button", name="Send a test event").click()
        page.wait_for_url(re.compile(r"/portal/deliveries/[0-9a-f-]+/$"))
        in_a_thread(drain)
        expect(page.locator("#delivery-state")).to_have_text("succeeded", timeout=15_000)
        expect(page.locator("#delivery-sentence")).to_contain_text("with HTTP 200")
        shot(page, "04-test-event-delivered")

        # The receiver breaks; an invoice is paid; the pipeline tries twice.
        receiver.behaviours["/hook"] = always(500, body=b"database is down")
        in_a_thread(
            lambda: services.publish_event(
                tenant=tenant, event_type="invoice.paid", payload={"invoice_id": "in_7"}
            )
        )
        in_a_thread(drain)
        in_a_thread(make_due)
        in_a_thread(drain)

        page.get_by_role("link", name="Deliveries", exact=True).click()
        page.get_by_label("Event type").fill("invoice.paid")
        page.get_by_role("button", name="Filter").click()
        rows = page.locator("tbody tr")
        expect(rows).to_have_count(1)
        expect(rows.first).to_contain_text("Waiting by policy until")
        shot(page, "05-history-filtered")
        rows.first.get_by_role("link", name="invoice.paid").click()
        expect(page.locator("#delivery-sentence")).to_contain_text(
            "after HTTP 500 (failed, retried)"
        )
        attempts = page.locator("#attempts > li")
        expect(attempts).to_have_count(2)
        expect(attempts.nth(1)).to_contain_text("HTTP 500")
        expect(attempts.nth(1)).to_contain_text("database is down")
        expect(attempts.nth(1)).to_contain_text("ms")
        # The request headers as the receiver got them (the signature is not kept).
        attempts.nth(1).get_by_text("Request headers").click()
        delivery_id = page.url.rstrip("/").rsplit("/", 1)[1]
        headers = attempts.nth(1).locator("pre").first
        for line in (
            "content-type: application/json",
            f"webhook-id: {delivery_id}",
            "webhook-timestamp: ",
            "webhook-signature: [not stored]",
            f"idempotency-key: {delivery_id}",
        ):
            expect(headers).to_contain_text(line)
        shot(page, "06-retries-and-the-status-sentence")

        # Fixed: replay, and the page follows it to success.
        receiver.behaviours["/hook"] = always(200)
        page.get_by_role("button", name="Replay").click()
        expect(page.locator("#delivery-state")).to_have_text("pending")
        in_a_thread(drain)
        expect(page.locator("#delivery-state")).to_have_text("succeeded", timeout=15_000)
        expect(page.locator("#attempts > li")).to_have_count(3)
        shot(page, "07-replayed-and-delivered")

        # Rotate the secret, keeping the old one signing for a day.
        page.locator("#delivery-live").get_by_role("link", name=receiver.url("/hook")).click()
        expect(page.locator("h1")).to_have_text("Endpoint")
        page.get_by_label("Keep the current secret signing for").select_option("24")
        page.get_by_role("button", name="Rotate the secret").click()
        expect(page.locator("h1")).to_have_text("New signing secret")
        second_secret = page.get_by_role("textbox", name="Signing secret").input_value()
        assert second_secret.startswith("whsec_") and second_secret != first_secret
        expect(page.locator("main")).to_contain_text("keeps signing beside it until")
        shot(page, "08-secret-rotated")

        page.get_by_role("link", name="Event types").click()
        expect(page.locator("main")).to_contain_text('"invoice_id": "in_1029"')
        shot(page, "09-catalogue")
        page.get_by_role("link", name="Verifying signatures").click()
        expect(page.locator("h2#lang-python")).to_have_text("Python")
        shot(page, "10-verifying-signatures")

    # What the receiver got matches the pages: the test event, the invoice three times
    # with one webhook-id, each verifiable with the secret the portal showed.
    copies = receiver.requests_to("/hook")
    assert [json.loads(c.body).get("invoice_id") for c in copies] == [None, "in_7", "in_7", "in_7"]
    invoice = Delivery.objects.get(event__event_type="invoice.paid")
    assert {c.webhook_id for c in copies[1:]} == {str(invoice.id)}
    assert Webhook(first_secret).verify(copies[-1].body, copies[-1].headers)
    assert list(
        AuditEntry.objects.filter(details__via="portal").values_list("action", flat=True)
    ) == ["delivery.replay", "endpoint.rotate_secret"]
    # The link's token appears in no log line of the whole run, the server's included.
    assert any("/portal/enter/" in line for line in captured.lines)
    assert_clean(captured, token)
