"""Every admin page, action and custom view, driven by staff who may only look (or not
even that): nothing changes and no key or secret is shown.

The admins, their actions and their custom URLs are read from ``admin.site``, so an
admin, action or page added later is driven here without editing this file."""

import pytest
from django.contrib.admin.utils import quote
from django.contrib.auth.models import Permission

from tests.project.admin_console import (
    add_user_secrets,
    admin_url,
    console_data,
    custom_urls,
    database_fingerprint,
    first_object,
    leaks,
    registered,
    staff_client,
    superuser_client,
    superuser_request,
)

# Real transactions: a request whose query fails must not poison the ones after it.
pytestmark = pytest.mark.django_db(transaction=True)

# Every form field a confirmation page asks for, all answered yes.
CONFIRMED = {"confirm": "yes", "unsafe_confirmed": "yes", "post": "yes", "index": "0"}
REFUSED = {302, 403, 404}


def list_editable_post(root, changelist: str) -> dict:
    """The superuser's list-editable form with every checkbox flipped: a change if saved."""
    formset = root.get(changelist).context["cl"].formset
    data = {"_save": "Save", **{f"form-{k}": v for k, v in formset.management_form.initial.items()}}
    for form in formset.forms:
        for name in form.fields:
            value = form[name].value()
            if isinstance(value, bool):
                value = "" if value else "on"
            data[form.add_prefix(name)] = value
    return data


@pytest.mark.parametrize("who", ["view_only", "no_permissions"])
def test_staff_who_may_only_look_change_nothing_and_see_no_secret(who):
    console = console_data()
    root, root_user = superuser_client()
    views = Permission.objects.filter(codename__startswith="view_")
    client = staff_client(who, views if who == "view_only" else [])
    add_user_secrets(console)
    request = superuser_request(root_user)
    before = database_fingerprint()
    problems = []

    def visit(method: str, url: str, data=None):
        response = getattr(client, method)(url, data or {})
        body = response.content
        if method == "post":  # what the action said lands on the next page
            body += client.get("/admin/").content
        if response.status_code >= 500:
            problems.append(f"{method.upper()} {url}: {response.status_code}")
        if found := leaks(body, console):
            problems.append(f"{method.upper()} {url} shows {found}")
        return response

    for model, model_admin in registered():
        obj = first_object(model_admin, request)
        assert obj is not None, f"console_data() makes no {model._meta.label} row: add one"
        pk = quote(obj.pk)
        changelist = admin_url(model, "changelist")
        selected = [str(p) for p in model_admin.get_queryset(request).values_list("pk", flat=True)]
        writes = [
            admin_url(model, "add"),
            admin_url(model, "change", pk),
            admin_url(model, "delete", pk),
        ]
        pages = [
            changelist,
            *writes,
            admin_url(model, "history", pk),
            *custom_urls(model_admin, obj),
        ]
        for url in pages:
            response = visit("get", url)
            if who == "no_permissions" and response.status_code not in REFUSED:
                problems.append(f"GET {url}: {response.status_code} to a user with no permission")
        for action in model_admin.get_actions(request):
            visit("post", changelist, {**CONFIRMED, "action": action, "_selected_action": selected})
        for url in custom_urls(model_admin, obj):
            visit("post", url, {**CONFIRMED, "_selected_action": selected})
        if model_admin.list_editable:
            visit("post", changelist, list_editable_post(root, changelist))
        for url in writes:
            response = visit("post", url, {**CONFIRMED, "_save": "Save"})
            if response.status_code != 403:
                problems.append(f"POST {url}: {response.status_code}, not refused")

    changed = [t for t, digest in database_fingerprint().items() if before.get(t) != digest]
    assert not changed, f"tables changed: {changed}"
    assert not problems, "\n".join(problems)


def test_every_admin_action_declares_the_permission_it_needs(admin_user):
    """An action without ``permissions=`` is offered to anyone who may view the list."""
    request = superuser_request(admin_user)
    undeclared = [
        f"{model._meta.label}.{name}"
        for model, model_admin in registered()
        for name, (function, _, _) in model_admin.get_actions(request).items()
        if not getattr(function, "allowed_permissions", ())
    ]
    assert undeclared == []
