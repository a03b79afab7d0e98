"""A host links its own account model to a tenant by external_id."""

import threading

import pytest
from django.db import connection

from deliveries import services
from deliveries.models import ApiKey, Tenant
from deliveries.services import DomainError
from tests.conftest import in_thread

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.sqlite]


def test_the_first_call_makes_the_tenant_and_later_ones_find_it():
    made, created = services.tenant_get_or_create(external_id="acct_42", name="Acme")
    found, again = services.tenant_get_or_create(external_id="acct_42", name="ignored")
    assert (created, again) == (True, False)
    assert found.pk == made.pk and found.name == "Acme"
    assert not ApiKey.objects.filter(tenant=made).exists()  # made on request only
    unnamed, _ = services.tenant_get_or_create(external_id="acct_43")
    assert unnamed.name == "acct_43"


def test_tenants_made_without_an_external_id_do_not_collide():
    services.tenant_create(name="one")
    services.tenant_create(name="two")
    assert list(Tenant.objects.values_list("external_id", flat=True)) == [None, None]


@pytest.mark.parametrize(
    ("kwargs", "code"),
    [
        ({"external_id": "  "}, "invalid_external_id"),
        ({"external_id": "acct_1", "time_zone": "Mars/Olympus"}, "invalid_time_zone"),
        ({"external_id": "acct_1", "name": "taken"}, "exists"),
    ],
)
def test_bad_calls_are_refused_with_a_code_and_make_nothing(kwargs, code):
    services.tenant_create(name="taken")
    with pytest.raises(DomainError) as refused:
        services.tenant_get_or_create(**kwargs)
    assert refused.value.code == code
    assert Tenant.objects.count() == 1


@pytest.mark.skipif(connection.vendor != "postgresql", reason="concurrent writers")
def test_concurrent_first_calls_make_one_tenant():
    results, errors = [], []
    start = threading.Barrier(4)

    def call():
        start.wait()
        results.append(services.tenant_get_or_create(external_id="acct_race")[0].pk)

    threads = [in_thread(call, errors) for _ in range(4)]
    for t in threads:
        t.join(30)
    assert errors == []
    assert len(set(results)) == 1 and len(results) == 4
    assert Tenant.objects.filter(external_id="acct_race").count() == 1
