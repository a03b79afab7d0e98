"""The customer portal: signed links, the session they open, tenant isolation over every
route, CSRF on every form, labelled controls, headers, theming, and the pages' writes
through the services. The whole story in a real browser is tests/e2e/test_portal_browser.py."""

import html
import re
import uuid
from datetime import UTC, datetime, timedelta
from html.parser import HTMLParser
from pathlib import Path

import pytest
from django.core.management import call_command
from django.test import Client
from django.urls import get_resolver
from django.utils import timezone
from rest_framework.test import APIClient

from deliveries import services
from deliveries.models import (
    Attempt,
    AuditEntry,
    Delivery,
    Endpoint,
    EndpointSecret,
    EventType,
    PortalLink,
    Tenant,
)
from deliveries.portal import portal_url
from deliveries.portal.links import portal_link_create

pytestmark = pytest.mark.django_db

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "receivers.md"


def enter(client: Client, tenant: Tenant) -> Client:
    url = portal_url(tenant)
    path, token = url.split("#")
    assert client.get(path).status_code == 200
    csrf = client.cookies["csrftoken"].value  # as the page's form carries it
    response = client.post(path, {"token": token, "csrfmiddlewaretoken": csrf})
    assert response.status_code == 302 and response["Location"] == "/portal/"
    return client


@pytest.fixture
def alice():
    tenant = Tenant.objects.create(name="alice")
    return tenant, enter(Client(), tenant)


@pytest.fixture
def bob():
    tenant = Tenant.objects.create(name="bob")
    endpoint, _ = services.endpoint_create(tenant=tenant, url="https://example.com/bob")
    event = services.publish_event(tenant=tenant, event_type="t", payload={})
    return tenant, endpoint, Delivery.objects.get(event=event)


def portal_routes() -> list[str]:
    """Every portal URL pattern, from the resolver: a new page is swept without editing
    this test."""
    found = []
    patterns = [
        p
        for p in get_resolver("deliveries.portal.urls").url_patterns
        if p.name not in ("asset", "theme", "enter")
    ]
    for p in patterns:
        found.append("/portal/" + str(p.pattern).replace("<str:pk>", "{id}"))
    return found


OBJECT_ROUTES = [r for r in portal_routes() if "{id}" in r]
# The routes that only act (POST), with no page of their own.
ACTIONS = ("/test/", "/rotate/", "/enable/", "/pause/", "/resume/", "/replay/")
PLAIN_ROUTES = [r for r in portal_routes() if "{id}" not in r]


def test_the_route_lists_cover_the_portal():
    assert sorted(OBJECT_ROUTES) == [
        "/portal/deliveries/{id}/",
        "/portal/deliveries/{id}/replay/",
        "/portal/endpoints/{id}/",
        "/portal/endpoints/{id}/enable/",
        "/portal/endpoints/{id}/pause/",
        "/portal/endpoints/{id}/resume/",
        "/portal/endpoints/{id}/rotate/",
        "/portal/endpoints/{id}/test/",
    ]
    assert "/portal/" in PLAIN_ROUTES and "/portal/recover/" in PLAIN_ROUTES


# --- Links and the session --------------------------------------------------------------


def test_a_link_opens_its_tenants_portal_once_and_its_token_is_in_the_fragment():
    tenant = Tenant.objects.create(name="acme")
    url = portal_url(tenant, base_url="https://webhooks.example.com")
    assert re.fullmatch(r"https://webhooks\.example\.com/portal/enter/#whp_[\w-]{43}", url)
    token = url.split("#")[1]
    link = PortalLink.objects.get()
    assert token not in str(vars(link)) and link.token_hash != token
    client = Client()
    page = client.get("/portal/enter/")
    assert page.status_code == 200 and b"csrfmiddlewaretoken" in page.content
    assert client.post("/portal/enter/", {"token": token}).status_code == 302
    home = client.get("/portal/")
    assert home.status_code == 200 and b"Sign out of acme" in home.content
    # Used: a second opening, in any browser, is refused.
    assert Client().post("/portal/enter/", {"token": token}).status_code == 403
    link.refresh_from_db()
    assert link.used_at is not None


@pytest.mark.parametrize("token", ["", "whp_nope", "whk_" + "a" * 43, "x" * 5000])
def test_an_unknown_token_opens_nothing(token):
    client = Client()
    r = client.post("/portal/enter/", {"token": token})
    assert r.status_code == 403 and b"expired or was used" in r.content
    assert client.get("/portal/").status_code == 403


def test_an_expired_link_opens_nothing():
    tenant = Tenant.objects.create(name="acme")
    link, token = portal_link_create(tenant=tenant, ttl=60)
    PortalLink.objects.filter(id=link.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert Client().post("/portal/enter/", {"token": token}).status_code == 403


@pytest.mark.parametrize("ttl", [0, -5, 86401])
def test_a_link_life_outside_the_bounds_is_refused(ttl):
    tenant = Tenant.objects.create(name="acme")
    with pytest.raises(services.DomainError, match="ttl"):
        portal_url(tenant, ttl=ttl)


def test_the_session_ends_after_its_time(settings):
    settings.PORTAL_SESSION_SECONDS = -1  # already over when it opens
    tenant = Tenant.objects.create(name="acme")
    client = Client()
    path, token = portal_url(tenant).split("#")
    client.post(path, {"token": token})
    assert client.get("/portal/").status_code == 403


def test_the_portal_session_grants_nothing_outside_the_portal(alice):
    _, client = alice
    assert client.get("/admin/").status_code == 302  # to the admin's login
    assert client.get("/api/v1/endpoints/").status_code == 401
    client.post("/portal/leave/")
    assert client.get("/portal/").status_code == 403


def test_the_rest_route_returns_a_link_for_the_keys_tenant():
    _, key = services.tenant_create(name="acme")
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    r = api.post("/api/v1/portal-link/", {"ttl": 120}, format="json")
    assert r.status_code == 200, r.content
    url = r.json()["url"]
    assert url.startswith("http://testserver/portal/enter/#whp_")
    expires = PortalLink.objects.get().expires_at
    assert timedelta(seconds=115) < expires - timezone.now() <= timedelta(seconds=120)
    client = Client()
    client.post("/portal/enter/", {"token": url.split("#")[1]})
    assert b"Sign out of acme" in client.get("/portal/").content
    for bad in (0, 10**6, "x"):
        r = api.post("/api/v1/portal-link/", {"ttl": bad}, format="json")
        assert r.status_code == 400, bad
    assert APIClient().post("/api/v1/portal-link/").status_code == 401
    assert api.get("/api/v1/portal-link/").status_code == 405


# --- Every route: no session, another tenant, CSRF ---------------------------------------


def fill(route: str, object_id) -> str:
    return route.replace("{id}", str(object_id))


@pytest.mark.parametrize("route", portal_routes())
def test_every_page_without_a_session_is_the_signed_out_page(route, bob):
    _, endpoint, _ = bob
    for method in ("get", "post"):
        r = getattr(Client(), method)(fill(route, endpoint.id))
        assert r.status_code == 403, (method, route)
        assert b"Open the portal from your link" in r.content


@pytest.mark.parametrize("route", OBJECT_ROUTES)
@pytest.mark.parametrize("method", ["get", "post"])
def test_another_tenants_id_is_the_same_404_as_a_random_one(route, method, alice, bob):
    _, client = alice
    bob_tenant, endpoint, delivery = bob
    theirs = endpoint.id if "/endpoints/" in route else delivery.id
    secrets_before = EndpointSecret.objects.filter(endpoint=endpoint).count()
    answers = [
        getattr(client, method)(fill(route, object_id), {"overlap_hours": 0})
        for object_id in (theirs, uuid.uuid4(), "not-a-uuid")
    ]
    if method == "get" and route.endswith(ACTIONS):
        assert {a.status_code for a in answers} == {405}
        return
    assert [a.status_code for a in answers] == [404, 404, 404]
    # The same page: only the CSRF token of the sign-out form differs (masked afresh
    # in every answer).
    pages = {
        re.sub(
            rb'value="[^"]+" name="csrfmiddlewaretoken"|name="csrfmiddlewaretoken" value="[^"]+"',
            b"",
            a.content,
        )
        for a in answers
    }
    assert len(pages) == 1
    # Nothing of Bob's moved.
    delivery.refresh_from_db()
    endpoint.refresh_from_db()
    assert delivery.state == "pending" and delivery.attempt_count == 0
    assert endpoint.enabled and endpoint.paused_at is None
    assert EndpointSecret.objects.filter(endpoint=endpoint).count() == (secrets_before)
    assert Delivery.objects.filter(tenant=bob_tenant).count() == 1


def test_lists_never_show_another_tenants_rows(alice, bob):
    _, client = alice
    for route in PLAIN_ROUTES:
        if route == "/portal/leave/":
            continue
        page = client.get(route).content
        assert b"example.com/bob" not in page, route
    assert b"No deliveries" in client.get("/portal/deliveries/", {"state": "pending"}).content


@pytest.mark.parametrize("route", portal_routes())
def test_every_post_needs_the_csrf_token(route, alice):
    tenant, _ = alice
    endpoint, _ = services.endpoint_create(tenant=tenant, url="https://example.com/a")
    client = enter(Client(enforce_csrf_checks=True), tenant)
    r = client.post(fill(route, endpoint.id), {"url": "https://example.com/x"})
    assert r.status_code == 403, route
    assert b"Open the portal" not in r.content  # refused by CSRF, not by the session
    endpoint.refresh_from_db()
    assert endpoint.url == "https://example.com/a"


# Attributes that name other elements by id: a name that is no element's id leaves a
# screen reader with nothing to read (a label for nothing, help text never announced).
ID_REFERENCES = ("for", "aria-describedby", "aria-labelledby", "aria-controls")


class Controls(HTMLParser):
    """The form controls of a page, the labels' targets, the POST forms' tokens, the
    ids and the references to ids."""

    def __init__(self) -> None:
        super().__init__()
        self.controls: list[dict] = []
        self.labelled: set[str] = set()
        self.forms: list[dict] = []
        self.ids: set[str] = set()
        self.references: list[tuple[str, str, str]] = []  # (tag, attribute, id)
        self._label_depth = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        for attribute in ID_REFERENCES:
            self.references += [(tag, attribute, i) for i in (a.get(attribute) or "").split()]
        if tag == "label":
            self._label_depth += 1
            if a.get("for"):
                self.labelled.add(a["for"])
        elif tag == "form":
            self.forms.append({"method": (a.get("method") or "get").lower(), "csrf": False})
        elif tag in ("input", "select", "textarea", "button"):
            if tag == "input" and a.get("name") == "csrfmiddlewaretoken" and self.forms:
                self.forms[-1]["csrf"] = True
            if tag == "input" and a.get("type") in ("hidden", "submit"):
                return
            if tag == "button":
                return
            self.controls.append({**a, "_in_label": self._label_depth > 0})

    def handle_endtag(self, tag):
        if tag == "label":
            self._label_depth -= 1


def test_every_control_is_labelled_its_references_resolve_and_posts_carry_the_token(alice):
    tenant, client = alice
    endpoint, _ = services.endpoint_create(tenant=tenant, url="https://example.com/a")
    event = services.endpoint_send_test(endpoint=endpoint)
    EventType.objects.get_or_create(name="invoice.paid")
    delivery = Delivery.objects.get(event=event)
    pages = [fill(r, endpoint.id if "/endpoints/" in r else delivery.id) for r in portal_routes()]
    pages = [p for p in pages if not p.endswith(ACTIONS)]
    pages = [p for p in pages if p != "/portal/leave/"]
    answers = [(path, client.get(path)) for path in pages]
    answers.append(("/portal/enter/", Client().get("/portal/enter/")))
    # A form sent back with its errors.
    refused = client.post("/portal/endpoints/new/", {"url": "nope", "rate_limit": "-1"})
    assert b'role="alert"' in refused.content
    answers.append(("/portal/endpoints/new/ (refused)", refused))
    checked = references = 0
    for path, r in answers:
        assert r.status_code == 200, path
        parsed = Controls()
        parsed.feed(r.content.decode())
        for control in parsed.controls:
            named = control.get("aria-label") or control["_in_label"]
            assert named or control.get("id") in parsed.labelled, (path, control)
            checked += 1
        for tag, attribute, target in parsed.references:
            assert target in parsed.ids, (path, f"<{tag} {attribute}={target!r}> names no element")
            references += 1
        for form in parsed.forms:
            assert form["method"] == "get" or form["csrf"], path
    assert checked > 20 and references > 20


# --- Headers and the look ------------------------------------------------------------------


def test_pages_forbid_framing_unless_the_host_allows_it(alice, settings):
    _, client = alice
    r = client.get("/portal/")
    assert "frame-ancestors 'none'" in r["Content-Security-Policy"]
    assert "script-src 'self'" in r["Content-Security-Policy"]
    assert r["X-Frame-Options"] == "DENY" and r["Cache-Control"] == "no-store"
    settings.PORTAL_FRAME_ANCESTORS = ["'self'", "https://app.example.com"]
    r = client.get("/portal/")
    assert "frame-ancestors 'self' https://app.example.com" in r["Content-Security-Policy"]
    assert "X-Frame-Options" not in r


def test_times_are_in_utc_as_the_pages_say_whatever_the_hosts_time_zone(alice, settings):
    settings.TIME_ZONE = "America/New_York"
    tenant, client = alice
    endpoint, _ = services.endpoint_create(tenant=tenant, url="https://example.com/a")
    delivery = Delivery.objects.get(event=services.endpoint_send_test(endpoint=endpoint))
    at = datetime(2030, 1, 2, 12, 0, 0, tzinfo=UTC)
    Attempt.objects.create(
        delivery=delivery, number=1, started_at=at, duration_ms=5, status_code=500, outcome="retry"
    )
    Endpoint.objects.filter(id=endpoint.id).update(paused_at=at)
    delivery_page = client.get(f"/portal/deliveries/{delivery.id}/").content.decode()
    assert "<dt>Sent at</dt><dd>2030-01-02 12:00:00 UTC</dd>" in delivery_page
    endpoint_page = client.get(f"/portal/endpoints/{endpoint.id}/").content.decode()
    assert "since 2030-01-02 12:00 UTC" in endpoint_page
    for page in (delivery_page, endpoint_page):
        assert "2030-01-02 07:00" not in page  # New York's clock, labelled UTC


def test_the_host_themes_the_portal(alice, settings):
    _, client = alice
    settings.PORTAL_TITLE = "Acme Hooks"
    settings.PORTAL_LOGO_URL = "https://cdn.acme.example/logo.svg"
    settings.PORTAL_CSS_URL = "https://cdn.acme.example/portal.css"
    settings.PORTAL_COLORS = {"accent": "#ff6600", "background": "rgb(250, 250, 250)"}
    page = client.get("/portal/")
    body = page.content.decode()
    assert "Acme Hooks" in body and 'src="https://cdn.acme.example/logo.svg"' in body
    assert 'href="https://cdn.acme.example/portal.css"' in body
    csp = page["Content-Security-Policy"]
    assert "style-src 'self' https://cdn.acme.example" in csp
    assert "img-src 'self' data: https://cdn.acme.example" in csp
    css = client.get("/portal/theme.css").content.decode()
    assert "--portal-accent: #ff6600;" in css and "--portal-background: rgb(250, 250, 250);" in css


def test_colours_that_are_no_css_colours_fail_the_check(settings, capsys):
    settings.PORTAL_COLORS = {"accent": "red;} body{display:none", "nope": "#fff"}
    from django.core.management.base import SystemCheckError

    with pytest.raises(SystemCheckError) as failed:
        call_command("check")
    assert str(failed.value).count("deliveries.E060") == 2
    assert "display:none" not in Client().get("/portal/theme.css").content.decode()


def test_the_signature_panel_shows_every_snippet_of_the_receivers_guide(alice):
    _, client = alice
    page = html.unescape(client.get("/portal/verify/").content.decode())
    section = GUIDE.read_text().split("## Verify the signature")[1].split("\n## ")[0]
    blocks = re.findall(r"```\w+\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 5
    for block in blocks:
        assert block in page


# --- What the pages do, through the services ---------------------------------------------


def test_adding_an_endpoint_picks_types_from_the_catalogue_and_shows_the_secret_once(alice):
    tenant, client = alice
    EventType.objects.get_or_create(name="invoice.paid")
    EventType.objects.get_or_create(name="invoice.voided")
    form = client.get("/portal/endpoints/new/").content.decode()
    assert 'value="invoice.*"' in form and 'value="invoice.paid"' in form
    r = client.post(
        "/portal/endpoints/new/",
        {
            "url": "https://example.com/hooks",
            "event_types": ["invoice.*"],
            "other_event_types": "customer.created, shop.*",
            "rate_limit": "5",
        },
    )
    assert r.status_code == 200
    endpoint = Endpoint.objects.get(tenant=tenant)
    assert endpoint.event_types == ["invoice.*", "customer.created", "shop.*"]
    assert endpoint.rate_limit == 5
    (secret,) = re.findall(r'value="(whsec_[^"]+)"', r.content.decode())
    assert EndpointSecret.objects.get(endpoint=endpoint).secret == secret
    assert secret not in client.get(f"/portal/endpoints/{endpoint.id}/").content.decode()


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"url": "http://10.0.0.1/hook"}, "url"),
        ({"url": "https://example.com/h", "other_event_types": "inv*"}, "inv*"),
        ({"url": "https://example.com/h", "rate_limit": "100000"}, "less than or equal to 1000"),
        ({"url": "https://example.com/h", "max_concurrency": "0"}, "greater than"),
        ({"url": "not a url"}, "valid URL"),
    ],
)
def test_a_refused_endpoint_is_explained_on_the_form_and_nothing_is_made(alice, fields, says):
    tenant, client = alice
    r = client.post("/portal/endpoints/new/", fields)
    assert r.status_code == 200
    assert says in html.unescape(r.content.decode())
    assert 'role="alert"' in r.content.decode()
    assert not Endpoint.objects.filter(tenant=tenant).exists()


def test_rotating_keeps_the_old_secret_for_the_overlap_chosen(alice):
    tenant, client = alice
    endpoint, old = services.endpoint_create(tenant=tenant, url="https://example.com/a")
    r = client.post(f"/portal/endpoints/{endpoint.id}/rotate/", {"overlap_hours": "72"})
    (new,) = re.findall(r'value="(whsec_[^"]+)"', r.content.decode())
    assert new != old
    kept = EndpointSecret.objects.get(endpoint=endpoint, expires_at__isnull=False)
    assert kept.secret == old
    assert timedelta(hours=71.9) < kept.expires_at - timezone.now() <= timedelta(hours=72)
    (entry,) = AuditEntry.objects.filter(action="endpoint.rotate_secret")
    assert entry.details["via"] == "portal"


def test_a_test_send_leads_to_its_delivery_and_replay_and_recover_work(alice):
    tenant, client = alice
    endpoint, _ = services.endpoint_create(tenant=tenant, url="https://example.com/a")
    r = client.post(f"/portal/endpoints/{endpoint.id}/test/")
    delivery = Delivery.objects.get(tenant=tenant)
    assert r["Location"] == f"/portal/deliveries/{delivery.id}/"
    page = client.get(r["Location"]).content.decode()
    assert "webhook.test" in page and str(delivery.id) in page
    Delivery.objects.filter(id=delivery.id).update(state="dead", finished_at=timezone.now())
    assert client.post(f"/portal/deliveries/{delivery.id}/replay/").status_code == 302
    delivery.refresh_from_db()
    assert delivery.state == "pending"
    Delivery.objects.filter(id=delivery.id).update(state="dead", finished_at=timezone.now())
    since = (timezone.now() - timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M")
    r = client.post("/portal/recover/", {"since": since, "endpoint": str(endpoint.id)})
    assert "1 delivery will be sent again" in r.content.decode()
    r = client.post("/portal/recover/", {"since": "2001-01-01T00:00"})
    assert "within the last 14 days" in r.content.decode()


def test_the_delivery_list_filters_and_pages(alice):
    tenant, client = alice
    services.endpoint_create(tenant=tenant, url="https://example.com/a")
    for n in range(55):
        services.publish_event(tenant=tenant, event_type="invoice.paid", payload={"n": n})
    services.publish_event(tenant=tenant, event_type="other", payload={})
    first = client.get("/portal/deliveries/", {"event_type": "invoice.paid"}).content.decode()
    assert first.count("<tr>") == 51  # the header and 50 rows
    older = html.unescape(re.search(r'href="(\?[^"]+)" rel="next"', first).group(1))
    second = client.get("/portal/deliveries/" + older).content.decode()
    assert second.count("<tr>") == 6
    assert client.get("/portal/deliveries/", {"state": "dead"}).content.count(b"<tr>") == 0
    bad = client.get("/portal/deliveries/", {"since": "yesterday"})
    assert bad.status_code == 200 and b"Enter a valid date/time" in bad.content


def test_the_tenant_registers_its_alert_address(alice):
    tenant, client = alice
    r = client.post("/portal/", {"notification_email": "ops@alice.example"})
    assert r.status_code == 302
    tenant.refresh_from_db()
    assert tenant.notification_email == "ops@alice.example"
    r = client.post("/portal/", {"notification_email": "not an address"})
    assert b"valid email" in r.content
    tenant.refresh_from_db()
    assert tenant.notification_email == "ops@alice.example"


def test_retention_deletes_links_a_day_past_their_expiry():
    from deliveries.core.retention import prune

    tenant = Tenant.objects.create(name="acme")
    old, _ = portal_link_create(tenant=tenant)
    fresh, _ = portal_link_create(tenant=tenant)
    PortalLink.objects.filter(id=old.id).update(expires_at=timezone.now() - timedelta(days=2))
    prune()
    assert list(PortalLink.objects.values_list("id", flat=True)) == [fresh.id]


def test_pausing_holds_the_deliveries_and_resuming_lets_them_flow(alice):
    tenant, client = alice
    endpoint, _ = services.endpoint_create(tenant=tenant, url="https://example.com/a")
    r = client.post(f"/portal/endpoints/{endpoint.id}/pause/", {"reason": "maintenance"})
    assert r.status_code == 302
    endpoint.refresh_from_db()
    assert endpoint.paused_at is not None and endpoint.paused_reason == "maintenance"
    page = client.get(f"/portal/endpoints/{endpoint.id}/").content.decode()
    assert "paused" in page and "maintenance" in page and 'id="resume"' in page
    client.post(f"/portal/endpoints/{endpoint.id}/resume/")
    endpoint.refresh_from_db()
    assert endpoint.paused_at is None
    assert list(
        AuditEntry.objects.filter(details__via="portal").values_list("action", flat=True)
    ) == ["endpoint.pause", "endpoint.resume"]


HOSTILE = [
    "\x00",
    "a\x00b",
    "x" * 10_000,
    "-1",
    "1e999",
    "NaN",
    "9" * 50,
    "2026-02-30T25:61",
    "\r\n",
]
FIELDS = [
    "url",
    "description",
    "event_types",
    "other_event_types",
    "rate_limit",
    "max_concurrency",
    "overlap_hours",
    "reason",
    "since",
    "endpoint",
    "state",
    "event_type",
    "before",
    "notification_email",
    "token",
]


def test_hostile_values_in_every_field_of_every_page_are_answered_below_500(alice):
    tenant, client = alice
    endpoint, _ = services.endpoint_create(tenant=tenant, url="https://example.com/a")
    delivery = Delivery.objects.get(event=services.endpoint_send_test(endpoint=endpoint))
    routes = [fill(r, endpoint.id if "/endpoints/" in r else delivery.id) for r in portal_routes()]
    routes = [r for r in routes if r != "/portal/leave/"] + ["/portal/enter/"]
    sent = 0
    for route in routes:
        for value in HOSTILE:  # in every field at once: each form checks each field
            for method in ("get", "post"):
                r = getattr(client, method)(route, dict.fromkeys(FIELDS, value))
                assert r.status_code < 500, (method, route, value[:20])
                sent += 1
    assert sent >= 250
    endpoint.refresh_from_db()
    assert endpoint.url == "https://example.com/a"
