"""``QUEUE_BROKER_CLASS = "deliveries.broker.DatabaseBroker"``, a value deployments may
have set, keeps naming the database broker, which lives in deliveries.jobs.broker."""

from deliveries.jobs.broker import DatabaseBroker

__all__ = ["DatabaseBroker"]
