"""Every page of the operator's console in a real browser at 1440x900, on a console with
realistic data (tests/e2e/realistic_console.py), checked for what a person would see:
lists that fit the window with every column on screen, times with seconds and their
zone, no raw floats, JSON dumps or "object (N)" captions where a value is shown, and the
overview's charts drawn with data. A full-page screenshot of each page is saved under
``test-output/console/``.

One browser for all the pages; the delivery log and endpoint health are also checked at
1366 px."""

import re

import pytest
from django.contrib import admin
from django.contrib.admin.utils import quote
from django.contrib.auth import get_user_model
from django.urls import reverse

from tests.e2e import realistic_console
from tests.e2e.browser import chromium, log_in, screenshots
from tests.ingest.fake_provider import FakeProvider, StaticRecords
from tests.project.admin_console import custom_urls

PASSWORD = "correct-horse-battery-staple"


class _Superuser:
    is_active = is_staff = is_superuser = True

    def has_perm(self, perm, obj=None):
        return True


class _Request:
    user = _Superuser()


SUPERUSER = _Request()
shot = screenshots("console")
pytestmark = pytest.mark.slow

# A time as the console writes it: seconds and a zone.
TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [A-Z][A-Za-z0-9+:-]*$")
# Django's default renderings of a time, which must be gone everywhere.
STOCK_TIME = re.compile(
    r"\b(Jan|Feb|March|April|May|June|July|Aug|Sept|Oct|Nov|Dec)\.? \d{1,2}, \d{4}"
    r"|\b\d{1,2}(:\d\d)? [ap]\.m\.|\bmidnight\b|\bnoon\b"
)
RAW_FLOAT = re.compile(r"\d+\.\d{4,}")

# What the page tells about itself, read in the page.
INSPECT = """() => {
  const doc = document.documentElement;
  const results = document.querySelector('#changelist-form .results');
  const headers = [...document.querySelectorAll('#result_list thead th')].map(th => {
    const r = th.getBoundingClientRect();
    return {name: th.className, left: r.left, right: r.right, width: r.width,
            text: th.innerText.trim()};
  });
  const values = [...document.querySelectorAll(['#result_list td', '#result_list th',
      'div.readonly', '.inline-group td', 'table.overview td'].join(', '))]
    .filter(el => !el.closest('pre') && !el.querySelector('pre'))
    .map(el => el.innerText.trim());
  return {
    pageWidth: doc.scrollWidth, viewport: window.innerWidth,
    resultsOverflow: results ? results.scrollWidth - results.clientWidth : 0,
    headers,
    times: [...document.querySelectorAll('time.when')].map(t => t.innerText.trim()),
    values,
    text: document.body.innerText,
    charts: [...document.querySelectorAll('svg.chart')].map(svg => ({
      cls: svg.getAttribute('class'), bars: +svg.dataset.bars,
      nonzero: +svg.dataset.nonzero, total: +svg.dataset.total,
      title: svg.querySelector('title').textContent})),
  };
}"""


def console_pages(objects: dict) -> list[tuple[str, str]]:
    """(name, path) of every page of the console: each admin's list, change page of its
    first row, add page and own pages, the overview, the log as the overview's links
    filter it, and the confirmation of a replay by filter."""
    from deliveries.models import Delivery

    dead = Delivery.objects.filter(state="dead").values_list("endpoint_id", flat=True).first()
    log = reverse("admin:deliveries_delivery_changelist")
    pages = [
        ("overview", "/admin/"),
        ("log-dead-of-an-endpoint", f"{log}?state__exact=dead&endpoint={dead}&ended=24h"),
        ("log-searching-an-endpoint", f"{log}?endpoint_q=down"),
        ("replay-matching", f"{log}replay-matching/?state__exact=dead&endpoint={dead}"),
    ]
    for model, model_admin in sorted(admin.site._registry.items(), key=lambda i: i[0]._meta.label):
        opts = model._meta
        label = f"{opts.app_label}-{opts.model_name}"
        pages.append(
            (f"{label}-list", reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist"))
        )
        if model_admin.has_add_permission(SUPERUSER):
            pages.append((f"{label}-add", reverse(f"admin:{opts.app_label}_{opts.model_name}_add")))
        obj = objects.get(model)
        if obj is not None:
            pages.append(
                (
                    f"{label}-change",
                    reverse(
                        f"admin:{opts.app_label}_{opts.model_name}_change", args=[quote(obj.pk)]
                    ),
                )
            )
            for url in custom_urls(model_admin, obj):
                if url not in {p for _, p in pages}:
                    pages.append((f"{label}-{url.rstrip('/').rsplit('/', 1)[-1]}", url))
    return pages


def first_rows() -> dict:
    """The row each admin's change page shows: the first of its list (a dead delivery for
    the log, with its whole timeline)."""
    from deliveries.models import Delivery

    found = {}
    for model, model_admin in admin.site._registry.items():
        found[model] = model_admin.get_queryset(SUPERUSER).order_by("pk").first()
    found[Delivery] = (
        Delivery.objects.filter(state="dead", attempt_count__gt=1)
        .order_by("-attempt_count")
        .first()
    )
    return found


def check_page(name: str, seen: dict, problems: list[str]) -> None:
    if seen["pageWidth"] > seen["viewport"]:
        problems.append(f"{name}: the page is {seen['pageWidth']} px wide in {seen['viewport']}")
    if seen["resultsOverflow"] > 1:
        problems.append(f"{name}: the list scrolls sideways by {seen['resultsOverflow']} px")
    for th in seen["headers"]:
        if th["right"] > seen["viewport"] + 0.5 or (th["text"] and th["width"] < 24):
            problems.append(f"{name}: column {th['text']!r} is off screen or squeezed ({th})")
    for text in seen["times"]:
        if not TIMESTAMP.match(text):
            problems.append(f"{name}: a time without seconds or zone: {text!r}")
    if match := STOCK_TIME.search(seen["text"]):
        problems.append(f"{name}: a time in Django's default format: {match.group(0)!r}")
    if " object (" in seen["text"]:
        problems.append(f"{name}: an 'object (N)' caption")
    for value in seen["values"]:
        if RAW_FLOAT.search(value):
            problems.append(f"{name}: a raw float: {value[:80]!r}")
        if value and value[0] in "{[" and value[-1] in "}]":
            problems.append(f"{name}: a JSON dump: {value[:80]!r}")


@pytest.mark.django_db(transaction=True)
def test_every_console_page_reads_like_a_product_at_1440_and_1366(live_server, settings, receiver):
    settings.SESSION_COOKIE_SECURE = False
    settings.CSRF_COOKIE_SECURE = False
    provider = FakeProvider(StaticRecords(300, per_ts=10)).start()
    try:
        console = realistic_console.build(receiver, provider, settings)
    finally:
        provider.stop()
    assert console.deliveries >= 300  # hundreds, as an operator meets them
    get_user_model().objects.create_superuser("operator", "operator@example.com", PASSWORD)
    pages = console_pages(first_rows())

    problems: list[str] = []
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        log_in(page, live_server.url, "operator", PASSWORD)
        for name, path in pages:
            response = page.goto(live_server.url + path)
            assert response.status == 200, (name, path, response.status)
            seen = page.evaluate(INSPECT)
            check_page(name, seen, problems)
            shot(page, f"1440-{name}")
            if name == "overview":
                overview = seen
        page.set_viewport_size({"width": 1366, "height": 900})
        for name, path in pages:
            if name in ("deliveries-delivery-list", "deliveries-endpoint-list"):
                page.goto(live_server.url + path)
                check_page(f"1366 {name}", page.evaluate(INSPECT), problems)
                shot(page, f"1366-{name}")

    assert not problems, "\n".join(problems)
    charts = {c["cls"].split()[-1]: c for c in overview["charts"]}
    assert {"series-delivered", "series-retried", "series-failed", "series-dead"} <= set(charts)
    for name in ("series-delivered", "series-retried", "series-failed", "series-dead"):
        assert charts[name]["nonzero"] > 0 and charts[name]["total"] > 0, charts[name]
