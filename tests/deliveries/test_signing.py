"""Standard Webhooks signing: the spec's test vector and a third-party verifier."""

import base64
import time

import pytest
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
