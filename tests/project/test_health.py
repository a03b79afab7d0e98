import pytest
from django.test import Client

pytestmark = pytest.mark.sqlite


def test_healthz_answers_without_the_database():
    assert Client().get("/healthz").json() == {"status": "ok"}


@pytest.mark.django_db
def test_readyz_checks_database_migrations_and_broker():
    r = Client().get("/readyz")
    assert r.status_code == 200
    assert r.json()["checks"] == {"database": "ok", "migrations": "ok", "broker": "ok"}


@pytest.mark.django_db
def test_readyz_is_503_when_the_broker_is_unreachable(settings, monkeypatch):
    from django_q.brokers.redis_broker import Redis

    import deliveries.jobs.brokers

    unreachable = Redis.__new__(Redis)
    import redis

    unreachable.connection = redis.Redis.from_url("redis://127.0.0.1:1/0")
    monkeypatch.setattr(deliveries.jobs.brokers, "get_broker", lambda: unreachable)
    r = Client().get("/readyz")
    assert r.status_code == 503
    assert r.json()["checks"]["broker"] == "unavailable"


@pytest.mark.django_db
def test_the_interactive_api_page_serves_its_own_assets():
    page = Client().get("/api/docs/")
    assert page.status_code == 200
    assert b"swagger-ui" in page.content
    assert b"cdn.jsdelivr" not in page.content
