"""The inbound app's settings, each with its default here (deliveries/conf.py explains the
lookup: ``TRUSTY_WEBHOOKS``, then the flat setting, then this default). ``settings`` also
answers the outbound app's names, which the inbound side shares (loops, alerts)."""

from datetime import timedelta

from deliveries import conf as deliveries_conf

DEFAULTS: dict[str, object] = {
    # Modules that register inbound handlers with @ingest.handlers.handler (imported at
    # start); how long a web process trusts its cached copy of a source (0: no cache).
    "INGEST_HANDLER_MODULES": (),
    "INGEST_SOURCE_CACHE_SECONDS": 5.0,
    # Finished inbound events are pruned after these days, never before the dedupe window
    # (seconds): the row is the identity that makes a provider's late retry a duplicate.
    "RETENTION_INBOUND_DAYS": 30.0,
    "INBOUND_DEDUPE_WINDOW": 7 * 86400.0,
    # Signature failures of one source between two alert checks that open an incident.
    "ALERTS_VERIFICATION_FAILURE_THRESHOLD": 20,
    # Polling and backfill: the lease (renewed every page), pages per run, bytes per page,
    # retries of a request with no answer, a 429 or a 5xx.
    "POLL_LEASE_SECONDS": 300.0,
    "BACKFILL_LEASE_SECONDS": 300.0,
    "POLL_MAX_PAGES": 1000,
    "POLL_MAX_RESPONSE_BYTES": 16 * 1024 * 1024,
    "BACKFILL_RETRIES": 5,
}

# The unit of each of these that is a duration (deliveries/conf.py, UNITS).
UNITS = {
    "INGEST_SOURCE_CACHE_SECONDS": deliveries_conf.SECOND,
    "RETENTION_INBOUND_DAYS": timedelta(days=1),
    "INBOUND_DEDUPE_WINDOW": deliveries_conf.SECOND,
    "POLL_LEASE_SECONDS": deliveries_conf.SECOND,
    "BACKFILL_LEASE_SECONDS": deliveries_conf.SECOND,
}

settings = deliveries_conf.AppSettings(
    deliveries_conf.DEFAULTS, DEFAULTS, units={**deliveries_conf.UNITS, **UNITS}
)
