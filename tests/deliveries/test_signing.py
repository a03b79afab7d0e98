"""Standard Webhooks signing: the spec's test vector and a third-party verifier."""

import base64
import hashlib
import hmac
import time

import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from deliveries import signing

VECTOR_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
VECTOR_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
VECTOR_TS = 1614265330
VECTOR_BODY = b'{"test": 2432232314}'
VECTOR_SIG = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_the_spec_vector_is_reproduced():
    sig = signing.sign(VECTOR_SECRET, msg_id=VECTOR_ID, timestamp=VECTOR_TS, body=VECTOR_BODY)
    assert sig == VECTOR_SIG


def test_the_vector_verifies_and_a_changed_signature_does_not():
    kw = {"msg_id": VECTOR_ID, "timestamp": VECTOR_TS, "body": VECTOR_BODY}
    assert signing.verify([VECTOR_SECRET], header=VECTOR_SIG, **kw)
    assert not signing.verify([VECTOR_SECRET], header=VECTOR_SIG[:-3] + "OA=", **kw)
    assert not signing.verify([VECTOR_SECRET], header="v2," + VECTOR_SIG[3:], **kw)
    assert not signing.verify([VECTOR_SECRET], header="", **kw)


def test_generated_secrets_are_long_enough_and_unique():
    secrets = {signing.generate_secret() for _ in range(100)}
    assert len(secrets) == 100
    for s in secrets:
        assert s.startswith("whsec_")
        assert len(base64.b64decode(s.removeprefix("whsec_"))) >= 24


def test_one_signature_per_active_secret_and_any_one_verifies_with_the_third_party_package():
    old, new = signing.generate_secret(), signing.generate_secret()
    body = b'{"x":1}'
    # standardwebhooks checks the timestamp against the clock, so sign "now".
    ts = int(time.time())
    header = signing.signature_header([new, old], msg_id="msg_1", timestamp=ts, body=body)
    assert len(header.split(" ")) == 2
    headers = {"webhook-id": "msg_1", "webhook-timestamp": str(ts), "webhook-signature": header}
    for secret in (old, new):
        assert Webhook(secret).verify(body, headers) == {"x": 1}
    with pytest.raises(WebhookVerificationError):
        Webhook(signing.generate_secret()).verify(body, headers)


def reference_signature(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The spec written out longhand, with nothing cached."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


ROTATION = [VECTOR_SECRET, signing.generate_secret(), signing.generate_secret()]


@hypothesis_settings(max_examples=200, deadline=None)
@given(
    messages=st.lists(
        st.tuples(
            st.sampled_from(ROTATION),
            st.text(min_size=1, max_size=40),
            st.integers(min_value=0, max_value=2**40),
            st.binary(max_size=4096),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_signatures_match_the_uncached_computation_whatever_was_signed_before(messages):
    """The keyed HMAC kept per secret is copied, never consumed: signing one message
    must not leak into the next one signed with the same or another secret."""
    for secret, msg_id, timestamp, body in messages:
        expected = reference_signature(secret, msg_id, timestamp, body)
        assert signing.sign(secret, msg_id=msg_id, timestamp=timestamp, body=body) == expected


def test_the_key_of_a_secret_is_decoded_once_and_the_cache_is_bounded():
    secret = signing.generate_secret()
    before = signing.secret_key.cache_info()

    for n in range(3):
        signing.sign(secret, msg_id=f"msg_{n}", timestamp=VECTOR_TS, body=b"{}")

    after = signing.secret_key.cache_info()
    assert after.misses == before.misses + 1
    assert after.maxsize is not None
    assert signing.secret_key(secret) == base64.b64decode(secret.removeprefix("whsec_"))


def test_delivery_headers_carry_custom_headers_and_a_verifiable_signature():
    custom = {"authorization": "Bearer abc"}
    ts = int(time.time())

    headers = signing.delivery_headers(
        custom, [VECTOR_SECRET], msg_id="msg_1", timestamp=ts, body=VECTOR_BODY
    )

    assert headers["authorization"] == "Bearer abc"
    assert headers["webhook-id"] == headers["idempotency-key"] == "msg_1"
    assert headers["webhook-timestamp"] == str(ts)
    assert headers["content-type"] == "application/json"
    assert Webhook(VECTOR_SECRET).verify(VECTOR_BODY, headers) == {"test": 2432232314}
