"""Every log line emitted at DEBUG, by every logger, during a full outbound delivery and a
full inbound receipt: structured, and without a secret, an API key or a payload."""

import json
import logging
import secrets
import time

import pytest
from django.test import Client
from standardwebhooks.webhooks import Webhook

from deliveries import services
from deliveries.core.logs import JsonFormatter
from deliveries.models import Delivery
from ingest import handlers
from ingest.schemes import get_scheme
from ingest.sources import source_create
from tests.conftest import drain, make_due
from tests.receiver import fail_first

pytestmark = pytest.mark.django_db(transaction=True)

MARKER = "payload-marker-6c1f0e"


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.lines: list[str] = []
        self.formatter_ = JsonFormatter()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.lines.append(self.formatter_.format(record))


@pytest.fixture
def captured():
    """Every logger at DEBUG, each line captured as the JSON formatter writes it."""
    capture = Capture()
    loggers = [logging.getLogger()] + [
        logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
    ]
    saved = [(lg, lg.level, lg.disabled) for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.DEBUG)
        lg.disabled = False
        if lg is logging.getLogger() or not lg.propagate:
            lg.addHandler(capture)
    yield capture
    for lg, level, disabled in saved:
        lg.setLevel(level)
        lg.disabled = disabled
        lg.removeHandler(capture)


def raw(record: logging.LogRecord) -> str:
    """Everything a record carries, before any formatter could mask it."""
    return repr(vars(record)) + record.getMessage()


def assert_clean(capture: Capture, *forbidden: str) -> None:
    assert capture.records, "nothing was logged: the capture is broken"
    for record, line in zip(capture.records, capture.lines, strict=True):
        for secret in forbidden:
            assert secret not in raw(record), (secret[:8], line)
            assert secret not in line, (secret[:8], line)
        json.loads(line)  # one JSON object per line


def test_a_full_delivery_logs_no_secret_no_api_key_no_payload(tenant, receiver, captured):
    _, api_key = services.api_key_create(tenant=tenant)
    api = Client(HTTP_AUTHORIZATION=f"Bearer {api_key}")
    receiver.behaviours["/hook"] = fail_first(1)
    created = api.post(
        "/api/v1/endpoints/",
        {"url": receiver.url("/hook"), "event_types": [], "headers": {"x-token": "hdr-secret-9"}},
        content_type="application/json",
    )
    assert created.status_code == 201, created.content
    signing_secret = created.json()["secret"]
    published = api.post(
        "/api/v1/events/",
        {"event_type": "invoice.paid", "payload": {"note": MARKER}},
        content_type="application/json",
        HTTP_IDEMPOTENCY_KEY="k-1",
    )
    assert published.status_code == 201
    assert (
        Client().post("/api/v1/events/", {}, HTTP_AUTHORIZATION="Bearer whk_wrong").status_code
        == 401
    )

    drain()  # scheduler → relay → worker: the first attempt gets a 500
    make_due()
    drain()

    delivery = Delivery.objects.get()
    assert delivery.state == "succeeded" and delivery.attempt_count == 2
    last = receiver.requests_to("/hook")[-1]
    assert Webhook(signing_secret).verify(last.body, last.headers) == {"note": MARKER}
    actions = {getattr(r, "action", None) for r in captured.records}
    assert {"delivery.attempt", "workers.batch"} <= actions
    attempt = next(r for r in captured.records if getattr(r, "action", "") == "delivery.attempt")
    for key in ("delivery_id", "event_id", "tenant_id", "job_type", "duration_ms", "outcome"):
        assert getattr(attempt, key) not in (None, ""), key
    assert_clean(
        captured,
        signing_secret,
        signing_secret.removeprefix("whsec_"),
        api_key,
        api_key.removeprefix("whk_"),
        "hdr-secret-9",
        MARKER,
    )


def test_a_full_inbound_receipt_logs_no_secret_and_no_payload(captured):
    source_secret = "whsec_" + secrets.token_urlsafe(24)
    source_create(slug="logs", scheme="stripe", secrets=[source_secret])
    seen = []
    registration = handlers.Registration("logs", "*", lambda e: seen.append(e.event_id))
    handlers.REGISTRY.append(registration)
    try:
        body = json.dumps(
            {
                "id": "evt_logs",
                "object": "event",
                "type": "invoice.paid",
                "created": int(time.time()),
                "data": {"object": {"id": "in_1", "note": MARKER}},
            }
        ).encode()
        for secret, expected in [(source_secret, 200), ("whsec_not_it", 401)]:
            signed = get_scheme("stripe").sign(body=body, secret=secret)
            signed.pop("content-type", None)
            headers = {f"HTTP_{k.upper().replace('-', '_')}": v for k, v in signed.items()}
            r = Client().post("/ingest/logs/", body, content_type="application/json", **headers)
            assert r.status_code == expected
        drain()
    finally:
        handlers.REGISTRY.remove(registration)

    assert seen == ["evt_logs"]
    actions = {getattr(r, "action", None) for r in captured.records}
    assert {"ingest.received", "ingest.refused", "inbound.process"} <= actions
    processed = next(r for r in captured.records if getattr(r, "action", "") == "inbound.process")
    assert processed.outcome == "processed" and processed.job_type == "inbound"
    assert processed.duration_ms >= 0
    assert_clean(captured, source_secret, source_secret.removeprefix("whsec_"), MARKER)


def test_the_formatter_masks_a_secret_that_slipped_into_a_message():
    record = logging.makeLogRecord(
        {"msg": "oops %s", "args": ("whsec_c2VjcmV0c2VjcmV0c2VjcmV0",), "levelno": 20}
    )
    line = JsonFormatter().format(record)
    assert "c2VjcmV0c2VjcmV0" not in line
    assert "whsec_[redacted]" in line
