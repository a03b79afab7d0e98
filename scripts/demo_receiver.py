"""A webhook receiver for the `make run` demo: what a customer's endpoint would do.

    python scripts/demo_receiver.py --port 8001 --secret-file var/demo_secret

It verifies each request's Standard Webhooks signature against the secrets in
``--secret-file`` (one a line, reloaded when the file changes), answers 401 to a bad one
and 200 otherwise, and prints one line per request. So that a newcomer sees a retry, the
first copy of every ``--fail-every``-th new webhook-id gets a 503; the retry carries the
same webhook-id and is accepted.

It uses aiohttp and ``deliveries.signing`` (standard library only), not Django.
"""

import argparse
import json
import sys
import time
from collections import OrderedDict
from datetime import datetime
from pathlib import Path

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deliveries.signing import verify

# Standard Webhooks asks receivers to refuse timestamps this far from their clock, which
# makes a captured request useless for a replay later.
TIMESTAMP_TOLERANCE_SECONDS = 5 * 60
# Webhook-ids remembered for the copy count; a long demo run forgets the oldest.
SEEN_CAPACITY = 10_000


class SecretFile:
    """The endpoint's signing secrets, reread whenever the file changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._secrets: list[str] = []

    def secrets(self) -> list[str]:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return []
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            lines = self.path.read_text().splitlines()
            self._secrets = [line.strip() for line in lines if line.strip()]
            self._stamp = stamp
        return self._secrets


class DemoReceiver:
    def __init__(self, secret_file: SecretFile, fail_every: int) -> None:
        self.secret_file = secret_file
        self.fail_every = fail_every
        self.seen: OrderedDict[str, int] = OrderedDict()
        self.distinct = 0

    def check_signature(self, headers, body: bytes) -> tuple[bool, str]:
        msg_id = headers.get("webhook-id", "")
        raw_ts = headers.get("webhook-timestamp", "")
        signature = headers.get("webhook-signature", "")
        if not (msg_id and raw_ts and signature):
            return False, "missing webhook headers"
        try:
            timestamp = int(raw_ts)
        except ValueError:
            return False, "bad timestamp"
        if abs(time.time() - timestamp) > TIMESTAMP_TOLERANCE_SECONDS:
            return False, "timestamp too far from now"
        secrets = self.secret_file.secrets()
        if not secrets:
            return False, f"no secret in {self.secret_file.path}"
        ok = verify(secrets, msg_id=msg_id, timestamp=timestamp, body=body, header=signature)
        return ok, "" if ok else "signature mismatch"

    def copy_number(self, msg_id: str) -> int:
        """1 for the first request with this webhook-id, 2 for its first retry, …"""
        if msg_id in self.seen:
            self.seen[msg_id] += 1
            self.seen.move_to_end(msg_id)
        else:
            self.seen[msg_id] = 1
            self.distinct += 1
            if len(self.seen) > SEEN_CAPACITY:
                self.seen.popitem(last=False)
        return self.seen[msg_id]

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        msg_id = request.headers.get("webhook-id", "")
        verified, reason = self.check_signature(request.headers, body)
        try:
            event_type = json.loads(body).get("type", "-")
        except (ValueError, AttributeError):
            event_type = "-"
        copy = self.copy_number(msg_id) if verified else 0
        if not verified:
            status, note = 401, f"rejected: {reason}"
        elif copy == 1 and self.fail_every and self.distinct % self.fail_every == 0:
            status, note = 503, "simulated outage, expect a retry with the same webhook-id"
        else:
            status, note = 200, "" if copy == 1 else f"copy {copy}, a retry"
        print(
            f"{datetime.now():%H:%M:%S} webhook-id={msg_id or '-'} type={event_type} "
            f"verified={'yes' if verified else 'no'} -> {status}" + (f" ({note})" if note else ""),
            flush=True,
        )
        return web.json_response({"ok": status == 200}, status=status)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--secret-file", type=Path, default=Path("var/demo_secret"))
    parser.add_argument(
        "--fail-every",
        type=int,
        default=7,
        help="Answer 503 to the first copy of every Nth new webhook-id (0: never).",
    )
    args = parser.parse_args()
    receiver = DemoReceiver(SecretFile(args.secret_file), args.fail_every)
    app = web.Application()
    app.router.add_post("/{tail:.*}", receiver.handle)
    failures = (
        f"a 503 for every {args.fail_every}th new webhook-id"
        if args.fail_every
        else "no simulated failures"
    )
    print(
        f"demo receiver on http://{args.host}:{args.port}/ "
        f"(secrets from {args.secret_file}, {failures})",
        flush=True,
    )
    # aiohttp stops cleanly on SIGINT and SIGTERM.
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
