"""JSON log lines with a stable ``action`` key: ``JsonFormatter``, for a host's ``LOGGING``.

The apps log under two logger names, ``deliveries`` and ``ingest`` (and their children,
``deliveries.worker``, ``deliveries.jobs``, …); docs/install.md has a ``LOGGING`` that
writes them with this formatter.

Call sites log ``logger.info("...", extra={"action": "delivery.attempt", "delivery_id": ...})``;
every extra field lands in the JSON object. Secrets and payloads are never passed as extras.

Common fields: ``action`` (what happened, stable for alerting and search), ``job_type``
(``delivery`` or ``inbound``), ``delivery_id``, ``event_id``, ``tenant_id``,
``endpoint_id``, ``inbound_id``, ``source``, ``duration_ms``, ``outcome``. The catalogue of
actions is in docs/observability.md.

As a second line of defence, anything that looks like one of the service's own secrets
(an endpoint signing secret ``whsec_…`` or an API key ``whk_…``) is masked in the line,
whatever put it there (an exception message, a third-party logger).
"""

import json
import logging
from datetime import UTC, datetime

from deliveries.core.text import mask_secrets

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return mask_secrets(json.dumps(line, default=str))
