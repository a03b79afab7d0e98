"""Inbound email beyond the listener: the mail providers' signed posts (valid, forged,
stale) through the real receive view, the checks hostile mail meets, handlers under
entity locks, the admin and the metrics."""

import io
import json
import time
import zipfile
from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.utils import timezone

from deliveries.jobs.models import Outbox
from deliveries.models import AuditEntry
from ingest import handlers, mail, schemes
from ingest.models import InboundEmail, InboundEvent, SourceSecret, VerificationFailure
from ingest.receiving import email_receive
from ingest.schemes import email as scheme_email
from ingest.schemes import get_scheme
from ingest.sources import source_create
from tests.conftest import drain, scrape, value
from tests.ingest.conftest import ADDRESSES, message, settle

# Rolled back after each test; the tests that run the workers (drain) commit for real.
pytestmark = pytest.mark.django_db
WITH_WORKERS = pytest.mark.django_db(transaction=True)

CREDENTIAL = "inbound:s3cret-password"
SECRETS = {"mailgun": "key-mailgun-signing", "postmark": CREDENTIAL, "sendgrid": CREDENTIAL}


@pytest.fixture
def provider(request):
    """A source of the scheme named by the test's parameter, slug = scheme."""
    scheme = request.param
    return source_create(
        slug=scheme, scheme=scheme, secrets=[SECRETS[scheme]], options={"addresses": ADDRESSES}
    )


def post(source, raw, *, recipients=("support@example.com",), secret=None, timestamp=None,
         mail_from="ann@example.org", secure=True, remote="203.0.113.9", **meta):  # fmt: skip
    scheme = get_scheme(source.scheme, source.options)
    body, headers = scheme.post(
        raw=raw,
        recipients=list(recipients),
        mail_from=mail_from,
        secret=secret or SECRETS[source.scheme],
        timestamp=timestamp,
    )
    extra = {f"HTTP_{k.upper().replace('-', '_')}": v for k, v in headers.items()}
    extra.pop("HTTP_CONTENT_TYPE")
    # Mailgun's raw-MIME post goes only to a URL ending in "mime".
    path = f"/ingest/{source.slug}/" + ("mime" if source.scheme == "mailgun" else "")
    return Client(REMOTE_ADDR=remote).post(
        path,
        body,
        content_type=headers["content-type"],
        secure=secure,
        **extra,
        **meta,
    )


def refusals(source) -> dict:
    return dict(VerificationFailure.objects.filter(source=source).values_list("reason", "count"))


SCHEMES = ["mailgun", "postmark", "sendgrid"]


@pytest.mark.parametrize("provider", SCHEMES, indirect=True)
def test_a_signed_post_is_stored_once_per_recipient(provider):
    raw = message(to="support+t-7@example.com", message_id="<p1@example.org>")
    r = post(provider, raw, recipients=["support+t-7@example.com"])
    assert r.status_code == 200, r.content
    assert r.json()["status"] == "accepted"
    again = post(provider, raw, recipients=["support+t-7@example.com"])
    assert again.json() == {"status": "duplicate", "ids": r.json()["ids"]}
    event = InboundEvent.objects.get()
    # About an entity: it waits out INBOUND_EMAIL_ORDER_WINDOW (2 s) before it is due.
    assert (event.event_type, event.entity_id, event.state, event.duplicates) == (
        "support@example.com",
        "t-7",
        "pending",
        1,
    )
    assert event.sequenced and event.next_attempt_at == event.received_at + timedelta(seconds=2)
    assert bytes(event.body) == raw  # the message, not the provider's post
    email = InboundEmail.objects.get()
    assert (email.transport, email.subject, email.remote_addr) == (
        provider.scheme,
        "Printer on fire",
        "203.0.113.9",
    )


@pytest.mark.parametrize("provider", SCHEMES, indirect=True)
def test_a_forged_post_is_refused_and_creates_nothing(provider):
    forged = "key-wrong" if provider.scheme == "mailgun" else "inbound:guessed"
    r = post(provider, message(), secret=forged)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "unauthorized"  # generic: the reason is counted
    assert InboundEvent.objects.count() == 0 and Outbox.objects.count() == 0
    assert refusals(provider) == {"bad_signature": 1}


@pytest.mark.parametrize("provider", SCHEMES, indirect=True)
def test_a_stale_post_is_refused(provider):
    if provider.scheme == "mailgun":
        # A captured post replayed after the window (or one from a skewed clock).
        r = post(provider, message(), timestamp=int(time.time()) - 3600)
        expected = "stale_timestamp"
    else:
        # Basic auth has no timestamp: what goes stale is a rotated-out credential.
        SourceSecret.objects.filter(source=provider).update(
            expires_at=timezone.now() - timedelta(minutes=1)
        )
        SourceSecret.objects.create(source=provider, secret="inbound:the-new-one")
        r = post(provider, message())
        assert post(provider, message(), secret="inbound:the-new-one").status_code == 200
        expected = "bad_signature"
    assert r.status_code == 401
    assert refusals(provider) == {expected: 1}
    assert InboundEvent.objects.count() == (0 if provider.scheme == "mailgun" else 1)


@pytest.mark.parametrize("provider", ["mailgun"], indirect=True)
def test_a_mailgun_token_is_taken_once(provider):
    """Mailgun signs its timestamp and token, not the message: a captured post's
    signature on another message is refused within the window too."""
    scheme = get_scheme("mailgun")
    body, headers = scheme.post(
        raw=message(subject="genuine"),
        recipients=["support@example.com"],
        mail_from="a@example.org",
        secret=SECRETS["mailgun"],
    )
    swapped = body.replace(b"Subject: genuine", b"Subject: swapped")
    answers = [
        Client().post("/ingest/mailgun/mime", b, content_type=headers["content-type"]).status_code
        for b in (body, swapped)
    ]
    assert answers == [200, 401]
    assert list(InboundEmail.objects.values_list("subject", flat=True)) == ["genuine"]
    assert refusals(provider) == {"replayed_token": 1}


@pytest.mark.parametrize("provider", ["postmark", "sendgrid"], indirect=True)
def test_basic_auth_is_refused_over_plain_http_and_outside_the_allow_list(provider):
    assert post(provider, message(), secure=False).status_code == 401
    provider.options = {**provider.options, "allow_ips": ["198.51.100.0/24"]}
    provider.save()
    assert post(provider, message()).status_code == 401
    assert post(provider, message(), remote="198.51.100.7").status_code == 200
    assert refusals(provider) == {"insecure_transport": 1, "ip_not_allowed": 1}


@pytest.mark.parametrize("provider", ["sendgrid"], indirect=True)
def test_the_allow_list_sees_the_address_a_trusted_proxy_names(provider, settings):
    """Behind the shipped nginx every post comes from the proxy's address; the provider's
    is the last one X-Forwarded-For names outside INGEST_TRUSTED_PROXIES."""
    provider.options = {**provider.options, "allow_ips": ["198.51.100.0/24"]}
    provider.save()

    def relayed(forwarded_for, remote="127.0.0.1"):
        return post(provider, message(), remote=remote, HTTP_X_FORWARDED_FOR=forwarded_for)

    assert relayed("198.51.100.7").status_code == 401  # no proxy trusted: 127.0.0.1 posted
    settings.INGEST_TRUSTED_PROXIES = ["127.0.0.0/8", "10.0.0.0/8"]
    assert relayed("198.51.100.7").status_code == 200
    assert relayed("198.51.100.7, 10.1.2.3").status_code == 200  # through two proxies
    # What the client wrote itself comes first; the address its proxy saw, last.
    assert relayed("198.51.100.7, 203.0.113.9").status_code == 401
    # A header from a client no proxy relayed is not read at all.
    assert relayed("198.51.100.7", remote="203.0.113.9").status_code == 401
    assert relayed("not an address").status_code == 401
    assert refusals(provider) == {"ip_not_allowed": 4}
    assert set(InboundEmail.objects.values_list("remote_addr", flat=True)) == {"198.51.100.7"}


def test_a_trusted_proxy_that_is_no_network_fails_the_check(settings):
    from django.core.checks import run_checks

    settings.INGEST_TRUSTED_PROXIES = ["10.0.0.0/8", "proxy.internal"]
    errors = [e for e in run_checks() if e.id == "ingest.E001"]
    assert [e.msg for e in errors] == ["INGEST_TRUSTED_PROXIES: 'proxy.internal' is not a network."]


@pytest.mark.parametrize("provider", ["mailgun"], indirect=True)
def test_a_post_without_the_raw_message_is_a_400_and_stores_nothing(provider):
    scheme = get_scheme("mailgun")
    body, headers = scheme.post(
        raw=b"",
        recipients=["support@example.com"],
        mail_from="a@example.org",
        secret=SECRETS["mailgun"],
    )
    r = Client().post("/ingest/mailgun/", body, content_type=headers["content-type"])
    assert r.status_code == 400
    assert InboundEvent.objects.count() == 0
    assert refusals(provider) == {"unparseable_no_raw_message": 1}


@pytest.mark.parametrize("provider", ["sendgrid"], indirect=True)
def test_a_post_for_no_configured_address_is_stored_rejected(provider):
    r = post(provider, message(to="ceo@elsewhere.example"), recipients=["ceo@elsewhere.example"])
    assert r.status_code == 200
    assert r.json()["status"] == "rejected" and r.json()["reason"] == "no_accepted_recipient"
    event = InboundEvent.objects.get()
    assert event.state == "rejected" and not Outbox.objects.filter(ref_id=event.id).exists()


@pytest.mark.parametrize("provider", ["postmark"], indirect=True)
def test_a_flood_of_posts_from_one_sender_is_answered_429(provider, settings):
    settings.INBOUND_EMAIL_RATE_PER_SENDER = 2
    codes = [post(provider, message()).status_code for _ in range(3)]
    assert codes == [200, 200, 429]
    assert InboundEvent.objects.count() == 2
    assert refusals(provider) == {"sender_rate_limited": 1}


@pytest.mark.parametrize(
    "options",
    [
        {"addresses": "support@example.com"},  # a list, not one string
        {"addresses": ["no-at-sign"]},
        {"separator": "++"},
        {"entity_header": "Subject"},  # without its pattern
        {"entity_header": "Subject", "entity_pattern": "(unclosed"},
        {"allow_ips": ["not-a-network"]},
        {"allow_http": "yes"},
        {"header": "x-signature"},  # another scheme's option
    ],
)
def test_mail_source_options_are_checked_when_the_source_is_made(options):
    with pytest.raises(ValueError):
        source_create(slug="bad", scheme="sendgrid", secrets=[CREDENTIAL], options=options)
    with pytest.raises(ValueError):  # and an smtp source without addresses takes no mail
        source_create(slug="bad", scheme="smtp", secrets=[], options={})
    with pytest.raises(ValueError):  # a basic-auth credential is user:password
        source_create(slug="bad", scheme="postmark", secrets=["no-colon"], options={})


# --- Authentication evidence ------------------------------------------------------------

PROVIDER_VERDICT = (
    "Authentication-Results: mx.mailgun.org; dkim=pass header.d=example.org;"
    " spf=pass smtp.mailfrom=ann@example.org; dmarc=pass header.from=example.org\r\n"
)
SENDERS_OWN = "Authentication-Results: mx.mailgun.org; dkim=pass; spf=pass; dmarc=pass\r\n"


@pytest.mark.parametrize("provider", ["mailgun"], indirect=True)
def test_the_providers_verdicts_are_recorded_from_its_authentication_results(provider):
    raw = message(
        headers=(
            "Authentication-Results: mx.mailgun.org; dkim=fail header.d=example.org;"
            " spf=softfail; dmarc=fail\r\n" + SENDERS_OWN
        )
    )
    post(provider, raw)
    # The topmost is the provider's own; the one the message came with proves nothing.
    assert InboundEmail.objects.get().authentication == {
        "by": "mx.mailgun.org",
        "dkim": "fail",
        "spf": "softfail",
        "dmarc": "fail",
        "dkim_domain": "example.org",
    }


def test_sendgrids_own_fields_are_recorded_beside_them():
    source = source_create(slug="sg", scheme="sendgrid", secrets=[CREDENTIAL])
    post(source, message(headers=PROVIDER_VERDICT))
    assert InboundEmail.objects.get().authentication == {
        "by": "mx.mailgun.org",
        "spf": "pass",
        "dkim": "pass",
        "dmarc": "pass",
        "dkim_domain": "example.org",
    }


def test_a_providers_verdict_holding_nul_is_stored_escaped_not_a_500():
    source_create(slug="sg", scheme="sendgrid", secrets=[CREDENTIAL])
    body, content_type = scheme_email._multipart(
        [
            ("envelope", b'{"to": ["support@example.com"], "from": "ann@example.org"}'),
            ("SPF", b"pa\x00ss"),
            ("email", message()),
        ]
    )
    r = Client().post(
        "/ingest/sg/",
        body,
        content_type=content_type,
        secure=True,
        HTTP_AUTHORIZATION=get_scheme("sendgrid")._authorization(CREDENTIAL),
    )
    assert (r.status_code, r.json()["status"]) == (200, "accepted")
    assert InboundEmail.objects.get().authentication == {"spf": "pa\\x00ss", "by": "sendgrid"}


def _stored_text(email: InboundEmail) -> list[str]:
    """Every text value of the stored email and its event, JSON columns included."""
    event = email.event
    found = [event.event_id, event.event_type, event.entity_id, event.last_error]
    for f in InboundEmail._meta.concrete_fields:
        value = getattr(email, f.attname)
        found += [value] if isinstance(value, str) else []
        found += [str(v) for v in value] if isinstance(value, list) else []
        found += [f"{k}{v}" for k, v in value.items()] if isinstance(value, dict) else []
    return found


@pytest.mark.parametrize("transport", ["smtp", "sendgrid"])
def test_text_from_outside_is_stored_cleaned_wherever_it_lands(transport):
    """NUL and lone surrogates (no text or jsonb column takes them) in every value a
    transport hands the store besides the message: the message is stored, never lost
    to a database error."""
    poison = "x\x00\ud800y"
    source = source_create(slug="m", scheme=transport, secrets=[], options={"addresses": ADDRESSES})
    received = email_receive(
        source=source,
        post=schemes.MailPost(
            raw=message(),
            recipients=("support@example.com",),
            mail_from="ann@example.org",
            verdicts={"spf": poison, poison: "pass"},
        ),
        transport=transport,
        remote=poison,
        authenticated_as=poison,
        evidence={"dkim": poison, "dkim_domain": poison},
    )
    assert received.outcome == "accepted"
    stored = _stored_text(InboundEmail.objects.get())
    assert any("x\\x00\ufffdy" in text for text in stored)
    assert not [t for t in stored if "\x00" in t or any(0xD800 <= ord(c) <= 0xDFFF for c in t)]


# --- The checks hostile mail meets (ingest.mail, no database) ----------------------------


def _zip(*members: tuple[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in members:
            archive.writestr(name, data)
    return buffer.getvalue()


def _attached(*attachments: tuple[str, bytes], depth: int = 0) -> bytes:
    from email.message import EmailMessage

    outer = EmailMessage()
    outer["From"], outer["To"], outer["Subject"] = "a@example.org", "support@example.com", "x"
    outer.set_content("see attached")
    for filename, data in attachments:
        outer.add_attachment(
            data, maintype="application", subtype="octet-stream", filename=filename
        )
    for _ in range(depth):
        wrapper = EmailMessage()
        wrapper["From"], wrapper["Subject"] = "a@example.org", "fwd"
        wrapper.set_content("forwarded")
        wrapper.add_attachment(outer)
        outer = wrapper
    return outer.as_bytes()


LIMITS = mail.Limits(max_parts=20, max_depth=4, max_attachments=3, max_attachment_bytes=1000)
# "x\r\nBcc: v@example.org" in an encoded word.
INJECTED = "Reply-To: =?utf-8?b?eA0KQmNjOiB2QGV4YW1wbGUub3Jn?= <x@example.org>\r\n"
REFUSED = {
    "header_injection": message(headers=INJECTED),
    "malformed_mime": b"\x00\x01 not a message at all",
    "malformed_mime (huge header block)": b"X-Filler: a\r\n" * 30_000 + b"\r\nbody",
    "too_many_attachments": _attached(*[(f"{n}.txt", b"x") for n in range(4)]),
    "attachment_too_large": _attached(("big.bin", b"x" * 1001)),
    "nested_archive": _attached(("a.zip", _zip(("inner.tar.gz", b"\x1f\x8b\x08\x00")))),
    "too_deep": _attached(depth=5),
    "too_many_parts": _attached(*[(f"{n}.txt", b"x") for n in range(3)]),
}  # fmt: skip


@pytest.mark.parametrize("reason", sorted(REFUSED))
def test_each_rule_refuses_with_its_reason(reason):
    limits = LIMITS if reason != "too_many_parts" else mail.Limits(max_parts=4)
    with pytest.raises(mail.Rejected) as refused:
        mail.inspect(REFUSED[reason], limits)
    assert refused.value.reason == reason.split()[0]


def _part_bomb(parts: int, *, boundary: bytes = b"boundary=b", newline: bytes = b"\r\n") -> bytes:
    head = b"From: a@example.org\r\nMIME-Version: 1.0\r\nContent-Type: multipart/mixed; "
    return (head + boundary + b"\r\n\r\n").replace(b"\r\n", newline) + (
        b"--b" + newline + newline + b"x" + newline
    ) * parts


PART_BOMBS = {
    "crlf": _part_bomb(20_000),
    "lf": _part_bomb(20_000, newline=b"\n"),
    "lone cr": _part_bomb(20_000, newline=b"\r"),
    # Boundaries a byte pattern cannot read: every line starting with "--" counts.
    "rfc 2231 encoding": _part_bomb(500, boundary=b"boundary*=utf-8''%62"),  # "b"
    "quoted pair": _part_bomb(20_000, boundary=b'boundary="\\b"'),
}


@pytest.mark.parametrize("spelling", sorted(PART_BOMBS))
def test_a_part_bomb_is_refused_on_its_bytes_before_it_is_parsed(spelling):
    with pytest.raises(mail.Rejected) as refused:
        mail.inspect(PART_BOMBS[spelling], mail.Limits())
    assert refused.value.reason == "too_many_parts"
    assert refused.value.detail.endswith("delimiter lines before parsing")


def test_lines_starting_with_dashes_in_a_body_are_not_parts():
    comments = b"-- a comment\r\nselect 1;\r\n" * 5000  # an SQL script, pasted
    plain = message(body=comments.decode())
    multipart = _attached(("a.txt", b"x"), ("b.txt", b"y"))
    boundary = mail.parse(multipart).get_boundary().encode()
    with_script = multipart.replace(b"see attached", b"see attached\n" + comments, 1)
    assert with_script.count(b"--" + boundary) == 4
    for raw in (plain, with_script):
        assert len(mail.inspect(raw, mail.Limits()).attachments) == (0 if raw is plain else 2)


def test_a_single_archive_and_ordinary_mail_pass():
    inspected = mail.inspect(_attached(("logs.zip", _zip(("a.log", b"ok")))), LIMITS)
    assert [(a.filename, a.size) for a in inspected.attachments] == [
        ("logs.zip", len(_zip(("a.log", b"ok"))))
    ]
    assert mail.inspect(message(), LIMITS).subject == "Printer on fire"


# --- Handlers ---------------------------------------------------------------------------


@pytest.fixture
def received():
    seen: list = []

    @handlers.handler("email", "Support@Example.com")
    def support(event):
        seen.append(event)

    yield seen
    handlers.REGISTRY[:] = [r for r in handlers.REGISTRY if r.func is not support]


@WITH_WORKERS
@pytest.mark.parametrize("provider", ["postmark"], indirect=True)
def test_an_email_handler_gets_a_typed_message_in_date_order_per_entity(provider, received):
    later = message(to="support+ticket-9@example.com", subject="second",
                    date="Tue, 01 Jul 2025 11:00:00 +0000")  # fmt: skip
    earlier = message(to="support+ticket-9@example.com", subject="first",
                      date="Tue, 01 Jul 2025 10:00:00 +0000")  # fmt: skip
    other = message(to="orders@inbound.example.com", subject="not for support")
    for raw, to in ((later, "support+ticket-9@example.com"),
                    (earlier, "support+ticket-9@example.com"),
                    (other, "orders@inbound.example.com")):  # fmt: skip
        assert post(provider, raw, recipients=[to]).status_code == 200
    settle()
    drain()
    assert [m.subject for m in received] == ["first", "second"]  # by Date, not arrival
    first = received[0]
    assert isinstance(first, handlers.InboundMessage)
    assert (first.entity_id, first.recipient, first.text.strip(), first.transport) == (
        "ticket-9",
        "support+ticket-9@example.com",
        "It is on fire.",
        "postmark",
    )
    assert first.message["Subject"] == "first" and first.payload is first.message
    states = InboundEvent.objects.values_list("event_type", "state")
    assert sorted(states) == [
        ("orders@inbound.example.com", "skipped"),  # no handler for it
        ("support@example.com", "processed"),
        ("support@example.com", "processed"),
    ]


@WITH_WORKERS
@pytest.mark.parametrize("batch", ["committed", "rolled back"])
def test_a_message_over_the_leases_inline_size_reaches_its_handler_whole(received, batch):
    """The lease leaves out bodies over LEASE_INLINE_BODY_BYTES; each is read when its
    event is applied, in a batch and one by one (after another event's handler failed)."""
    from email.message import EmailMessage

    from ingest.statements import LEASE_INLINE_BODY_BYTES

    source = source_create(slug="mx", scheme="smtp", secrets=[], options={"addresses": ADDRESSES})
    scan = bytes(range(256)) * (LEASE_INLINE_BODY_BYTES // 256 + 1)
    big = EmailMessage()
    big["From"], big["To"], big["Subject"] = "a@example.org", "support@example.com", "scan"
    big.set_content("attached")
    big.add_attachment(scan, maintype="application", subtype="pdf", filename="scan.pdf")
    subjects = ["scan", "note"] + (["boom"] if batch == "rolled back" else [])

    @handlers.handler("email", "support@example.com")
    def fails_on_boom(message):
        if message.subject == "boom":
            raise RuntimeError("boom")

    try:
        for subject in subjects:
            raw = big.as_bytes() if subject == "scan" else message(subject=subject)
            email_receive(
                source=source,
                post=schemes.MailPost(raw, ("support@example.com",), "a@example.org"),
                transport="smtp",
            )
        drain()
    finally:
        handlers.REGISTRY.remove(next(r for r in handlers.REGISTRY if r.func is fails_on_boom))
    runs = [m for m in received if m.subject == "scan"]  # twice if its batch rolled back
    assert runs and len(big.as_bytes()) > LEASE_INLINE_BODY_BYTES
    for scanned in runs:
        assert scanned.body == big.as_bytes()
        assert [(a.filename, a.payload) for a in scanned.attachments] == [("scan.pdf", scan)]
    states = dict(InboundEvent.objects.values_list("email__subject", "state"))
    assert states == {"scan": "processed", "note": "processed"} | (
        {"boom": "pending"} if batch == "rolled back" else {}
    )


@WITH_WORKERS
def test_an_older_email_arriving_later_still_runs(received):
    source = source_create(slug="pm", scheme="postmark", secrets=[CREDENTIAL])
    late = message(
        to="support+t@example.com", subject="newer", date="Wed, 02 Jul 2025 10:00:00 +0000"
    )
    post(source, late, recipients=["support+t@example.com"])
    settle()
    drain()
    old = message(
        to="support+t@example.com", subject="older", date="Tue, 01 Jul 2025 10:00:00 +0000"
    )
    post(source, old, recipients=["support+t@example.com"])  # after the window: too late
    settle()
    drain()
    # A webhook this old would be skipped as stale; an email is a message of its own.
    assert [m.subject for m in received] == ["newer", "older"]


def test_an_entity_can_come_from_a_header_pattern():
    source = source_create(
        slug="sg2",
        scheme="sendgrid",
        secrets=[CREDENTIAL],
        options={"entity_header": "Subject", "entity_pattern": r"\[#(\d+)\]"},
    )
    post(source, message(subject="Re: [#4711] still broken"))
    assert InboundEvent.objects.get().entity_id == "4711"


@pytest.mark.parametrize("provider", ["sendgrid"], indirect=True)
def test_the_raw_message_is_kept_under_the_inbound_retention(provider, settings):
    from deliveries.core.retention import prune

    settings.RETENTION_INBOUND_DAYS = 1
    settings.INBOUND_DEDUPE_WINDOW = 86400
    post(provider, message(), recipients=["support@example.com"])
    post(provider, message(subject="=?utf-8?q?a=0Ab?="))  # stored rejected
    old = timezone.now() - timedelta(days=2)
    InboundEvent.objects.update(received_at=old, state="processed")
    InboundEvent.objects.filter(last_error__startswith="rejected").update(state="rejected")
    assert prune(only=["inbound_events"])["inbound_events"] == 2
    assert not InboundEvent.objects.exists() and not InboundEmail.objects.exists()


# --- Admin and metrics ------------------------------------------------------------------


@WITH_WORKERS
@pytest.mark.parametrize("provider", ["mailgun"], indirect=True)
def test_the_admin_shows_an_email_and_reprocesses_it_with_its_own_permission(provider):
    # With LF line ends, as a provider may post it.
    post(provider, message(subject="Where is my order").replace(b"\r\n", b"\n"))
    drain()
    email = InboundEmail.objects.get()
    viewer = User.objects.create_user("viewer", is_staff=True)
    viewer.user_permissions.set(Permission.objects.filter(codename="view_inboundemail"))
    operator = User.objects.create_user("operator", is_staff=True)
    operator.user_permissions.set(
        Permission.objects.filter(codename__in=["view_inboundemail", "reprocess_inboundemail"])
    )
    url = f"/admin/ingest/inboundemail/{email.pk}/change/"
    changelist = "/admin/ingest/inboundemail/"
    as_viewer, as_operator = Client(), Client()
    as_viewer.force_login(viewer)
    as_operator.force_login(operator)
    page = as_viewer.get(url).content.decode()
    assert "Where is my order" in page and "It is on fire." in page and "ann@example.org" in page
    headers = page.split('class="form-row field-raw_headers', 1)[1].split("</pre>", 1)[0]
    assert "Subject: Where is my order" in headers and "It is on fire." not in headers
    listing = as_viewer.get(changelist).content.decode()
    assert "Where is my order" in listing and "reprocess" not in listing
    action = {"action": "reprocess", "_selected_action": [str(email.pk)]}
    as_viewer.post(changelist, action)
    assert InboundEvent.objects.get().state == "skipped"  # no handler for it
    assert as_operator.post(changelist, action).status_code == 302
    assert InboundEvent.objects.get().state == "pending"
    audit = AuditEntry.objects.get(action="inbound_email.reprocess")
    assert audit.actor == operator and audit.count == 1


@pytest.mark.parametrize("provider", ["mailgun"], indirect=True)
def test_metrics_count_received_duplicate_rejected_and_refused(provider):
    before = scrape()
    raw = message()
    post(provider, raw)
    post(provider, raw)
    post(provider, message(subject="=?utf-8?q?a=0Ab?="))
    post(provider, message(), secret="key-wrong")
    after = scrape()

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    name = "webhooks_inbound_emails_total"
    assert delta(name, source="mailgun", outcome="accepted") == 1
    assert delta(name, source="mailgun", outcome="duplicate") == 1
    assert delta(name, source="mailgun", outcome="rejected") == 1
    refused = "webhooks_inbound_refused_total"
    assert delta(refused, source="mailgun", reason="bad_signature") == 1
    assert delta(refused, source="mailgun", reason="header_injection") == 1
    assert json.loads(json.dumps(refusals(provider))) == {"bad_signature": 1, "header_injection": 1}


def test_create_source_makes_mail_sources():
    from io import StringIO

    from django.core.management import CommandError, call_command

    from ingest.models import Source

    out = StringIO()
    options = '{"addresses": ["support@example.com"]}'
    call_command("create_source", "mx", "--scheme", "smtp", "--options", options, stdout=out)
    assert "manage.py run_smtp --source mx" in out.getvalue()
    mx = Source.objects.get(slug="mx")
    assert (mx.scheme, mx.max_body_bytes, mx.secrets.count()) == ("smtp", 10 * 1024 * 1024, 0)
    with pytest.raises(CommandError, match="needs --secret"):
        call_command("create_source", "pm", "--scheme", "postmark")
    call_command("create_source", "pm", "--scheme", "postmark", "--secret", CREDENTIAL, stdout=out)
    assert Source.objects.get(slug="pm").max_body_bytes == 25 * 1024 * 1024
    call_command("create_source", "mg", "--scheme", "mailgun", "--secret", "key-1", stdout=out)
    assert out.getvalue().endswith("POST /ingest/mg/mime\n")  # where its raw post goes
