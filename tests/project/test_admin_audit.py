"""Edits and deletions made on the admin's own pages are audited like actions: every
admin that lets staff add, change or delete rows writes an audit row, with the user and
the fields changed (never their values), in the transaction that makes the change.

The admins are read from ``admin.site``, so an admin added later is held to it here."""

import pytest
from django.contrib.admin.utils import quote
from django.contrib.auth.models import User

from deliveries.core.console import AuditedEdits
from deliveries.models import AuditEntry, EventType, Tenant
from tests.project.admin_console import (
    admin_url,
    console_data,
    registered,
    superuser_client,
    superuser_request,
)

pytestmark = pytest.mark.django_db


def test_every_admin_that_lets_staff_edit_or_delete_audits_it(admin_user):
    request = superuser_request(admin_user)
    unaudited = [
        model._meta.label
        for model, model_admin in registered()
        if (
            model_admin.has_add_permission(request)
            or model_admin.has_change_permission(request)
            or model_admin.has_delete_permission(request)
        )
        and not isinstance(model_admin, AuditedEdits)
    ]
    assert unaudited == []


def test_a_change_page_edit_a_list_edit_and_deletions_are_audited():
    console_data()
    client, root = superuser_client()
    tenant = Tenant.objects.get(name="acme")

    page = admin_url(Tenant, "change", quote(tenant.pk))
    r = client.post(page, {"name": "acme-renamed", "time_zone": "Europe/Berlin", "_save": "Save"})
    assert r.status_code == 302, r.content[:2000]
    entry = AuditEntry.objects.get(action="deliveries.tenant.change")
    assert entry.actor == root and entry.count == 1
    assert entry.details["objects"] == [{"id": str(tenant.pk), "name": "acme-renamed"}]
    assert sorted(entry.details["fields"]) == ["Name", "Time zone"]
    assert "Europe/Berlin" not in str(entry.details)  # names of fields, never values

    add = admin_url(EventType, "add")
    form = {"name": "refund.created", "owner": "billing", "validation": "warn", "_save": "1"}
    for formset in client.get(add).context["inline_admin_formsets"]:  # none added
        management = formset.formset.management_form
        form.update({management.add_prefix(k): v for k, v in management.initial.items()})
    r = client.post(add, form)
    assert r.status_code == 302
    assert AuditEntry.objects.filter(action="deliveries.eventtype.add", count=1).exists()

    # The delete page, and "delete selected" (count and names, in one transaction).
    r = client.post(admin_url(EventType, "delete", quote("refund.created")), {"post": "yes"})
    assert r.status_code == 302
    deleted = AuditEntry.objects.get(action="deliveries.eventtype.delete")
    assert deleted.details["objects"] == [{"id": "refund.created", "name": "refund.created"}]
    names = sorted(EventType.objects.values_list("name", flat=True))
    r = client.post(
        admin_url(EventType, "changelist"),
        {"action": "delete_selected", "_selected_action": names, "post": "yes"},
    )
    assert r.status_code == 302 and not EventType.objects.exists()
    bulk = AuditEntry.objects.filter(action="deliveries.eventtype.delete").latest("id")
    assert bulk.count == len(names) >= 2
    assert sorted(o["id"] for o in bulk.details["objects"]) == names


def test_a_user_edit_is_audited_without_the_password():
    client, _ = superuser_client()
    other = User.objects.create_user("bob", password="old-password-1")
    url = admin_url(User, "password_change", quote(other.pk))
    r = client.post(url, {"password1": "N3w-password-xyz", "password2": "N3w-password-xyz"})
    assert r.status_code == 302
    entry = AuditEntry.objects.get(action="auth.user.change")
    assert entry.details["objects"] == [{"id": str(other.pk), "name": "bob"}]
    assert "N3w-password-xyz" not in str(entry.details)


def test_a_failed_deletion_leaves_no_audit_row(monkeypatch):
    """The audit row and the deletion commit together: a deletion that fails takes its
    audit row with it."""
    from django.contrib.admin import ModelAdmin

    console_data()
    client, _ = superuser_client()

    def boom(self, request, obj):
        raise RuntimeError("the database refused")

    monkeypatch.setattr(ModelAdmin, "delete_model", boom)
    client.raise_request_exception = False
    response = client.post(admin_url(EventType, "delete", quote("invoice.paid")), {"post": "yes"})
    assert response.status_code == 500
    assert EventType.objects.filter(pk="invoice.paid").exists()
    assert not AuditEntry.objects.filter(action="deliveries.eventtype.delete").exists()
