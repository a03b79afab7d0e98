"""The SMTP listener, driven by real mail sent with smtplib: in a thread of the test
process (the fast cases) and as the real ``manage.py run_smtp`` process (kill -9 between
the commit and the answer, SIGTERM)."""

import base64
import datetime
import logging
import smtplib
import ssl
import threading
import time

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID
from django.db import connection

from deliveries.jobs.models import Outbox
from ingest.models import InboundEmail, InboundEvent, SourceSecret, VerificationFailure
from ingest.smtp import quiet_library_log
from tests.conftest import subprocess_env
from tests.ingest.conftest import message, smtp_client, smtp_listener

pytestmark = pytest.mark.django_db(transaction=True)


def refusals(source) -> dict:
    return dict(VerificationFailure.objects.filter(source=source).values_list("reason", "count"))


def stored_with_job(event_ids) -> set:
    return set(Outbox.objects.filter(ref_id__in=event_ids).values_list("ref_id", flat=True))


def test_a_message_is_stored_once_and_answered_only_after_its_commit(listener, smtp_source):
    raw = message(to="support+ticket-123@example.com", message_id="<m1@example.org>")
    with smtp_client(listener.bound_port) as client:
        client.ehlo()
        assert client.has_extn("size")
        assert client.sendmail("ann@example.org", ["support+ticket-123@example.com"], raw) == {}
        code, reply = client.docmd("NOOP")
        # The same Message-ID again, as a sender retrying would: one row, counted.
        client.mail("ann@example.org")
        client.rcpt("support+ticket-123@example.com")
        code, reply = client.data(raw)
    event = InboundEvent.objects.get()
    assert code == 250 and str(event.id).encode() in reply
    # About an entity: due once INBOUND_EMAIL_ORDER_WINDOW has passed, then admitted.
    assert (event.event_type, event.entity_id, event.state) == (
        "support@example.com",
        "ticket-123",
        "pending",
    )
    assert event.next_attempt_at > event.received_at
    assert event.duplicates == 1 and bytes(event.body) == raw
    assert event.occurred_at == datetime.datetime(2025, 7, 1, 10, tzinfo=datetime.UTC)
    email = InboundEmail.objects.get()
    assert (email.mail_from, email.recipient, email.subject, email.message_id) == (
        "ann@example.org",
        "support+ticket-123@example.com",
        "Printer on fire",
        "m1@example.org",
    )
    assert email.transport == "smtp" and not email.tls and email.remote_addr == "127.0.0.1"
    assert stored_with_job([event.id]) == set()


def test_each_accepted_recipient_gets_its_own_event(listener):
    raw = message(to="support@example.com, orders@inbound.example.com")
    with smtp_client(listener.bound_port) as client:
        client.sendmail(
            "ann@example.org", ["support@example.com", "Orders@Inbound.Example.com"], raw
        )
    assert sorted(InboundEvent.objects.values_list("event_type", flat=True)) == [
        "orders@inbound.example.com",
        "support@example.com",
    ]
    assert {tuple(e.recipients) for e in InboundEmail.objects.all()} == {
        ("support@example.com", "orders@inbound.example.com")
    }


def test_a_message_id_is_stored_once_per_recipient_however_the_copies_are_split(listener):
    """A sender's retry may carry all the recipients again, some of them, or a new one
    (an MTA splits and regroups them): each address keeps one event, every copy of it
    counted on it."""
    raw = message(to="support@example.com, orders@inbound.example.com", message_id="<r@x>")
    replies = []
    with smtp_client(listener.bound_port) as client:
        client.ehlo()
        for recipients in (
            ["support@example.com", "orders@inbound.example.com"],
            ["orders@inbound.example.com", "support@example.com"],  # all again
            ["support@example.com"],  # one of them again
            ["support@example.com", "billing@inbound.example.com"],  # and a new one
        ):
            client.mail("ann@example.org")
            for recipient in recipients:
                client.rcpt(recipient)
            replies.append(client.data(raw))
    assert [code for code, _ in replies] == [250] * 4
    stored = dict(InboundEvent.objects.values_list("event_type", "duplicates"))
    assert stored == {
        "support@example.com": 3,
        "orders@inbound.example.com": 1,
        "billing@inbound.example.com": 0,
    }
    assert InboundEmail.objects.filter(message_id="r@x").count() == 3
    assert stored_with_job(InboundEvent.objects.values_list("id", flat=True)) == set(
        InboundEvent.objects.values_list("id", flat=True)
    )


def test_a_recipient_not_configured_is_refused_at_rcpt(smtp_source):
    with smtp_listener() as running, smtp_client(running.bound_port) as client:
        client.ehlo()
        client.mail("ann@example.org")
        assert client.rcpt("nobody@example.com")[0] == 550
        assert client.rcpt("support@elsewhere.example")[0] == 550
        client.rset()
        with pytest.raises(smtplib.SMTPRecipientsRefused):
            client.sendmail("ann@example.org", ["billing@example.com"], message())
    assert InboundEvent.objects.count() == 0
    assert refusals(smtp_source) == {"recipient_refused": 3}  # written when it stopped


def test_a_message_over_the_limit_is_refused_during_data_and_kept_nowhere(smtp_source):
    smtp_source.max_body_bytes = 4000
    smtp_source.save()
    big = message(body="x" * 200 + ("\r\n" + "y" * 70) * 200)  # about 14 KB
    with smtp_listener() as running, smtp_client(running.bound_port) as client:
        # Announced with SIZE: refused at MAIL FROM, before any byte of it.
        with pytest.raises(smtplib.SMTPSenderRefused) as announced:
            client.sendmail("ann@example.org", ["support@example.com"], big)
        assert announced.value.smtp_code == 552
        client.rset()
        # Not announced: the limit holds while the message arrives.
        client.mail("ann@example.org")
        client.rcpt("support@example.com")
        code, _ = client.data(big)
        assert code == 552
        # The session goes on: a message within the limit is taken.
        assert client.sendmail("ann@example.org", ["support@example.com"], message()) == {}
    assert InboundEvent.objects.count() == 1
    assert refusals(smtp_source) == {"too_large": 2}


def _zip(name: str, data: bytes) -> bytes:
    import io
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(name, data)
    return buffer.getvalue()


def _with_attachment(filename: str, data: bytes) -> bytes:
    from email.message import EmailMessage

    mail = EmailMessage()
    mail["From"] = "ann@example.org"
    mail["To"] = "support@example.com"
    mail["Subject"] = "see attached"
    mail["Message-ID"] = f"<{filename}@example.org>"
    mail.set_content("attached")
    mail.add_attachment(data, maintype="application", subtype="zip", filename=filename)
    return mail.as_bytes(policy=mail.policy.clone(linesep="\r\n"))


HOSTILE = {
    "header_injection": message(subject="=?utf-8?q?hi=0D=0ABcc=3A_victim=40example=2Eorg?="),
    "malformed_mime": (
        b"From: ann@example.org\r\nTo: support@example.com\r\nMIME-Version: 1.0\r\n"
        b'Content-Type: multipart/mixed; boundary="b1"\r\n\r\nno boundary ever\r\n'
    ),
    "nested_archive": _with_attachment("outer.zip", _zip("inner.zip", _zip("x.txt", b"x"))),
    # 1 MiB of empty parts: refused on its bytes at once, where parsing first took ~12 s.
    "too_many_parts": (
        b"From: ann@example.org\r\nTo: support@example.com\r\nMIME-Version: 1.0\r\n"
        b"Content-Type: multipart/mixed; boundary=b\r\n\r\n" + b"--b\r\n\r\nx\r\n" * 100_000
    ),
}


@pytest.mark.parametrize("reason", sorted(HOSTILE))
def test_hostile_mail_is_stored_rejected_with_its_reason_and_no_job(listener, smtp_source, reason):
    with smtp_client(listener.bound_port) as client:
        client.ehlo()
        client.mail("ann@example.org")
        client.rcpt("support@example.com")
        code, reply = client.data(HOSTILE[reason])
        assert (code, reply) == (554, f"5.6.0 Message rejected: {reason}".encode())
        # The listener is still there for the next message.
        assert client.sendmail("ann@example.org", ["support@example.com"], message()) == {}
    rejected = InboundEvent.objects.get(state="rejected")
    assert rejected.last_error == f"rejected: {reason}"
    assert InboundEmail.objects.get(event=rejected).rejected_reason == reason
    assert stored_with_job([rejected.id]) == set()
    assert InboundEvent.objects.filter(state="enqueued").count() == 1
    assert refusals(smtp_source) == {reason: 1}


def test_the_null_sender_of_a_bounce_is_taken(listener):
    with smtp_client(listener.bound_port) as client:
        assert client.sendmail("<>", ["support@example.com"], message(subject="Undelivered")) == {}
    assert InboundEmail.objects.get().mail_from == ""


def test_an_address_with_a_control_character_is_refused_before_data(listener, smtp_source):
    with smtp_client(listener.bound_port) as client:
        client.ehlo()
        assert client.docmd("MAIL FROM:<ann\x0bx@example.org>")[0] == 553
        assert client.docmd("MAIL FROM:<ann@example.org>")[0] == 250
        assert client.docmd("RCPT TO:<support\x01@example.com>")[0] == 553
    assert InboundEvent.objects.count() == 0


def test_a_flood_is_rate_limited_per_sender_and_per_recipient(smtp_source, settings):
    settings.INBOUND_EMAIL_RATE_PER_SENDER = 2
    settings.INBOUND_EMAIL_RATE_PER_RECIPIENT = 3
    answers = []
    with smtp_listener() as running, smtp_client(running.bound_port) as client:
        for sender in ["a@example.org"] * 3 + ["b@example.org", "c@example.org"]:
            try:
                client.sendmail(sender, ["support+x@example.com"], message(sender=sender))
                answers.append("ok")
            except smtplib.SMTPSenderRefused as exc:
                answers.append(exc.smtp_code)
            except smtplib.SMTPRecipientsRefused as exc:
                answers.append(exc.recipients["support+x@example.com"][0])
            client.rset()
    # a: two, then its sender limit; b: the recipient's third; c: past the recipient's.
    assert answers == ["ok", "ok", 450, "ok", 450]
    assert InboundEvent.objects.count() == 3
    assert refusals(smtp_source) == {"sender_rate_limited": 1, "recipient_rate_limited": 1}


# --- STARTTLS and AUTH ---------------------------------------------------------------


@pytest.fixture
def certificate(tmp_path):
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


def test_auth_is_required_and_taken_only_over_starttls(smtp_source, settings, certificate):
    settings.SMTP_TLS_CERT_FILE, settings.SMTP_TLS_KEY_FILE = map(str, certificate)
    SourceSecret.objects.create(source=smtp_source, secret="relay:correct-horse")
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    with smtp_listener() as running, smtp_client(running.bound_port) as client:
        client.ehlo()
        assert client.has_extn("starttls") and not client.has_extn("auth")
        assert client.docmd("MAIL FROM:<ann@example.org>")[0] == 530
        client.starttls(context=context)
        client.ehlo()
        with pytest.raises(smtplib.SMTPAuthenticationError):
            client.login("relay", "wrong")
        client.login("relay", "correct-horse")
        assert client.sendmail("ann@example.org", ["support@example.com"], message()) == {}
    email = InboundEmail.objects.get()
    assert email.tls and email.authenticated_as == "relay"
    # smtplib tries PLAIN, then LOGIN: two refused attempts with the wrong password.
    assert refusals(smtp_source) == {"auth_required": 1, "auth_failed": 2}


# --- DKIM, with a local key and a stub resolver ----------------------------------------

DKIM_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
DNS_RECORDS: dict[bytes, bytes] = {}


def stub_dns(name, timeout=5):
    """SMTP_DKIM_RESOLVER for the tests: TXT records from a dict, no network."""
    return DNS_RECORDS.get(name if isinstance(name, bytes) else name.encode())


def dkim_signed(raw: bytes) -> bytes:
    import dkim

    private = DKIM_KEY.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )
    public = DKIM_KEY.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    DNS_RECORDS[b"sel._domainkey.example.org."] = b"v=DKIM1; k=rsa; p=" + base64.b64encode(public)
    signature = dkim.sign(
        raw, b"sel", b"example.org", private, include_headers=[b"from", b"subject", b"to"]
    )
    return signature + raw


def test_dkim_is_checked_when_a_resolver_is_configured(smtp_source, settings):
    settings.SMTP_DKIM_RESOLVER = "tests.ingest.test_smtp.stub_dns"
    good = dkim_signed(message(subject="signed", message_id="<good@example.org>"))
    # The body changed, and the Message-ID (not signed), else it were a duplicate.
    forged = good.replace(b"It is on fire.", b"Wire the money.").replace(b"<good@", b"<forged@")
    with smtp_listener() as running, smtp_client(running.bound_port) as client:
        for raw in (good, forged, message(subject="unsigned")):
            client.sendmail("ann@example.org", ["support@example.com"], raw)
    verdicts = {e.message_id.split("@")[0]: e.authentication for e in InboundEmail.objects.all()}
    assert verdicts.pop("good") == {"dkim": "pass", "by": "smtp", "dkim_domain": "example.org"}
    assert verdicts.pop("forged") == {"dkim": "fail", "by": "smtp", "dkim_domain": "example.org"}
    assert list(verdicts.values()) == [{"dkim": "none", "by": "smtp"}]  # the unsigned one


def test_without_a_resolver_nothing_is_claimed(listener):
    raw = message(headers="Authentication-Results: mx.example.com; dkim=pass; spf=pass\r\n")
    with smtp_client(listener.bound_port) as client:
        client.sendmail("ann@example.org", ["support@example.com"], raw)
    # Straight from the sender: its own Authentication-Results prove nothing.
    assert InboundEmail.objects.get().authentication == {}


# --- Stopping ---------------------------------------------------------------------------

SLOW_LOOKUP = threading.Event()


def slow_dns(name, timeout=5):
    SLOW_LOOKUP.set()
    time.sleep(1.0)
    return None


def test_stopping_lets_a_message_being_stored_finish_and_tells_the_rest_421(smtp_source, settings):
    settings.SMTP_DKIM_RESOLVER = "tests.ingest.test_smtp.slow_dns"
    SLOW_LOOKUP.clear()
    answers: dict = {}
    with smtp_listener() as running:
        idle = smtp_client(running.bound_port)
        idle.ehlo()

        def send() -> None:
            with smtp_client(running.bound_port) as client:
                client.ehlo()
                client.mail("ann@example.org")
                client.rcpt("support@example.com")
                answers["data"] = client.data(dkim_signed(message()))
            connection.close()

        sender = threading.Thread(target=send)
        sender.start()
        assert SLOW_LOOKUP.wait(30)  # the message is being stored: now stop
    sender.join(30)
    assert answers["data"][0] == 250
    assert InboundEvent.objects.count() == 1
    assert idle.getreply()[0] == 421
    idle.close()


def test_aiosmtpds_command_log_is_quieted_unless_the_host_set_its_level():
    library = logging.getLogger("mail.log")  # aiosmtpd's
    saved = library.level
    try:
        library.setLevel(logging.NOTSET)
        quiet_library_log()
        assert library.getEffectiveLevel() == logging.WARNING
        library.setLevel(logging.DEBUG)  # a host's LOGGING named it: its choice stands
        quiet_library_log()
        assert library.level == logging.DEBUG
    finally:
        library.setLevel(saved)


# --- The real process: kill -9 between the commit and the answer, SIGTERM ---------------


def _start(commands, env):
    """``run_smtp`` on a free port; returns the port once it listens."""
    process = commands("run_smtp", "--source", "mail", "--port", "0", env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        out = process.stdout.read_text()
        if "listening on" in out:
            return process, int(out.split("listening on 127.0.0.1:")[1].split()[0])
        assert process.proc.poll() is None, process.output()
        time.sleep(0.05)
    raise AssertionError("run_smtp did not start: " + process.output())


def test_a_listener_killed_before_its_answer_loses_nothing_it_acknowledged(smtp_source, commands):
    first = message(message_id="<first@example.org>")
    # Dies (os._exit, as kill -9) right after the commit of its first message.
    dying, port = _start(commands, subprocess_env(FAULT_INJECT_AT="smtp.after_commit"))
    with pytest.raises(smtplib.SMTPServerDisconnected), smtp_client(port) as client:
        client.sendmail("ann@example.org", ["support@example.com"], first)
    assert dying.proc.wait(30) == 137
    assert InboundEvent.objects.count() == 1  # committed, though never acknowledged

    running, port = _start(commands, subprocess_env())
    acknowledged, stop = [], threading.Event()
    with smtp_client(port) as client:
        # The sender never got its 250, so it sends again: a duplicate, acknowledged.
        assert client.sendmail("ann@example.org", ["support@example.com"], first) == {}

    def stream() -> None:
        try:
            with smtp_client(port) as client:
                for n in range(1000):
                    if stop.is_set():
                        return
                    raw = message(message_id=f"<stream-{n}@example.org>")
                    client.sendmail("ann@example.org", ["support@example.com"], raw)
                    acknowledged.append(f"stream-{n}@example.org")
        except (smtplib.SMTPException, OSError):
            return  # the listener died under it

    sender = threading.Thread(target=stream)
    sender.start()
    deadline = time.monotonic() + 30
    while len(acknowledged) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    running.kill()  # SIGKILL, mid-stream
    stop.set()
    sender.join(30)
    assert len(acknowledged) >= 5
    stored = set(InboundEmail.objects.values_list("message_id", flat=True))
    assert set(acknowledged) <= stored
    assert InboundEvent.objects.get(event_id__startswith="<first@").duplicates == 1
    # The project's LOGGING takes INFO at the root and names no level for aiosmtpd, as a
    # host's may: run_smtp keeps its line per SMTP command out of the logs.
    log = running.stderr.read_text()
    assert '"action": "ingest.email"' in log and '"logger": "mail.log"' not in log

    # SIGTERM: an idle session is told 421 and the process exits cleanly.
    stopping, port = _start(commands, subprocess_env())
    idle = smtp_client(port)
    idle.ehlo()
    assert stopping.stop(timeout=60) == 0
    assert idle.getreply()[0] == 421
    idle.close()
    assert "stopped" in stopping.stdout.read_text()
