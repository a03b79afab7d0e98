"""The database-tagged system check: run by `check --database` and by `migrate`, never by a
plain `check` (it asks the server)."""

import pytest
from django.core.checks import run_checks
from django.db import connection

from deliveries.checks import (
    autovacuum_warnings,
    check_database_server,
    check_metrics_access,
    check_shared_cache,
)


def test_autovacuum_off_is_a_warning_that_names_the_database_and_the_fix():
    (warning,) = autovacuum_warnings("default", autovacuum=False)
    assert warning.id == "deliveries.W001"
    assert "'default'" in warning.msg
    assert "docs/deployment.md" in warning.hint
    assert autovacuum_warnings("default", autovacuum=True) == []


@pytest.mark.django_db
def test_the_check_reads_the_server_setting_of_each_database_it_is_given():
    with connection.cursor() as cursor:
        cursor.execute("SHOW autovacuum")
        (shown,) = cursor.fetchone()
    assert shown in ("on", "off")
    expected = ["deliveries.W001"] if shown == "off" else []
    assert [w.id for w in check_database_server(None, databases=["default"])] == expected
    assert check_database_server(None, databases=None) == []


@pytest.mark.django_db
def test_only_checks_given_databases_ask_the_server():
    assert "deliveries.W001" not in [m.id for m in run_checks()]
    with connection.cursor() as cursor:
        cursor.execute("SHOW autovacuum")
        (shown,) = cursor.fetchone()
    asked = [m.id for m in run_checks(databases=["default"])]
    assert ("deliveries.W001" in asked) == (shown == "off")


def test_one_queue_name_for_the_pipeline_and_django_q2_is_refused(settings):
    from django.core.exceptions import ImproperlyConfigured

    from deliveries.checks import check_delivery_settings
    from deliveries.jobs.brokers import get_broker

    assert "deliveries.E007" not in [e.id for e in check_delivery_settings(None)]
    settings.QUEUE_NAME = settings.Q_CLUSTER["name"]

    assert "deliveries.E007" in [e.id for e in check_delivery_settings(None)]
    with pytest.raises(ImproperlyConfigured, match="QUEUE_NAME"):
        get_broker()


def test_a_heartbeat_period_that_is_not_positive_is_refused(settings):
    from deliveries.checks import check_delivery_settings

    assert "deliveries.E008" not in [e.id for e in check_delivery_settings(None)]
    for period in (0, -1.0):
        settings.LOOP_HEARTBEAT_SECONDS = period
        assert "deliveries.E008" in [e.id for e in check_delivery_settings(None)]


@pytest.mark.parametrize("name", ["WORKER_LANES", "WORKER_BATCH_SIZE", "WORKER_CONCURRENCY"])
def test_a_worker_with_no_lane_batch_or_request_slot_is_refused(settings, name):
    from deliveries.checks import check_delivery_settings

    assert "deliveries.E021" not in [e.id for e in check_delivery_settings(None)]
    setattr(settings, name, 0)
    errors = [e for e in check_delivery_settings(None) if e.id == "deliveries.E021"]
    assert [e.msg for e in errors] == [f"{name} must be at least 1."]


@pytest.mark.parametrize(
    ("backend", "warned"),
    [
        ("django.core.cache.backends.locmem.LocMemCache", True),
        ("django.core.cache.backends.dummy.DummyCache", True),
        ("django.core.cache.backends.filebased.FileBasedCache", True),
        ("django.core.cache.backends.db.DatabaseCache", False),
        ("django.core.cache.backends.redis.RedisCache", False),
    ],
)
def test_a_cache_each_process_keeps_to_itself_is_a_warning(settings, backend, warned):
    settings.CACHES = {"default": {"BACKEND": backend, "LOCATION": "/tmp/unused"}}
    assert [w.id for w in check_shared_cache(None)] == (["deliveries.W002"] if warned else [])


def test_the_default_cache_is_shared():
    assert check_shared_cache(None) == []


def test_a_host_without_q_cluster_is_told_the_line_that_quiets_django_q2(settings):
    from deliveries.checks import check_q_cluster
    from deliveries.core.conf import q_cluster

    assert check_q_cluster(None) == []  # the standalone service sets it
    del settings.Q_CLUSTER
    (warning,) = check_q_cluster(None)
    assert warning.id == "deliveries.W004"
    assert "Q_CLUSTER = q_cluster()" in warning.hint
    settings.Q_CLUSTER = q_cluster()
    assert check_q_cluster(None) == []


def test_metrics_open_to_no_one_is_a_deploy_warning(settings):
    settings.METRICS_TOKEN, settings.METRICS_ALLOW_IPS = "", []
    assert [w.id for w in check_metrics_access(None)] == ["deliveries.W003"]
    settings.METRICS_TOKEN = "t"
    assert check_metrics_access(None) == []
    settings.METRICS_TOKEN, settings.METRICS_ALLOW_IPS = "", ["10.0.0.7"]
    assert check_metrics_access(None) == []


def test_a_broker_class_that_cannot_be_imported_is_refused_naming_the_database_broker(settings):
    from deliveries.checks import check_delivery_settings

    assert "deliveries.E006" not in [e.id for e in check_delivery_settings(None)]
    settings.QUEUE_BROKER_CLASS = "deliveries.brokers.DatabaseBroker"  # no such module
    [error] = [e for e in check_delivery_settings(None) if e.id == "deliveries.E006"]
    assert "deliveries.brokers.DatabaseBroker" in error.msg
    assert "deliveries.jobs.brokers.database.DatabaseBroker" in error.hint


def test_the_database_brokers_old_path_keeps_naming_it(settings):
    from deliveries.checks import check_delivery_settings
    from deliveries.jobs.brokers import broker_class
    from deliveries.jobs.brokers.database import DatabaseBroker

    settings.QUEUE_BROKER_CLASS = "deliveries.broker.DatabaseBroker"  # before deliveries.jobs
    assert broker_class() is DatabaseBroker
    assert "deliveries.E006" not in [e.id for e in check_delivery_settings(None)]
