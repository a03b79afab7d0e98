"""Modules that moved keep their old import paths for one release: importing one warns
with the new path and gives the very module (or names) found there."""

import importlib
import sys

import pytest

MOVED = {
    "deliveries.conf": "deliveries.core.conf",
    "deliveries.timezones": "deliveries.core.timezones",
    "deliveries.logs": "deliveries.core.logs",
    "deliveries.egress": "deliveries.core.egress",
    "deliveries.headers": "deliveries.core.headers",
    "deliveries.prometheus": "deliveries.core.prometheus",
    "deliveries.admin_input": "deliveries.core.admin_input",
}


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_an_old_module_path_warns_and_is_the_new_module(old, new):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_the_old_broker_module_warns_and_names_the_same_classes():
    from deliveries.jobs.brokers import Message, get_broker
    from deliveries.jobs.brokers.database import DatabaseBroker

    sys.modules.pop("deliveries.jobs.broker", None)
    with pytest.warns(DeprecationWarning, match=r"deliveries\.jobs\.brokers"):
        old = importlib.import_module("deliveries.jobs.broker")
    assert (old.DatabaseBroker, old.Message, old.get_broker) == (
        DatabaseBroker,
        Message,
        get_broker,
    )


def test_the_retry_policy_answers_at_its_old_name_with_a_warning():
    from deliveries import policy
    from deliveries.core.retry import RetryPolicy

    with pytest.warns(DeprecationWarning, match=r"deliveries\.core\.retry\.RetryPolicy"):
        assert policy.RetryPolicy is RetryPolicy
    with pytest.raises(AttributeError):
        policy.NoSuchName  # noqa: B018


def test_an_old_broker_setting_still_names_its_broker(settings):
    from deliveries.jobs.brokers import broker_class
    from deliveries.jobs.brokers.database import DatabaseBroker
    from deliveries.jobs.brokers.redis import RedisBroker

    for value, cls in [
        ("deliveries.broker.DatabaseBroker", DatabaseBroker),
        ("deliveries.jobs.broker.DatabaseBroker", DatabaseBroker),
        ("django_q.brokers.redis_broker.Redis", RedisBroker),
    ]:
        settings.QUEUE_BROKER_CLASS = value
        assert broker_class() is cls
