"""The Python snippet of docs/receivers.md verifies what the service sends, and refuses a
tampered copy and a rotated-out secret."""

import re
import time
from pathlib import Path

from deliveries import signing

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "receivers.md"


def _python_snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert len(blocks) == 1, "docs/receivers.md holds one Python snippet"
    return blocks[0].replace("    ...\n", "    return 200, event\n")


def _receiver(secret: str):
    scope = {"secret": secret}
    exec(_python_snippet(), scope)  # noqa: S102 - the documented snippet, run as written
    return scope["receive"]


def _delivery(secrets: list[str], body: bytes = b'{"type": "invoice.paid", "id": 7}'):
    headers = signing.delivery_headers(
        {},
        secrets,
        msg_id="01890a5d-ac96-774b-bcce-b302099a8057",
        timestamp=int(time.time()),
        body=body,
    )
    return body, headers


def test_the_guide_verifies_a_delivery_signed_during_a_rotation():
    old, new = signing.generate_secret(), signing.generate_secret()
    body, headers = _delivery([new, old])

    assert _receiver(old)(body, headers) == (200, {"type": "invoice.paid", "id": 7})
    assert _receiver(new)(body, headers) == (200, {"type": "invoice.paid", "id": 7})


def test_the_guide_refuses_a_tampered_body_and_another_secret():
    secret = signing.generate_secret()
    body, headers = _delivery([secret])

    assert _receiver(secret)(body.replace(b"7", b"8"), headers) == 400
    assert _receiver(signing.generate_secret())(body, headers) == 400
