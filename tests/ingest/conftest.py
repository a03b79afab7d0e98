import asyncio
import contextlib
import smtplib
import threading
import uuid

import pytest

from ingest.sources import source_create

SECRET = "whsec_test_secret"


@pytest.fixture
def stripe():
    """The inbound source ``stripe`` (scheme stripe), signed with ``SECRET``."""
    return source_create(slug="stripe", scheme="stripe", secrets=[SECRET])


# --- Inbound email ----------------------------------------------------------------------

ADDRESSES = ["support@example.com", "@inbound.example.com"]


def message(
    *,
    subject="Printer on fire",
    to="support@example.com",
    sender="ann@example.org",
    message_id=None,
    date="Tue, 01 Jul 2025 10:00:00 +0000",
    body="It is on fire.",
    headers="",
) -> bytes:
    """A plain RFC 5322 message (CRLF line ends), with a fresh Message-ID unless given."""
    message_id = message_id if message_id is not None else f"<{uuid.uuid4().hex}@example.org>"
    lines = [
        f"From: Ann <{sender}>",
        f"To: {to}",
        f"Subject: {subject}",
        f"Date: {date}",
        *([f"Message-ID: {message_id}"] if message_id else []),
        "MIME-Version: 1.0",
        'Content-Type: text/plain; charset="utf-8"',
    ]
    head = "\r\n".join(lines) + "\r\n" + headers
    return (head + "\r\n" + body + "\r\n").encode()


@pytest.fixture
def smtp_source(db):
    """The smtp source ``mail``, accepting ``ADDRESSES``."""
    return source_create(slug="mail", scheme="smtp", secrets=[], options={"addresses": ADDRESSES})


@contextlib.contextmanager
def smtp_listener(slug: str = "mail"):
    """The real listener (ingest.smtp.Listener) on a free loopback port, served by an
    event loop in a thread of its own; yields the Listener (``bound_port``). Leaving the
    block stops it as SIGTERM would."""
    from ingest.smtp import Listener

    listener = Listener(slug, host="127.0.0.1", port=0)
    ready, failed = threading.Event(), []
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def run() -> None:
        try:
            loop.run_until_complete(listener.run(stop, lambda port: ready.set()))
        except BaseException as exc:
            failed.append(exc)
            ready.set()
        finally:
            loop.close()

    thread = threading.Thread(target=run)
    thread.start()
    assert ready.wait(30), "the listener did not start"
    if failed:
        thread.join()
        raise failed[0]
    try:
        yield listener
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(60)
        assert not thread.is_alive(), "the listener did not stop"
    if failed:
        raise failed[0]


@pytest.fixture
def listener(smtp_source):
    with smtp_listener() as running:
        yield running


def smtp_client(port: int) -> smtplib.SMTP:
    return smtplib.SMTP("127.0.0.1", port, local_hostname="client.example.org", timeout=30)


def settle() -> int:
    """Move the clock past INBOUND_EMAIL_ORDER_WINDOW for the stored emails waiting it out
    (sequenced, never dispatched): they are due now."""
    from django.utils import timezone

    from ingest.models import InboundEvent

    return InboundEvent.objects.filter(state="pending", sequenced=True, dispatch_count=0).update(
        next_attempt_at=timezone.now()
    )
