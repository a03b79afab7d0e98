"""Moved to ``deliveries.jobs.brokers`` (one module per broker); this path stays for one
release."""

import warnings

from deliveries.jobs.brokers import *  # noqa: F403
from deliveries.jobs.brokers import (  # noqa: F401
    READABLE_VERSIONS,
    Message,
    UnreadableMessage,
    acknowledge,
    get_broker,
    publish,
    receive,
)
from deliveries.jobs.brokers.database import DatabaseBroker  # noqa: F401

warnings.warn(
    "deliveries.jobs.broker moved to deliveries.jobs.brokers (DatabaseBroker: "
    "deliveries.jobs.brokers.database); import it from there",
    DeprecationWarning,
    stacklevel=2,
)
