"""Networks staff open for one tenant (or one endpoint) past the egress guard: through the
real worker, the API's URL check, the poller and the admin, each against another tenant
that must not get them. The suite's autouse fixture opens loopback for everyone
(EGRESS_ALLOW_NETWORKS); every test here closes it, so an allowance is what opens it."""

import pytest
from django.contrib.auth.models import Permission, User
from django.core.exceptions import ValidationError
from rest_framework.test import APIClient

from deliveries import services
from deliveries.models import Attempt, AuditEntry, Delivery, EgressAllowance, Endpoint
from ingest.poll_sources import poll_source_create, poll_source_run
from tests.conftest import drain
from tests.ingest.fake_provider import FakeProvider, StaticRecords

pytestmark = pytest.mark.sqlite


@pytest.fixture(autouse=True)
def _nothing_open_for_everyone(settings):
    settings.EGRESS_ALLOW_NETWORKS = []


def endpoint_once_allowed(tenant, url):
    """An endpoint stored while an allowance opened its network, the allowance since
    revoked: the URL rule lets no endpoint be created at a closed network, so this is how
    one reaches the worker."""
    allowance = EgressAllowance.objects.create(tenant=tenant, network="127.0.0.0/8")
    endpoint, _ = services.endpoint_create(tenant=tenant, url=url)
    allowance.delete()
    return endpoint


def attempts_by_tenant() -> dict[str, list[Attempt]]:
    found: dict[str, list[Attempt]] = {}
    for attempt in Attempt.objects.select_related("delivery__tenant"):
        found.setdefault(attempt.delivery.tenant.name, []).append(attempt)
    return found


@pytest.mark.django_db(transaction=True)  # the workers' threads read what the test wrote
def test_a_network_opened_for_one_tenant_is_refused_to_every_other_tenant(receiver):
    alice = services.tenant_create(name="alice")[0]
    bob = services.tenant_create(name="bob")[0]
    EgressAllowance.objects.create(tenant=alice, network="127.0.0.0/8", note="internal CRM")
    receiver.behaviours["/internal"] = lambda n: (200, {}, b"internal data: payroll")
    services.endpoint_create(tenant=alice, url=receiver.url("/internal"))
    endpoint_once_allowed(bob, receiver.url("/internal"))  # the very same URL
    for tenant in (alice, bob):
        services.publish_event(tenant=tenant, event_type="t", payload={"who": tenant.name})

    drain()

    seen = receiver.requests_to("/internal")
    assert [r.webhook_id for r in seen] == [
        str(Delivery.objects.get(tenant=alice).id)
    ]  # bob's never reached it
    attempts = attempts_by_tenant()
    (alices,) = attempts["alice"]
    assert (alices.status_code, alices.response_body) == (200, "internal data: payroll")
    (bobs,) = attempts["bob"]
    assert bobs.error_kind == "blocked" and "127.0.0.1" in bobs.error
    assert (bobs.status_code, bobs.response_body) == (None, "")
    assert Delivery.objects.get(tenant=bob).last_outcome == "blocked"


@pytest.mark.django_db(transaction=True)
def test_an_endpoint_allowance_opens_the_network_for_that_endpoint_alone(receiver):
    alice = services.tenant_create(name="alice")[0]
    opened = endpoint_once_allowed(alice, receiver.url("/opened"))
    endpoint_once_allowed(alice, receiver.url("/other"))
    EgressAllowance.objects.create(tenant=alice, endpoint=opened, network="127.0.0.1/32")
    services.publish_event(tenant=alice, event_type="t", payload={})

    drain()

    assert len(receiver.requests_to("/opened")) == 1
    assert receiver.requests_to("/other") == []
    outcomes = {d.endpoint_id: d.last_outcome for d in Delivery.objects.all()}
    assert outcomes[opened.id] == "success"
    assert sorted(outcomes.values()) == ["blocked", "success"]


@pytest.mark.django_db
def test_an_allowance_cannot_name_another_tenants_endpoint(receiver):
    alice = services.tenant_create(name="alice")[0]
    bob = services.tenant_create(name="bob")[0]
    bobs = endpoint_once_allowed(bob, receiver.url("/bob"))
    with pytest.raises(ValidationError, match="another tenant"):
        services.egress_allowance_save(
            allowance=EgressAllowance(tenant=alice, endpoint=bobs, network="127.0.0.0/8")
        )
    with pytest.raises(ValidationError, match="not a CIDR"):
        services.egress_allowance_save(
            allowance=EgressAllowance(tenant=alice, network="10.0.0.1/8")
        )
    assert not EgressAllowance.objects.exists()

    # A row written past the service (by hand, in SQL) still opens nothing for bob.
    from deliveries.selectors import allowed_networks

    EgressAllowance.objects.create(tenant=alice, endpoint=bobs, network="127.0.0.0/8")
    EgressAllowance.objects.create(tenant=bob, network="not-a-network")  # opens nothing
    assert allowed_networks([(bob.id, bobs.id), (alice.id, None), (None, None)]) == {
        (bob.id, bobs.id): (),
        (alice.id, None): (),
        (None, None): (),
    }


def api_client(tenant_name: str):
    tenant, key = services.tenant_create(name=tenant_name)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client, tenant


@pytest.mark.django_db
def test_the_api_accepts_a_private_url_only_where_an_allowance_opens_it():
    alice, alice_tenant = api_client("alice")
    bob, _ = api_client("bob")
    EgressAllowance.objects.create(tenant=alice_tenant, network="10.20.0.0/16")
    # Even an allowance for all of link-local leaves the metadata address refused.
    EgressAllowance.objects.create(tenant=alice_tenant, network="169.254.0.0/16")

    private = {"url": "http://10.20.0.5/hook"}
    created = alice.post("/api/v1/endpoints/", private, format="json")
    assert created.status_code == 201, created.content
    refused = bob.post("/api/v1/endpoints/", private, format="json")
    assert refused.status_code == 400 and "url" in refused.json()["error"]["details"]
    metadata = alice.post("/api/v1/endpoints/", {"url": "http://169.254.169.254/"}, format="json")
    assert metadata.status_code == 400

    # An endpoint's own allowance counts when that endpoint's URL changes, not for others.
    endpoint_id = created.json()["id"]
    EgressAllowance.objects.create(
        tenant=alice_tenant, endpoint_id=endpoint_id, network="10.30.0.0/16"
    )
    moved = alice.patch(
        f"/api/v1/endpoints/{endpoint_id}/", {"url": "http://10.30.0.9/hook"}, format="json"
    )
    assert moved.status_code == 200, moved.content
    other = alice.post("/api/v1/endpoints/", {"url": "http://10.30.0.9/hook"}, format="json")
    assert other.status_code == 400


@pytest.mark.django_db
def test_a_tenants_poll_source_reaches_what_its_tenant_was_opened_and_no_one_else_does():
    alice = services.tenant_create(name="alice")[0]
    bob = services.tenant_create(name="bob")[0]
    EgressAllowance.objects.create(tenant=alice, network="127.0.0.0/8")
    provider = FakeProvider(StaticRecords(3)).start()
    try:
        for slug, tenant in [("alice-crm", alice), ("bob-crm", bob), ("ops-crm", None)]:
            poll_source_create(
                slug=slug,
                config=provider.config(),
                tenant=tenant,
                auth_secret=provider.token,
                schedule=False,
            )
        alices = poll_source_run(slug="alice-crm")
        reached = len(provider.requests)
        others = [poll_source_run(slug=slug) for slug in ("bob-crm", "ops-crm")]
    finally:
        provider.stop()
    assert alices.outcome == "polled", alices.error
    assert reached > 0
    for result in others:  # bob's, and the operator's own (no tenant)
        assert result.outcome == "failed" and "blocked" in result.error
    assert len(provider.requests) == reached  # refused before connecting


@pytest.mark.django_db
def test_staff_open_a_network_in_the_admin_audited_and_only_with_the_add_permission(client):
    alice = services.tenant_create(name="alice")[0]
    staff = User.objects.create_user("ops", password="pw-ops-12345", is_staff=True)
    staff.user_permissions.add(Permission.objects.get(codename="view_egressallowance"))
    client.force_login(staff)
    form = {"tenant": str(alice.id), "endpoint": "", "network": " 10.20.0.0/16 ", "note": "VPC"}

    assert client.post("/admin/deliveries/egressallowance/add/", form).status_code == 403
    staff.user_permissions.add(Permission.objects.get(codename="add_egressallowance"))
    staff = User.objects.get(pk=staff.pk)  # permissions are cached on the user
    client.force_login(staff)
    assert client.post("/admin/deliveries/egressallowance/add/", form).status_code == 302

    allowance = EgressAllowance.objects.get()
    assert (allowance.network, allowance.created_by) == ("10.20.0.0/16", staff)
    entry = AuditEntry.objects.get(action="egress_allowance.create")
    assert entry.actor == staff and entry.details["network"] == "10.20.0.0/16"
    page = client.get(f"/admin/deliveries/egressallowance/{allowance.pk}/delete/")
    assert page.status_code == 403  # no delete permission


@pytest.mark.django_db
def test_the_admin_form_and_full_clean_count_the_tenants_allowances():
    alice = services.tenant_create(name="alice")[0]
    bob = services.tenant_create(name="bob")[0]
    EgressAllowance.objects.create(tenant=alice, network="10.20.0.0/16")
    url = "http://10.20.3.4/hook"

    Endpoint(tenant=alice, url=url).full_clean()  # opened for alice
    with pytest.raises(ValidationError, match="cannot receive webhooks"):
        Endpoint(tenant=bob, url=url).full_clean()
    with pytest.raises(ValidationError, match="cannot receive webhooks"):
        Endpoint(tenant=alice, url="http://169.254.169.254/latest/").full_clean()
