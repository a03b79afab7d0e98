"""The benchmark's peers do the service's workload: the same body size, the same signature
scheme (checked by a third-party verifier), and a receiver that counts what arrives."""

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from bench.peers import common
from deliveries import signing

ROOT = Path(__file__).resolve().parents[2]


def test_the_peers_body_is_one_kib_and_signed_like_the_service():
    body = common.encode(common.payload(42))
    assert len(body) == common.BODY_SIZE == 1024
    headers = common.signed_headers("msg_42", body)
    assert Webhook(common.SECRET).verify(body, headers) == json.loads(body)
    assert signing.verify(
        [common.SECRET],
        msg_id="msg_42",
        timestamp=int(headers["webhook-timestamp"]),
        body=body,
        header=headers["webhook-signature"],
    )
    tampered = body.replace(b'"seq":42', b'"seq":43')
    try:
        Webhook(common.SECRET).verify(tampered, headers)
    except WebhookVerificationError:
        pass
    else:
        raise AssertionError("a changed body must not verify")


def test_the_receiver_counts_distinct_webhook_ids_and_their_first_arrival():
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "receiver.py"), "--port", "0"],
        stdout=subprocess.PIPE,
    )
    try:
        port = int(proc.stdout.readline().split()[1])
        base = f"http://127.0.0.1:{port}"
        for msg_id in ("a", "a", "b"):
            req = urllib.request.Request(  # noqa: S310 - a local receiver
                base + "/hook", data=b"{}", headers={"webhook-id": msg_id}, method="POST"
            )
            with urllib.request.urlopen(req, timeout=5) as r:  # noqa: S310
                assert r.status == 200
        counts = common.receiver_counts(base)
        assert counts["requests"] == 3
        assert counts["distinct_webhook_ids"] == 2
        assert counts["first_at"] <= counts["last_at"]
        with urllib.request.urlopen(base + "/arrivals", timeout=5) as r:  # noqa: S310
            arrivals = json.loads(r.read())
        assert set(arrivals) == {"a", "b"}
        assert arrivals["a"] <= arrivals["b"]
        common.receiver_reset(base)
        assert common.receiver_counts(base)["requests"] == 0
    finally:
        proc.terminate()
        proc.wait(10)
