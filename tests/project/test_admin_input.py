"""Every admin page as a superuser, with hostile input in every filter, search, ordering
and id: a 4xx, or a 200 with the filter refused or ignored, never a 500.

The admins, their filters' parameters, their actions, their URLs and the foreign keys
the autocomplete view serves are read from ``admin.site``, so a page, filter or action
added later is crawled here without editing this file."""

import pytest
from django.contrib import admin
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.utils import quote
from django.db import models
from django.urls import reverse

from deliveries.models import ApiKey, Delivery, Tenant
from tests.project.admin_console import (
    admin_url,
    console_data,
    custom_urls,
    first_object,
    registered,
    superuser_client,
    superuser_request,
)

# Real transactions: a request whose query fails must not poison the ones after it.
pytestmark = pytest.mark.django_db(transaction=True)

HOSTILE = [
    "\x00",
    "a\x00b",
    "garbage",
    "-1",
    "99999999999999999999",
    "1e309",
    "NaN",
    "not-a-uuid",
    "00000000-0000-0000-0000-000000000000",
    "0001-01-01",
    "9999-12-31",
    "99999-01-01",
    "0001-01-01T00:00:00+14:00",
    "9999-12-31T23:59:59-14:00",
    "9999-12-31 23:59:59",
    "2024-01-01T00:00:00+99:00",
    "2024-01-01T00:00:00+23:59",
    "2024-13-45T25:61:61",
]
# Percent-escapes sent as they are: UTF-8 of a lone surrogate, bytes that are no UTF-8.
HOSTILE_RAW = ["%ED%A0%80", "%FF%FE", "%C0%AF", "%00"]
HOSTILE_IDS = ["garbage", "\x00", "-1", "99999999999999999999", "0"]
# The changelist's own parameters: search, ordering, page.
CHANGELIST_PARAMETERS = ["q", "o", "p"]


def filter_parameters(root, changelist: str) -> list[str]:
    """Every query parameter the changelist's filters read."""
    cl = root.get(changelist).context["cl"]
    return [p for spec in cl.filter_specs for p in spec.expected_parameters()]


def autocomplete_sources():
    """(app_label, model_name, field_name) of every foreign key whose target's admin has a
    search: what the autocomplete view answers for."""
    for model in admin.site._registry:
        for field in model._meta.get_fields():
            target = admin.site._registry.get(getattr(field, "related_model", None))
            if isinstance(field, models.ForeignKey) and target and target.search_fields:
                yield model._meta.app_label, model._meta.model_name, field.name


def test_no_admin_page_answers_500_whatever_the_input():
    console_data()
    root, root_user = superuser_client()
    request = superuser_request(root_user)
    failures = []

    def crawl(url: str, params=None, method="get"):
        response = getattr(root, method)(url, params or {})
        if response.status_code >= 500:
            failures.append(f"{method.upper()} {url} {params or ''}: {response.status_code}")

    def crawl_hostile(url: str, parameters):
        for parameter in parameters:
            for value in HOSTILE:
                crawl(url, {parameter: value})
            for raw in HOSTILE_RAW:
                crawl(f"{url}?{parameter}={raw}")

    crawl_hostile(reverse("admin:index"), ["q", "next"])
    for app_label in {model._meta.app_label for model in admin.site._registry}:
        crawl_hostile(reverse("admin:app_list", args=[app_label]), ["q"])
    for app_label, model_name, field_name in autocomplete_sources():
        source = {"app_label": app_label, "model_name": model_name, "field_name": field_name}
        for term in HOSTILE:
            crawl(reverse("admin:autocomplete"), {**source, "term": term, "page": term})

    for model, model_admin in registered():
        obj = first_object(model_admin, request)
        pk = quote(obj.pk)
        changelist = admin_url(model, "changelist")
        for url in [
            changelist,
            admin_url(model, "add"),
            admin_url(model, "change", pk),
            admin_url(model, "history", pk),
            admin_url(model, "delete", pk),
            *custom_urls(model_admin, obj),
        ]:
            crawl(url)
        crawl_hostile(changelist, filter_parameters(root, changelist) + CHANGELIST_PARAMETERS)
        for url in custom_urls(model_admin, obj):
            crawl_hostile(url, CHANGELIST_PARAMETERS)
        for bad_id in HOSTILE_IDS:
            for view in ("change", "history", "delete"):
                crawl(admin_url(model, view, quote(bad_id)))
            # Every action, on a selection no row has: nothing to act on, and no 500.
            for action in model_admin.get_actions(request):
                selection = {"action": action, ACTION_CHECKBOX_NAME: [bad_id]}
                crawl(changelist, selection, method="post")

    assert not failures, "\n".join(failures)


def test_input_the_database_refuses_gets_a_400_and_a_log_line(caplog):
    """Each of the three refusals, answered 400 (not a redirect, not a 500), logged with
    its reason and without the hostile value."""
    console_data()
    root, _ = superuser_client()
    deliveries = admin_url(Delivery, "changelist")
    offset = "2024-01-01T00:00:00+20:00"  # Python takes it; PostgreSQL refuses it
    cases = [
        ("get", deliveries, {"state__exact": "dead\x00"}, "nul"),
        ("get", deliveries, {"listing__created_at__gte": offset}, "database_refused_value"),
        (
            "post",
            admin_url(Tenant, "changelist"),
            {"action": "create_api_key", ACTION_CHECKBOX_NAME: ["garbage"]},
            "selection_not_keys",
        ),
    ]
    keys = ApiKey.objects.count()
    for method, url, params, reason in cases:
        caplog.clear()
        response = getattr(root, method)(url, params)
        assert response.status_code == 400, (params, response.status_code)
        [record] = [r for r in caplog.records if getattr(r, "action", "") == "admin.input_refused"]
        assert (record.reason, record.path) == (reason, url)
        assert offset not in record.getMessage() and "garbage" not in str(record.__dict__)
    assert ApiKey.objects.count() == keys
