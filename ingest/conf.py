"""The inbound app's settings, each with its default here (deliveries/core/conf.py explains the
lookup: ``TRUSTY_WEBHOOKS``, then the flat setting, then this default). ``settings`` also
answers the outbound app's names, which the inbound side shares (loops, alerts)."""

from datetime import timedelta

from deliveries.core import conf as deliveries_conf

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
    # The reverse proxies (CIDRs) whose X-Forwarded-For the receive view believes: a
    # request that one of them relays came from the last address the header names outside
    # them (docs/deployment.md). Empty: REMOTE_ADDR, whatever any header says.
    "INGEST_TRUSTED_PROXIES": (),
    # Inbound email (docs/inbound.md, "Email"): messages per minute accepted from one
    # envelope sender and for one recipient address (0: no limit); the checks' caps on a
    # message's MIME parts, their nesting, its attachments and each one's decoded size.
    "INBOUND_EMAIL_RATE_PER_SENDER": 60,
    "INBOUND_EMAIL_RATE_PER_RECIPIENT": 600,
    "INBOUND_EMAIL_MAX_PARTS": 100,
    "INBOUND_EMAIL_MAX_DEPTH": 10,
    "INBOUND_EMAIL_MAX_ATTACHMENTS": 20,
    "INBOUND_EMAIL_MAX_ATTACHMENT_BYTES": 10 * 1024 * 1024,
    # Seconds an email with an entity waits after it is stored before it may run, so that
    # one about the same entity dated earlier and arriving a moment later still runs
    # first (docs/inbound.md, "Time and order"; 0: no wait).
    "INBOUND_EMAIL_ORDER_WINDOW": 2.0,
    # The SMTP listener (manage.py run_smtp): where it listens, the name it greets with
    # ("": the host's name), STARTTLS's certificate and key files ("": no STARTTLS),
    # whether mail must come over TLS, recipients per message, idle seconds before a
    # session is closed, seconds a SIGTERM waits for messages being stored, threads that
    # store messages, and the DKIM key lookup ("": no DKIM check; "dns": the system's
    # resolver; or the dotted path of a function(name, timeout) returning the TXT record).
    "SMTP_HOST": "127.0.0.1",
    "SMTP_PORT": 2525,
    "SMTP_HOSTNAME": "",
    "SMTP_TLS_CERT_FILE": "",
    "SMTP_TLS_KEY_FILE": "",
    "SMTP_REQUIRE_TLS": False,
    "SMTP_MAX_RECIPIENTS": 50,
    "SMTP_IDLE_TIMEOUT": 300.0,
    "SMTP_SHUTDOWN_SECONDS": 30.0,
    "SMTP_STORE_THREADS": 4,
    "SMTP_DKIM_RESOLVER": "",
}

# The unit of each of these that is a duration (deliveries/core/conf.py, UNITS).
UNITS = {
    "INGEST_SOURCE_CACHE_SECONDS": deliveries_conf.SECOND,
    "RETENTION_INBOUND_DAYS": timedelta(days=1),
    "INBOUND_DEDUPE_WINDOW": deliveries_conf.SECOND,
    "INBOUND_EMAIL_ORDER_WINDOW": deliveries_conf.SECOND,
    "POLL_LEASE_SECONDS": deliveries_conf.SECOND,
    "BACKFILL_LEASE_SECONDS": deliveries_conf.SECOND,
    "SMTP_IDLE_TIMEOUT": deliveries_conf.SECOND,
    "SMTP_SHUTDOWN_SECONDS": deliveries_conf.SECOND,
}

settings = deliveries_conf.AppSettings(
    deliveries_conf.DEFAULTS, DEFAULTS, units={**deliveries_conf.UNITS, **UNITS}
)
