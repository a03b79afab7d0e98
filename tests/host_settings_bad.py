"""tests/host_settings.py with two of the apps' settings wrong, given in the namespace."""

from tests.host_settings import *  # noqa: F403

TRUSTY_WEBHOOKS = {"EGRESS_ALLOW_NETWORKS": ["not-a-network"], "QUEUE_VISIBILITY_TIMEOUT": 5}
