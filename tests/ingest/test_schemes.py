"""Inbound signature schemes: the published vectors, rotation, the replay window, missing
and malformed headers, interop with the standardwebhooks package, event metadata, and
properties over random input. Pure: no database."""

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from standardwebhooks.webhooks import Webhook

from ingest.schemes import (
    SCHEMES,
    EventMeta,
    GenericHmac,
    Request,
    Scheme,
    UnparseableBody,
    VerificationFailed,
    get_scheme,
)

NOW = 1_700_000_000

# The autouse settings fixture in tests/conftest.py is function-scoped but harmless here.
PROPERTY = settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

SCHEMES_UNDER_TEST: dict[str, Scheme] = {
    "standard": get_scheme("standard"),
    "stripe": get_scheme("stripe"),
    "github": get_scheme("github"),
    "shopify": get_scheme("shopify"),
    "slack": get_scheme("slack"),
    "hmac": get_scheme("hmac"),
    "hmac-sha1-base64": get_scheme(
        "hmac", {"header": "X-Sig", "algorithm": "sha1", "encoding": "base64", "prefix": "sha1="}
    ),
    "hmac-sha512-timestamped": get_scheme(
        "hmac",
        {
            "algorithm": "sha512",
            "timestamp_header": "X-Timestamp",
            "signed_template": "{timestamp}:{body}",
            "id_header": "X-Event-Id",
        },
    ),
}
TIMESTAMP_HEADER = {
    "standard": "webhook-timestamp",
    "slack": "x-slack-request-timestamp",
    "hmac-sha512-timestamped": "x-timestamp",
}
TIMESTAMPED = [*TIMESTAMP_HEADER, "stripe"]
SIGNATURE_HEADER = {
    "standard": "webhook-signature",
    "stripe": "stripe-signature",
    "github": "x-hub-signature-256",
    "shopify": "x-shopify-hmac-sha256",
    "slack": "x-slack-signature",
    "hmac": "x-signature",
    "hmac-sha1-base64": "x-sig",
    "hmac-sha512-timestamped": "x-signature",
}


def fixed_secret(scheme_id: str) -> str:
    if scheme_id == "standard":
        return "whsec_" + base64.b64encode(b"k" * 32).decode()
    return "fixed-secret"


def new_secret(scheme_id: str) -> str:
    if scheme_id == "standard":
        return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    return secrets.token_hex(16)


def reason(scheme: Scheme, headers: dict[str, str], body: bytes, **kw) -> str | None:
    """The verification failure reason, or None when the request verifies."""
    kw.setdefault("now", NOW)
    try:
        scheme.verify(Request(headers, body), **kw)
    except VerificationFailed as exc:
        return exc.reason
    return None


def meta(scheme: Scheme, headers: dict[str, str], body: bytes) -> EventMeta:
    request = Request(headers, body)
    return scheme.extract(request, scheme.parse(request))


def flip_char(value: str, index: int) -> str:
    """``value`` with one character changed to another hex and base64 alphabet character."""
    return value[:index] + ("1" if value[index] == "0" else "0") + value[index + 1 :]


def flip_byte(body: bytes, index: int, mask: int = 1) -> bytes:
    return body[:index] + bytes([body[index] ^ mask]) + body[index + 1 :]


# --- the published vectors (reference.md §1), verbatim ----------------------------------


@dataclass(frozen=True)
class Vector:
    scheme: str
    secret: str
    body: bytes
    headers: dict[str, str]
    timestamp: int | None  # the vector's own; verified with `now` a few seconds away

    @property
    def now(self) -> float:
        return NOW if self.timestamp is None else self.timestamp + 7

    @property
    def signature_header(self) -> str:
        return SIGNATURE_HEADER[self.scheme]


SW_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SW_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
SLACK_BODY = (
    b"token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow"
    b"&channel_id=G8PSS9T3V&channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner"
    b"&command=%2Fwebhook-collect&text=&response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands"
    b"%2FT1DC2JH3J%2F397700885554%2F96rGlfmibIGlgcZRskXaIFfN"
    b"&trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c"
)
VECTORS = {
    "standard": Vector(
        "standard",
        SW_SECRET,
        b'{"test": 2432232314}',
        {
            "webhook-id": "msg_p5jXN8AQM9LWM0D4loKWxJek",
            "webhook-timestamp": "1614265330",
            "webhook-signature": SW_SIGNATURE,
        },
        timestamp=1614265330,
    ),
    "stripe": Vector(
        "stripe",
        "whsec_test_secret",
        b'{"id":"evt_test_webhook","object":"event"}',
        {
            "stripe-signature": "t=1700000000,"
            "v1=d95c6b7477fbd7e9f90b1b0ef5f9c7ac25abca5382460e0d988c2b2a5b71b990"
        },
        timestamp=1700000000,
    ),
    "github": Vector(
        "github",
        "It's a Secret to Everybody",
        b"Hello, World!",
        {
            "x-hub-signature-256": "sha256="
            "757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
        },
        timestamp=None,
    ),
    "shopify": Vector(
        "shopify",
        "test-webhook-secret",
        b'{"id":1234567890,"email":"customer@example.com","total_price":"123.45"}',
        {"x-shopify-hmac-sha256": "QNyObTlKbMx2qDlPF/ZOZcBqg5OgPg+2oky3zldc0Gw="},
        timestamp=None,
    ),
    "slack": Vector(
        "slack",
        "8f742231b10e8888abcd99yyyzzz85a5",
        SLACK_BODY,
        {
            "content-type": "application/x-www-form-urlencoded",
            "x-slack-request-timestamp": "1531420618",
            "x-slack-signature": "v0="
            "a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503",
        },
        timestamp=1531420618,
    ),
}


@pytest.mark.parametrize("v", VECTORS.values(), ids=VECTORS)
def test_the_published_vector_verifies(v):
    assert reason(get_scheme(v.scheme), v.headers, v.body, secrets=[v.secret], now=v.now) is None


@pytest.mark.parametrize("v", VECTORS.values(), ids=VECTORS)
@pytest.mark.parametrize("index", [0, -1])
def test_the_published_vector_fails_when_one_body_byte_changes(v, index):
    body = flip_byte(v.body, index % len(v.body))
    got = reason(get_scheme(v.scheme), v.headers, body, secrets=[v.secret], now=v.now)
    assert got == "bad_signature"


@pytest.mark.parametrize("v", VECTORS.values(), ids=VECTORS)
@pytest.mark.parametrize("index", [-10, -20])
def test_the_published_vector_fails_when_one_signature_byte_changes(v, index):
    headers = {**v.headers, v.signature_header: flip_char(v.headers[v.signature_header], index)}
    got = reason(get_scheme(v.scheme), headers, v.body, secrets=[v.secret], now=v.now)
    assert got == "bad_signature"


@pytest.mark.parametrize("v", VECTORS.values(), ids=VECTORS)
def test_the_published_vector_fails_with_another_secret(v):
    other = new_secret(v.scheme)
    got = reason(get_scheme(v.scheme), v.headers, v.body, secrets=[other], now=v.now)
    assert got == "bad_signature"


def test_the_standard_webhooks_vector_with_oa_instead_of_oe_fails():
    v = VECTORS["standard"]
    headers = {**v.headers, "webhook-signature": SW_SIGNATURE[:-3] + "OA="}
    assert reason(get_scheme("standard"), headers, v.body, secrets=[SW_SECRET], now=v.now) == (
        "bad_signature"
    )


def test_a_non_canonical_base64_spelling_of_a_valid_signature_is_refused():
    # "…OF=" decodes to the same 32 bytes as "…OE=" (the last character's two low bits are
    # padding); b64decode would accept it, the scheme refuses it as malformed.
    v = VECTORS["standard"]
    respelled = SW_SIGNATURE[:-2] + "F="
    assert base64.b64decode(respelled[3:]) == base64.b64decode(SW_SIGNATURE[3:])
    headers = {**v.headers, "webhook-signature": respelled}
    got = reason(get_scheme("standard"), headers, v.body, secrets=[SW_SECRET], now=v.now)
    assert got == "malformed_signature"


@pytest.mark.parametrize("v", VECTORS.values(), ids=VECTORS)
def test_sign_reproduces_the_published_vector(v):
    event_id = v.headers.get("webhook-id", "")
    signed = get_scheme(v.scheme).sign(
        body=v.body, secret=v.secret, timestamp=v.timestamp, event_id=event_id
    )
    assert signed[v.signature_header] == v.headers[v.signature_header]


# --- rotation -----------------------------------------------------------------------------


def test_stripe_accepts_when_any_of_several_v1_signatures_matches():
    v = VECTORS["stripe"]
    good = v.headers["stripe-signature"].split(",")[1]
    header = f"t=1700000000,v1={'ab' * 32},v0={'cd' * 32},{good},v1={'ef' * 32}"
    stripe = get_scheme("stripe")
    headers = {"stripe-signature": header}
    assert reason(stripe, headers, v.body, secrets=[v.secret], now=v.now) is None
    without_good = {"stripe-signature": header.replace(good + ",", "")}
    assert reason(stripe, without_good, v.body, secrets=[v.secret], now=v.now) == "bad_signature"


def test_standard_webhooks_accepts_any_of_space_separated_signatures_and_ignores_versions():
    v = VECTORS["standard"]
    wrong = "v1," + base64.b64encode(b"\x00" * 32).decode()
    header = f"{wrong} v2,abc {SW_SIGNATURE} v1a,xyz"
    headers = {**v.headers, "webhook-signature": header}
    scheme = get_scheme("standard")
    assert reason(scheme, headers, v.body, secrets=[SW_SECRET], now=v.now) is None
    headers["webhook-signature"] = f"{wrong} v2,{SW_SIGNATURE[3:]}"
    assert reason(scheme, headers, v.body, secrets=[SW_SECRET], now=v.now) == "bad_signature"


@pytest.mark.parametrize("scheme_id", SCHEMES_UNDER_TEST)
def test_any_configured_secret_may_match_and_none_matching_is_a_bad_signature(scheme_id):
    scheme = SCHEMES_UNDER_TEST[scheme_id]
    old, new, other = (new_secret(scheme_id) for _ in range(3))
    body = b'{"id": "evt_1", "type": "thing.happened"}'
    headers = scheme.sign(body=body, secret=new, timestamp=NOW)
    assert reason(scheme, headers, body, secrets=[old, new]) is None
    assert reason(scheme, headers, body, secrets=[new, old]) is None
    assert reason(scheme, headers, body, secrets=[old, other]) == "bad_signature"


def test_a_request_signed_with_two_secrets_verifies_with_either():
    scheme, body = get_scheme("standard"), b"{}"
    old, new = new_secret("standard"), new_secret("standard")
    a = scheme.sign(body=body, secret=old, timestamp=NOW, event_id="msg_1")
    b = scheme.sign(body=body, secret=new, timestamp=NOW, event_id="msg_1")
    headers = {**a, "webhook-signature": f"{a['webhook-signature']} {b['webhook-signature']}"}
    for secret in (old, new):
        assert reason(scheme, headers, body, secrets=[secret]) is None


# --- the replay window, both directions ---------------------------------------------------


@pytest.mark.parametrize("scheme_id", TIMESTAMPED)
@pytest.mark.parametrize(
    ("offset", "expected"),
    [
        (-299, None),
        (-300, None),
        (-301, "stale_timestamp"),
        (299, None),
        (300, None),
        (301, "future_timestamp"),
        (-86_400 * 365, "stale_timestamp"),
    ],
)
def test_the_replay_window_holds_in_both_directions(scheme_id, offset, expected):
    scheme, secret, body = SCHEMES_UNDER_TEST[scheme_id], new_secret(scheme_id), b"{}"
    headers = scheme.sign(body=body, secret=secret, timestamp=NOW + offset)
    assert reason(scheme, headers, body, secrets=[secret], now=NOW) == expected


def test_the_tolerance_is_configurable():
    scheme, secret, body = get_scheme("slack"), new_secret("slack"), b"{}"
    headers = scheme.sign(body=body, secret=secret, timestamp=NOW - 61)
    assert reason(scheme, headers, body, secrets=[secret], tolerance=60) == "stale_timestamp"
    assert reason(scheme, headers, body, secrets=[secret], tolerance=61) is None


def test_a_replayed_request_with_a_fresh_timestamp_but_the_old_signature_fails():
    scheme, secret, body = get_scheme("stripe"), new_secret("stripe"), b"{}"
    old = scheme.sign(body=body, secret=secret, timestamp=NOW - 3600)["stripe-signature"]
    replay = {"stripe-signature": old.replace(f"t={NOW - 3600}", f"t={NOW}")}
    assert reason(scheme, replay, body, secrets=[secret]) == "bad_signature"


# --- missing and malformed headers --------------------------------------------------------


def _signed(scheme_id: str, secret: str | None = None) -> dict[str, str]:
    secret = secret or fixed_secret(scheme_id)
    return SCHEMES_UNDER_TEST[scheme_id].sign(body=b"{}", secret=secret, timestamp=NOW)


def _b64(n: int) -> str:
    return base64.b64encode(b"\x01" * n).decode()


MALFORMED = [
    ("standard", {"webhook-signature": None}, "missing_signature"),
    ("standard", {"webhook-signature": "  "}, "missing_signature"),
    ("standard", {"webhook-timestamp": None}, "missing_timestamp"),
    ("standard", {"webhook-id": None}, "malformed_signature"),
    ("standard", {"webhook-signature": "v2," + _b64(32)}, "malformed_signature"),
    ("standard", {"webhook-signature": "v1,not base64!"}, "malformed_signature"),
    ("standard", {"webhook-signature": "v1," + _b64(16)}, "malformed_signature"),
    ("standard", {"webhook-signature": "garbage"}, "malformed_signature"),
    ("stripe", {"stripe-signature": None}, "missing_signature"),
    ("stripe", {"stripe-signature": "v1=" + "ab" * 32}, "missing_timestamp"),
    ("stripe", {"stripe-signature": f"t={NOW}"}, "malformed_signature"),
    ("stripe", {"stripe-signature": f"t={NOW},v0={'ab' * 32}"}, "malformed_signature"),
    ("stripe", {"stripe-signature": f"t={NOW},v1=zz"}, "malformed_signature"),
    ("stripe", {"stripe-signature": f"t={NOW},v1={'ab' * 31}"}, "malformed_signature"),
    ("stripe", {"stripe-signature": f"t={NOW},t={NOW},v1={'ab' * 32}"}, "malformed_signature"),
    ("stripe", {"stripe-signature": "nonsense"}, "missing_timestamp"),
    ("github", {"x-hub-signature-256": None}, "missing_signature"),
    ("github", {"x-hub-signature-256": "sha1=" + "ab" * 20}, "malformed_signature"),
    ("github", {"x-hub-signature-256": "sha256=xyz"}, "malformed_signature"),
    ("github", {"x-hub-signature-256": "ab" * 32}, "malformed_signature"),
    ("shopify", {"x-shopify-hmac-sha256": None}, "missing_signature"),
    ("shopify", {"x-shopify-hmac-sha256": "***"}, "malformed_signature"),
    ("shopify", {"x-shopify-hmac-sha256": "ab" * 32}, "malformed_signature"),  # hex, not b64
    ("slack", {"x-slack-signature": None}, "missing_signature"),
    ("slack", {"x-slack-request-timestamp": None}, "missing_timestamp"),
    ("slack", {"x-slack-signature": "v1=" + "ab" * 32}, "malformed_signature"),
    ("slack", {"x-slack-signature": "v0=xyz"}, "malformed_signature"),
    ("hmac", {"x-signature": None}, "missing_signature"),
    ("hmac", {"x-signature": "ab" * 20}, "malformed_signature"),  # a sha1 length
    ("hmac-sha1-base64", {"x-sig": _b64(20)}, "malformed_signature"),  # no "sha1=" prefix
    ("hmac-sha1-base64", {"x-sig": "sha1=" + "ab" * 20}, "malformed_signature"),  # hex
    ("hmac-sha512-timestamped", {"x-timestamp": None}, "missing_timestamp"),
]


@pytest.mark.parametrize(("scheme_id", "changes", "expected"), MALFORMED)
def test_missing_and_malformed_headers_give_their_reason(scheme_id, changes, expected):
    headers = _signed(scheme_id)
    for name, value in changes.items():
        if value is None:
            headers.pop(name)
        else:
            headers[name] = value
    secrets = [fixed_secret(scheme_id)]
    assert reason(SCHEMES_UNDER_TEST[scheme_id], headers, b"{}", secrets=secrets) == expected


@pytest.mark.parametrize("scheme_id", TIMESTAMPED)
@pytest.mark.parametrize(
    "value",
    [
        "",
        " ",
        "abc",
        "1.5",
        "-1",
        "+1700000000",
        "1e9",
        "0x10",
        "\u0661\u0667" + "\u0660" * 8,
        "²",
        "9" * 13,
    ],
)
def test_a_timestamp_that_is_not_plain_digits_is_missing_or_malformed(scheme_id, value):
    headers = _signed(scheme_id)
    if scheme_id == "stripe":
        headers["stripe-signature"] = headers["stripe-signature"].replace(f"t={NOW}", f"t={value}")
    else:
        headers[TIMESTAMP_HEADER[scheme_id]] = value
    expected = "missing_timestamp" if not value.strip() else "malformed_signature"
    secrets = [fixed_secret(scheme_id)]
    assert reason(SCHEMES_UNDER_TEST[scheme_id], headers, b"{}", secrets=secrets) == expected


@pytest.mark.parametrize("scheme_id", SCHEMES_UNDER_TEST)
@pytest.mark.parametrize("configured", [[], [""]])
def test_no_usable_secret_is_its_own_reason(scheme_id, configured):
    headers = _signed(scheme_id, secret=new_secret(scheme_id))
    assert reason(SCHEMES_UNDER_TEST[scheme_id], headers, b"{}", secrets=configured) == "no_secret"


def test_a_standard_webhooks_secret_that_is_not_base64_is_skipped():
    scheme, secret = get_scheme("standard"), new_secret("standard")
    headers = scheme.sign(body=b"{}", secret=secret, timestamp=NOW)
    assert reason(scheme, headers, b"{}", secrets=["whsec_!!not base64!!"]) == "no_secret"
    assert reason(scheme, headers, b"{}", secrets=["whsec_!!not base64!!", secret]) is None
    with pytest.raises(ValueError):
        scheme.signing_key("whsec_!!not base64!!")


def test_one_string_in_place_of_a_list_of_secrets_is_a_programming_error():
    # A str is a Sequence of one-character secrets, each trivially guessable.
    scheme = get_scheme("github")
    headers = scheme.sign(body=b"{}", secret="s")
    with pytest.raises(TypeError):
        scheme.verify(Request(headers, b"{}"), secrets="s", now=NOW)


# --- Standard Webhooks: svix-* headers and the third-party package ------------------------


def _as_svix(headers: dict[str, str]) -> dict[str, str]:
    return {k.replace("webhook-", "svix-"): v for k, v in headers.items()}


def test_the_standard_webhooks_vector_verifies_under_svix_headers():
    v = VECTORS["standard"]
    scheme = get_scheme("standard")
    assert reason(scheme, _as_svix(v.headers), v.body, secrets=[SW_SECRET], now=v.now) is None
    extracted = meta(scheme, _as_svix(v.headers), v.body)
    assert extracted.event_id == "msg_p5jXN8AQM9LWM0D4loKWxJek"
    assert extracted.occurred_at == datetime.fromtimestamp(1614265330, UTC)


@pytest.mark.parametrize("offset", [-301, 301])
def test_svix_headers_get_the_same_replay_window(offset):
    scheme, secret = get_scheme("standard"), new_secret("standard")
    headers = _as_svix(scheme.sign(body=b"{}", secret=secret, timestamp=NOW + offset))
    expected = "stale_timestamp" if offset < 0 else "future_timestamp"
    assert reason(scheme, headers, b"{}", secrets=[secret]) == expected


@pytest.mark.parametrize("as_svix", [False, True])
@pytest.mark.parametrize("padded", [True, False])
def test_a_signature_from_the_standardwebhooks_package_verifies(as_svix, padded):
    secret = new_secret("standard")
    if not padded:
        secret = secret.rstrip("=")
    payload = '{"type": "invoice.paid", "data": {"id": "inv_1"}}'
    signature = Webhook(secret).sign("msg_abc", datetime.fromtimestamp(NOW, UTC), payload)
    headers = {
        "webhook-id": "msg_abc",
        "webhook-timestamp": str(NOW),
        "webhook-signature": signature,
    }
    if as_svix:
        headers = _as_svix(headers)
    scheme = get_scheme("standard")
    assert reason(scheme, headers, payload.encode(), secrets=[secret]) is None
    assert reason(scheme, headers, payload.encode() + b" ", secrets=[secret]) == "bad_signature"


def test_the_standardwebhooks_package_verifies_what_sign_produces():
    secret, body = new_secret("standard"), b'{"type": "x"}'
    # The package checks the timestamp against the real clock, so sign "now".
    headers = get_scheme("standard").sign(body=body, secret=secret, timestamp=int(time.time()))
    assert Webhook(secret).verify(body, headers) == {"type": "x"}


# --- extract() ----------------------------------------------------------------------------


def test_standard_webhooks_metadata():
    body = json.dumps(
        {"type": "invoice.paid", "timestamp": "2024-01-02T03:04:05.123Z", "data": {"id": "inv_1"}}
    ).encode()
    headers = {"webhook-id": "msg_1", "webhook-timestamp": str(NOW)}
    assert meta(get_scheme("standard"), headers, body) == EventMeta(
        event_id="msg_1",
        event_type="invoice.paid",
        occurred_at=datetime(2024, 1, 2, 3, 4, 5, 123000, tzinfo=UTC),
        entity_id="inv_1",
    )


def test_standard_webhooks_metadata_falls_back_to_the_timestamp_header():
    v = VECTORS["standard"]
    assert meta(get_scheme("standard"), v.headers, v.body) == EventMeta(
        "msg_p5jXN8AQM9LWM0D4loKWxJek", "", datetime(2021, 2, 25, 15, 2, 10, tzinfo=UTC), ""
    )


def test_a_body_time_with_an_offset_is_converted_to_utc():
    body = b'{"timestamp": "2024-01-02T05:04:05+02:00"}'
    extracted = meta(get_scheme("standard"), {"webhook-id": "m"}, body)
    assert extracted.occurred_at == datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)


def test_stripe_metadata():
    body = json.dumps(
        {
            "id": "evt_1",
            "type": "customer.updated",
            "created": 1700000000,
            "data": {"object": {"id": "cus_1", "object": "customer"}},
        }
    ).encode()
    assert meta(get_scheme("stripe"), {}, body) == EventMeta(
        "evt_1", "customer.updated", datetime(2023, 11, 14, 22, 13, 20, tzinfo=UTC), "cus_1"
    )


def test_stripe_metadata_of_the_vector_has_no_type_time_or_entity():
    v = VECTORS["stripe"]
    assert meta(get_scheme("stripe"), v.headers, v.body) == EventMeta(
        "evt_test_webhook", "", None, ""
    )


def test_github_metadata_joins_the_event_and_the_action():
    headers = {
        "x-github-delivery": "72d3162e-cc78-11e3-81ab-4c9367dc0958",
        "x-github-event": "issues",
    }
    body = b'{"action": "opened", "repository": {"full_name": "octo/hello"}}'
    assert meta(get_scheme("github"), headers, body) == EventMeta(
        "72d3162e-cc78-11e3-81ab-4c9367dc0958", "issues.opened", None, "octo/hello"
    )


def test_github_metadata_without_an_action_is_the_event_alone():
    headers = {"x-github-delivery": "d-1", "x-github-event": "ping"}
    assert meta(get_scheme("github"), headers, b'{"zen": "Keep it logically awesome."}') == (
        EventMeta("d-1", "ping", None, "")
    )


def test_shopify_metadata():
    v = VECTORS["shopify"]
    headers = {
        **v.headers,
        "x-shopify-webhook-id": "b54557e4-bdd9-4b37-8a5f-bf7d70bcd043",
        "x-shopify-topic": "orders/create",
        "x-shopify-triggered-at": "2023-03-29T18:00:27.877041743Z",
    }
    assert meta(get_scheme("shopify"), headers, v.body) == EventMeta(
        "b54557e4-bdd9-4b37-8a5f-bf7d70bcd043",
        "orders/create",
        datetime(2023, 3, 29, 18, 0, 27, 877041, tzinfo=UTC),
        "1234567890",
    )


def test_shopify_metadata_with_an_unparseable_trigger_time_has_no_time():
    headers = {"x-shopify-webhook-id": "w-1", "x-shopify-triggered-at": "yesterday"}
    assert meta(get_scheme("shopify"), headers, b"{}") == EventMeta("w-1", "", None, "")


def test_slack_slash_command_metadata_uses_the_trigger_id_and_the_command():
    v = VECTORS["slack"]
    assert meta(get_scheme("slack"), v.headers, v.body) == EventMeta(
        "398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c", "/webhook-collect", None, ""
    )


def test_slack_events_api_metadata():
    body = json.dumps(
        {
            "type": "event_callback",
            "event_id": "Ev08MFMKH6",
            "event_time": 1531420618,
            "event": {"type": "app_mention", "channel": "C1"},
        }
    ).encode()
    headers = {"content-type": "application/json"}
    assert meta(get_scheme("slack"), headers, body) == EventMeta(
        "Ev08MFMKH6", "app_mention", datetime.fromtimestamp(1531420618, UTC), ""
    )


def test_slack_interactivity_metadata_reads_the_payload_field():
    payload = json.dumps({"type": "block_actions", "trigger_id": "13345224609.738474920.8088"})
    body = f"payload={payload}".encode()
    headers = {"content-type": "application/x-www-form-urlencoded"}
    assert meta(get_scheme("slack"), headers, body) == EventMeta(
        "13345224609.738474920.8088", "block_actions", None, ""
    )


def test_slack_body_kind_is_sniffed_when_there_is_no_content_type():
    assert meta(get_scheme("slack"), {}, b'{"event_id": "Ev1"}').event_id == "Ev1"
    assert meta(get_scheme("slack"), {}, b"trigger_id=t1&command=%2Fgo").event_type == "/go"


@pytest.mark.parametrize(
    ("options", "headers", "body", "expected"),
    [
        ({}, {}, b'{"id": 42, "type": "a.b"}', EventMeta("42", "a.b", None, "")),
        (
            {"id_header": "X-Id", "type_header": "X-Type"},
            {"x-id": "h-1", "x-type": "t"},
            b'{"id": "ignored", "type": "ignored"}',
            EventMeta("h-1", "t", None, ""),
        ),
        (
            {"id_field": "event.uid", "type_field": "event.kind", "entity_field": "event.obj.id"},
            {},
            b'{"event": {"uid": "u-1", "kind": "k", "obj": {"id": 7}}}',
            EventMeta("u-1", "k", None, "7"),
        ),
    ],
)
def test_generic_hmac_metadata(options, headers, body, expected):
    assert meta(get_scheme("hmac", options), headers, body) == expected


MISSING_ID = [
    ("standard", {}, b'{"type": "x"}'),
    ("stripe", {}, b'{"type": "x"}'),
    ("stripe", {}, b'{"id": ""}'),
    ("stripe", {}, b'{"id": true}'),
    ("stripe", {}, b'["not an object"]'),
    ("github", {"x-github-event": "push"}, b"{}"),
    ("shopify", {"x-shopify-topic": "orders/create"}, b'{"id": 1}'),
    ("slack", {"content-type": "application/json"}, b'{"type": "url_verification"}'),
    ("slack", {"content-type": "application/x-www-form-urlencoded"}, b"command=%2Fgo"),
    ("hmac", {}, b'{"type": "x"}'),
    ("hmac-sha512-timestamped", {}, b'{"id": "in the body, but the id is a header"}'),
]


@pytest.mark.parametrize(("scheme_id", "headers", "body"), MISSING_ID)
def test_a_missing_event_id_is_unparseable(scheme_id, headers, body):
    with pytest.raises(UnparseableBody) as exc:
        meta(SCHEMES_UNDER_TEST[scheme_id], headers, body)
    assert exc.value.reason == "missing_event_id"


def test_an_over_long_event_id_is_unparseable_not_truncated():
    with pytest.raises(UnparseableBody) as exc:
        meta(get_scheme("stripe"), {}, json.dumps({"id": "e" * 256}).encode())
    assert exc.value.reason == "event_id_too_long"


# Where each scheme reads the event id, type and entity, holding text a text column
# cannot take: every scheme refuses it as unparseable, with the field in the reason.
UNSTORABLE_META = [
    ("stripe", {}, b'{"id": "e\\u0000"}', "nul_in_event_id"),
    ("stripe", {}, b'{"id": "e", "type": "\\ud800"}', "surrogate_in_event_type"),
    ("stripe", {}, b'{"id": "e", "data": {"object": {"id": "\\u0000"}}}', "nul_in_entity_id"),
    ("standard", {"webhook-id": "m\x00"}, b"{}", "nul_in_event_id"),
    ("standard", {"webhook-id": "m"}, b'{"data": {"id": "\\udfff"}}', "surrogate_in_entity_id"),
    ("github", {"x-github-delivery": "d", "x-github-event": "p\x00"}, b"{}", "nul_in_event_type"),
    ("shopify", {"x-shopify-webhook-id": "w\x00"}, b"{}", "nul_in_event_id"),
    (
        "slack",
        {"content-type": "application/json"},
        b'{"event_id": "\\ud800"}',
        "surrogate_in_event_id",
    ),
    ("hmac", {}, b'{"id": "a", "type": "t\\u0000"}', "nul_in_event_type"),
]


@pytest.mark.parametrize(("scheme_id", "headers", "body", "reason"), UNSTORABLE_META)
def test_an_id_type_or_entity_a_text_column_cannot_take_is_unparseable(
    scheme_id, headers, body, reason
):
    with pytest.raises(UnparseableBody) as exc:
        meta(SCHEMES_UNDER_TEST[scheme_id], headers, body)
    assert exc.value.reason == reason


@pytest.mark.parametrize(
    "body", [b"", b"{", b"\xff\xfe\x00", b"[" * 100_000, b'{"id": 1' + b"0" * 5000 + b"}"]
)
def test_a_body_that_is_not_json_is_unparseable(body):
    with pytest.raises(UnparseableBody) as exc:
        get_scheme("stripe").parse(Request({}, body))
    assert isinstance(exc.value, ValueError)
    assert exc.value.reason == "invalid_json"


# --- the generic hmac scheme's options ----------------------------------------------------


def test_generic_hmac_known_answers():
    body, key = b'{"id": "1"}', b"k3y"
    sha1 = get_scheme("hmac", {"algorithm": "sha1", "prefix": "sha1=", "header": "X-Hub"})
    expected = "sha1=" + hmac.new(key, body, hashlib.sha1).hexdigest()
    assert sha1.sign(body=body, secret="k3y")["x-hub"] == expected
    assert reason(sha1, {"x-hub": expected}, body, secrets=["k3y"]) is None

    colon = get_scheme(
        "hmac",
        {
            "timestamp_header": "x-ts",
            "signed_template": "{timestamp}:{body}",
            "encoding": "base64",
            "algorithm": "sha512",
        },
    )
    mac = hmac.new(key, f"{NOW}:".encode() + body, hashlib.sha512).digest()
    headers = {"x-ts": str(NOW), "x-signature": base64.b64encode(mac).decode()}
    assert reason(colon, headers, body, secrets=["k3y"]) is None
    dotted = get_scheme("hmac", {"timestamp_header": "x-ts"})  # "{timestamp}.{body}"
    mac = hmac.new(key, f"{NOW}.".encode() + body, hashlib.sha256).hexdigest()
    assert reason(dotted, {"x-ts": str(NOW), "x-signature": mac}, body, secrets=["k3y"]) is None


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"algorithm": "sha1"},
        {"algorithm": "SHA512", "encoding": "base64"},
        {"prefix": "sha256=", "header": "X-Webhook-Signature"},
        {"timestamp_header": "x-ts"},
        {"timestamp_header": "x-ts", "signed_template": "v1:{timestamp}:{body}"},
        {"id_header": "x-id", "signed_template": "{id}.{body}"},
        {
            "timestamp_header": "x-ts",
            "id_header": "x-id",
            "signed_template": "{id}.{timestamp}.{body}",
        },
        {"signed_template": "{{literal}}{body}"},
    ],
)
def test_generic_hmac_option_combinations_round_trip(options):
    scheme, body = get_scheme("hmac", options), b'{"id": "e1"}'
    headers = scheme.sign(body=body, secret="k", timestamp=NOW, event_id="e1")
    assert reason(scheme, headers, body, secrets=["k"]) is None
    assert reason(scheme, headers, flip_byte(body, 3), secrets=["k"]) == "bad_signature"
    if "id_header" in options:
        tampered = {**headers, "x-id": "e2"}
        assert reason(scheme, tampered, body, secrets=["k"]) == "bad_signature"


@pytest.mark.parametrize(
    "options",
    [
        {"algorithm": "md5"},
        {"algorithm": "sha3_256"},
        {"encoding": "base32"},
        {"header": ""},
        {"header": 5},
        {"unknown": "x"},
        {"signed_template": "{timestamp}.{body}"},  # no timestamp_header
        {"signed_template": "{id}.{body}"},  # no id_header
        {"timestamp_header": "x-ts", "signed_template": "{timestamp}"},
        {"timestamp_header": "x-ts", "signed_template": "{body}.{body}"},
        {"signed_template": "{body:>10}"},
        {"signed_template": "{body!r}"},
        {"signed_template": "{0}{body}"},
        {"signed_template": "{body"},
    ],
)
def test_invalid_generic_hmac_options_are_refused(options):
    with pytest.raises(ValueError):
        get_scheme("hmac", options)


def test_the_registry_names_every_scheme_and_refuses_unknown_names_and_options():
    assert set(SCHEMES) == {
        *("standard", "stripe", "github", "shopify", "slack", "hmac", "poll"),
        *("smtp", "mailgun", "postmark", "sendgrid"),  # the mail sources
    }
    assert all(get_scheme(name).name == name for name in SCHEMES)
    assert isinstance(get_scheme("hmac"), GenericHmac)
    assert get_scheme("slack").content_types == (
        "application/x-www-form-urlencoded",
        "application/json",
    )
    assert get_scheme("stripe").content_types == ("application/json",)
    with pytest.raises(ValueError):
        get_scheme("paypal")
    with pytest.raises(ValueError):
        get_scheme("stripe", {"header": "x"})


def test_an_unknown_failure_reason_is_a_programming_error():
    with pytest.raises(ValueError):
        VerificationFailed("nope")


# --- properties ---------------------------------------------------------------------------

HEADER_NAMES = sorted(
    {
        *SIGNATURE_HEADER.values(),
        *TIMESTAMP_HEADER.values(),
        "svix-signature",
        "svix-timestamp",
        "svix-id",
        "webhook-id",
        "x-event-id",
        "content-type",
    }
)


@st.composite
def signature_like(draw) -> str:
    """Values shaped like real signatures (right alphabet and often the right length), so
    that the forgeries get past parsing to the comparison itself."""
    mac = draw(st.sampled_from([20, 32, 64]).flatmap(lambda n: st.binary(min_size=n, max_size=n)))
    ts = draw(st.integers(NOW - 400, NOW + 400))
    form = draw(
        st.sampled_from(
            [
                *("{hex}", "{b64}", "v1,{b64}", "v1,{b64} v1,{b64}", "sha256={hex}", "sha1={b64}"),
                *("v0={hex}", "t={ts},v1={hex}", "t={ts},v0={hex},v1={hex}", "{ts}"),
            ]
        )
    )
    return form.format(hex=mac.hex(), b64=base64.b64encode(mac).decode(), ts=ts)


random_headers = st.dictionaries(
    keys=st.one_of(st.sampled_from(HEADER_NAMES), st.text(max_size=20)),
    values=st.one_of(st.text(max_size=60), signature_like()),
    max_size=8,
)


forging_secrets = st.binary(min_size=1, max_size=40)


def forged_headers(scheme_id: str, body: bytes, key: bytes, timestamp: int) -> dict[str, str]:
    """Well-formed headers for ``body``, signed with a key other than the fixed secret."""
    standard = scheme_id == "standard"
    secret = "whsec_" + base64.b64encode(key).decode() if standard else key.hex()
    assume(secret != fixed_secret(scheme_id))
    return SCHEMES_UNDER_TEST[scheme_id].sign(body=body, secret=secret, timestamp=timestamp)


@pytest.mark.parametrize("scheme_id", SCHEMES_UNDER_TEST)
@PROPERTY
@given(
    overrides=random_headers,
    body=st.binary(max_size=300),
    shaped=st.booleans(),
    key=forging_secrets,
    timestamp=st.integers(NOW - 400, NOW + 400),
)
def test_random_headers_and_bodies_are_refused_with_a_reason_never_an_exception(
    scheme_id, overrides, body, shaped, key, timestamp
):
    # Random values over well-formed forged headers reach past parsing to the comparison;
    # random values alone mostly exercise the parsing.
    base = forged_headers(scheme_id, body, key, timestamp) if shaped else {}
    request = Request({**base, **overrides}, body)
    with pytest.raises(VerificationFailed):
        SCHEMES_UNDER_TEST[scheme_id].verify(request, secrets=[fixed_secret(scheme_id)], now=NOW)


@pytest.mark.parametrize("scheme_id", SCHEMES_UNDER_TEST)
@PROPERTY
@given(body=st.binary(max_size=300), key=forging_secrets, offset=st.integers(-300, 300))
def test_a_signature_made_with_another_secret_never_verifies(scheme_id, body, key, offset):
    headers = forged_headers(scheme_id, body, key, NOW + offset)
    got = reason(SCHEMES_UNDER_TEST[scheme_id], headers, body, secrets=[fixed_secret(scheme_id)])
    assert got == "bad_signature"


@pytest.mark.parametrize("scheme_id", SCHEMES_UNDER_TEST)
@PROPERTY
@given(body=st.binary(min_size=1, max_size=300), data=st.data())
def test_flipping_any_byte_of_a_signed_body_fails_verification(scheme_id, body, data):
    scheme, secret = SCHEMES_UNDER_TEST[scheme_id], fixed_secret(scheme_id)
    headers = scheme.sign(body=body, secret=secret, timestamp=NOW)
    assert reason(scheme, headers, body, secrets=[secret]) is None
    index = data.draw(st.integers(0, len(body) - 1), label="index")
    mask = data.draw(st.integers(1, 255), label="mask")
    assert reason(scheme, headers, flip_byte(body, index, mask), secrets=[secret]) == (
        "bad_signature"
    )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(["id", "type", "data", "object", "event", "created", "event_id"])
            | st.text(max_size=8),
            children,
            max_size=5,
        )
    ),
    max_leaves=20,
)
bodies = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.text(max_size=100).map(lambda t: f"payload={t}&trigger_id={t}".encode()),
)


@pytest.mark.parametrize("scheme_id", SCHEMES_UNDER_TEST)
@PROPERTY
@given(headers=random_headers, body=bodies)
def test_parse_and_extract_raise_nothing_but_unparseable_body(scheme_id, headers, body):
    scheme, request = SCHEMES_UNDER_TEST[scheme_id], Request(headers, body)
    try:
        extracted = scheme.extract(request, scheme.parse(request))
    except UnparseableBody:
        return
    assert extracted.event_id
    assert extracted.occurred_at is None or extracted.occurred_at.tzinfo is UTC


@pytest.mark.parametrize(
    ("name", "options", "signed"),
    [
        ("stripe", {}, True),  # the id is the body's
        ("standard", {}, True),  # the id header is in the signed content
        ("slack", {}, True),  # event_id / trigger_id are the body's
        ("github", {}, False),  # X-GitHub-Delivery is outside the signature
        ("shopify", {}, False),  # X-Shopify-Webhook-Id likewise
        ("hmac", {}, True),  # id_field: the body's
        ("hmac", {"id_header": "x-id"}, False),
        ("hmac", {"id_header": "x-id", "signed_template": "{id}.{body}"}, True),
    ],
)
def test_each_scheme_says_whether_its_event_id_is_signed(name, options, signed):
    assert get_scheme(name, options or None).signs_event_id is signed
