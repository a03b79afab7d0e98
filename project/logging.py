"""JSON log lines with a stable ``action`` key.

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
import re
from datetime import UTC, datetime

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
_SECRET = re.compile(r"(whsec_|whk_)[A-Za-z0-9+/=_\-]{6,}")


def mask_secrets(text: str) -> str:
    if "whsec_" not in text and "whk_" not in text:
        return text
    return _SECRET.sub(lambda m: m.group(1) + "[redacted]", text)


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
