"""Statement: one name, the PostgreSQL text and the ORM spelling beside it."""

import pytest
from django.db import NotSupportedError, connection

from deliveries.core.sql import Statement
from deliveries.jobs.models import EntityLock

pytestmark = [pytest.mark.django_db, pytest.mark.sqlite]

KEYS = Statement("SELECT key FROM deliveries_entitylock WHERE owner = %(owner)s ORDER BY key")


@KEYS.elsewhere
def _(params):
    return list(EntityLock.objects.filter(owner=params["owner"]).order_by("key").values_list("key"))


def test_each_database_runs_its_spelling_and_both_answer_alike(django_assert_num_queries):
    from django.utils import timezone

    for key in ("b", "a"):
        EntityLock.objects.create(key=key, owner="me", expires_at=timezone.now())
    EntityLock.objects.create(key="c", owner="other", expires_at=timezone.now())
    with django_assert_num_queries(0 if connection.vendor == "postgresql" else 1):
        # The PostgreSQL spelling runs on psycopg's own cursor, which Django does not count.
        assert KEYS({"owner": "me"}) == [("a",), ("b",)]


def test_a_statement_without_an_orm_spelling_says_so_off_postgresql():
    only_postgres = Statement("SELECT pg_backend_pid()", returns="row")
    if connection.vendor == "postgresql":
        assert isinstance(only_postgres()[0], int)
    else:
        with pytest.raises(NotSupportedError):
            only_postgres()


def test_what_a_statement_returns_is_one_of_four_shapes():
    with pytest.raises(ValueError):
        Statement("SELECT 1", returns="cursor")


@pytest.mark.django_db(transaction=True)
def test_a_statement_after_the_connection_was_replaced_runs_on_the_new_one():
    if connection.vendor != "postgresql":
        pytest.skip("the cursor kept between statements is psycopg's")
    backend = Statement("SELECT pg_backend_pid()", returns="row")
    first = backend()[0]
    assert backend()[0] == first  # the same connection, and the cursor kept on it

    connection.close()

    assert backend()[0] != first
