"""The operator's console in a real browser: headless Chromium, driven by Playwright.

An operator logs in, narrows the delivery log with the filter sidebar, opens a delivery
that failed once, replays it, and sees the new attempt in its timeline after the pipeline
has sent it again. The app runs on pytest-django's ``live_server``; the deliveries go
through the real scheduler, relay and workers to the real local receiver.

The browser is Debian's ``chromium`` package (``make test`` installs it); Playwright's own
browser download is never used. A screenshot of each step is saved under
``test-output/admin-browser/`` to show what the operator saw.
"""

import re

import pytest
from django.contrib.auth import get_user_model
from playwright.sync_api import Page

from deliveries import services
from deliveries.models import Attempt, AuditEntry, Delivery, EventType
from tests.conftest import drain
from tests.e2e.browser import TEST_OUTPUT, chromium_page, in_a_thread
from tests.receiver import always, fail_first

SCREENSHOTS = TEST_OUTPUT / "admin-browser"
PASSWORD = "correct-horse-battery-staple"

pytestmark = pytest.mark.slow


def drain_in_a_thread() -> None:
    in_a_thread(drain)


def shot(page: Page, name: str) -> None:
    page.screenshot(path=SCREENSHOTS / f"{name}.png", full_page=True)


@pytest.mark.django_db(transaction=True)
def test_an_operator_replays_a_failed_delivery_and_sees_the_new_attempt(
    live_server, settings, tenant, receiver
):
    # The live server speaks plain HTTP; the production default of secure-only cookies
    # would keep the session and CSRF cookies out of every request after the login.
    settings.SESSION_COOKIE_SECURE = False
    settings.CSRF_COOKIE_SECURE = False
    # The failed attempt's retry waits an hour, so only the replay can send it again now.
    settings.DELIVERY_RETRY_SCHEDULE = [3600]

    receiver.behaviours["/flaky"] = fail_first(1)
    receiver.behaviours["/ok"] = always(200)
    EventType.objects.create(name="invoice.paid")
    EventType.objects.create(name="invoice.voided")
    flaky, _ = services.endpoint_create(
        tenant=tenant, url=receiver.url("/flaky"), event_types=["invoice.paid"]
    )
    services.endpoint_create(tenant=tenant, url=receiver.url("/ok"), event_types=["invoice.voided"])
    paid = services.publish_event(tenant=tenant, event_type="invoice.paid", payload={"n": 1})
    services.publish_event(tenant=tenant, event_type="invoice.voided", payload={"n": 2})
    drain()
    delivery = Delivery.objects.get(event=paid)
    assert delivery.state == "pending"
    assert delivery.endpoint_id == flaky.id
    assert Delivery.objects.filter(state="succeeded").count() == 1
    get_user_model().objects.create_superuser("operator", "operator@example.com", PASSWORD)

    admin = live_server.url + "/admin/"
    detail = admin + f"deliveries/delivery/{delivery.id}/change/"
    with chromium_page(SCREENSHOTS) as page:
        page.goto(admin + "login/?next=/admin/")
        page.fill("#id_username", "operator")
        page.fill("#id_password", PASSWORD)
        shot(page, "01-login")
        page.click("input[type=submit]")
        page.wait_for_url(admin)
        assert page.locator("#user-tools").inner_text().upper().startswith("WELCOME, OPERATOR")

        page.locator("#content-main").get_by_role("link", name="Deliveries", exact=True).click()
        page.wait_for_url(admin + "deliveries/delivery/")
        rows = page.locator("#result_list tbody tr")
        assert rows.count() == 2
        shot(page, "02-delivery-log")

        sidebar = page.locator("#changelist-filter")
        sidebar.locator("details[data-filter-title='state']").get_by_role(
            "link", name="Pending", exact=True
        ).click()
        page.wait_for_url(re.compile(r"state__exact=pending"))
        sidebar.locator("details[data-filter-title='event type']").get_by_role(
            "link", name="invoice.paid", exact=True
        ).click()
        page.wait_for_url(re.compile(r"event_type=invoice\.paid"))
        assert "state__exact=pending" in page.url
        assert rows.count() == 1
        endpoint = rows.first.locator("td.field-endpoint_url")
        assert endpoint.inner_text().split() == ["127.0.0.1:" + str(receiver.port), "/flaky"]
        assert endpoint.locator("span[title]").get_attribute("title") == receiver.url("/flaky")
        assert rows.first.locator("td.field-badge").inner_text() == "pending"
        shot(page, "03-filtered-to-the-pending-delivery")

        rows.first.locator("th.field-id a").click()
        # The link keeps the filters in ?_changelist_filters= for the way back.
        page.wait_for_url(re.compile("^" + re.escape(detail)))
        where = page.locator(".field-where_it_stands .readonly")
        assert where.inner_text().startswith("Waiting by policy until")
        assert "after HTTP 500 (failed, retried)" in where.inner_text()
        timeline = page.locator("#attempts-group tbody tr.form-row")
        assert timeline.count() == 1
        assert timeline.nth(0).locator("td.field-answer").inner_text() == "HTTP 500"
        shot(page, "04-delivery-failed-once")

        # The Replay button asks first, as the bulk action does: invoice.paid is not
        # marked replay-safe, so the extra box too; then back to this same page.
        page.click("#replay-delivery")
        assert page.locator("h2").first.inner_text() == "Replay 1 delivery?"
        shot(page, "05-confirm-the-replay")
        page.check("#unsafe-confirmed")
        with page.expect_navigation(url=detail):
            page.click("#confirm-replay")
        assert "1 of 1 deliveries returned to pending" in page.locator(".messagelist").inner_text()
        assert where.inner_text().startswith("Due since")
        shot(page, "06-replayed")

        drain_in_a_thread()
        page.reload()
        assert where.inner_text().startswith("Succeeded at")
        assert "with HTTP 200 after 2 attempt(s)" in where.inner_text()
        assert timeline.count() == 2
        assert [timeline.nth(i).locator("td.field-answer").inner_text() for i in (0, 1)] == [
            "HTTP 500",
            "HTTP 200",
        ]
        assert timeline.nth(1).locator("td.field-result").inner_text() == "delivered"
        shot(page, "07-new-attempt-in-the-timeline")

    # The browser's view matches the database, the replay is audited under the operator's
    # name, and the receiver saw one webhook-id twice.
    assert list(
        Attempt.objects.filter(delivery=delivery).order_by("number").values_list("status_code")
    ) == [(500,), (200,)]
    replays = AuditEntry.objects.filter(action="delivery.replay")
    assert list(replays.values_list("actor__username", "count", "details__via")) == [
        ("operator", 1, "admin")
    ]
    assert {r.webhook_id for r in receiver.requests_to("/flaky")} == {str(delivery.id)}
    assert len(receiver.requests_to("/flaky")) == 2


@pytest.mark.django_db(transaction=True)
def test_an_operator_reads_an_inbound_email_and_processes_it_again(live_server, settings):
    """Mail sent with smtplib to the real listener, then read and reprocessed in the
    browser: the list shows sender, recipient, subject and state; the page the message,
    its handler runs and the rejected one's reason."""
    from ingest import handlers
    from ingest.models import InboundEmail, InboundEvent
    from tests.ingest.conftest import message, settle, smtp_client, smtp_listener
    from tests.ingest.test_smtp import HOSTILE

    settings.SESSION_COOKIE_SECURE = False
    settings.CSRF_COOKIE_SECURE = False
    from ingest.sources import source_create

    source_create(
        slug="mail", scheme="smtp", secrets=[], options={"addresses": ["support@example.com"]}
    )
    registration = handlers.Registration("email", "support@example.com", lambda m: None)
    handlers.REGISTRY.append(registration)
    try:
        with smtp_listener() as running, smtp_client(running.bound_port) as client:
            client.sendmail(
                "ann@example.org",
                ["support+ticket-5@example.com"],
                message(subject="Printer on fire", to="support+ticket-5@example.com"),
            )
            client.mail("ann@example.org")
            client.rcpt("support@example.com")
            assert client.data(HOSTILE["nested_archive"])[0] == 554
        settle()  # past the order window the email about ticket-5 waits out
        drain()
    finally:
        handlers.REGISTRY.remove(registration)
    accepted = InboundEmail.objects.get(rejected_reason="")
    get_user_model().objects.create_superuser("operator", "operator@example.com", PASSWORD)

    admin = live_server.url + "/admin/"
    listing = admin + "ingest/inboundemail/"
    with chromium_page(SCREENSHOTS) as page:
        page.goto(admin + "login/?next=/admin/")
        page.fill("#id_username", "operator")
        page.fill("#id_password", PASSWORD)
        page.click("input[type=submit]")
        page.wait_for_url(admin)
        page.locator("#content-main").get_by_role("link", name="Inbound emails").click()
        page.wait_for_url(listing)
        rows = page.locator("#result_list tbody tr")
        assert rows.count() == 2
        texts = [rows.nth(i).inner_text() for i in range(2)]
        assert any("Printer on fire" in t and "processed" in t for t in texts)
        assert any("nested_archive" in t and "rejected" in t for t in texts)
        shot(page, "11-inbound-emails")

        page.goto(listing + f"{accepted.pk}/change/")
        assert "It is on fire." in page.locator(".field-body_text").inner_text()
        assert "ok" in page.locator(".field-handler_runs").inner_text()
        assert page.locator(".field-recipient .readonly").inner_text() == (
            "support+ticket-5@example.com"
        )
        shot(page, "12-inbound-email")

        page.goto(listing)
        page.locator(f"input[name=_selected_action][value='{accepted.pk}']").check()
        page.select_option("select[name=action]", "reprocess")
        with page.expect_navigation():
            page.click("button[name=index]")
        assert "1 emails queued for processing again" in page.locator(".messagelist").inner_text()
        shot(page, "13-processed-again")
    assert InboundEvent.objects.get(pk=accepted.pk).state == "pending"
    assert AuditEntry.objects.filter(action="inbound_email.reprocess", count=1).exists()
