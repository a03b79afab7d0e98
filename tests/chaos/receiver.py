"""The soak's receiver: an aiohttp server on 127.0.0.1 (its own thread and event loop)
that misbehaves at configurable rates and keeps the evidence for the ledger.

Per request to a chaos path, one seeded draw picks what happens:

- ``fail``: 500;
- ``throttle``: 429 with ``Retry-After: 1``;
- ``slow``: sleep past the sender's request timeout, then 200 (nobody is listening);
- ``drop``: read the whole body, then close the connection without answering (the
  lost-acknowledgement case: the receiver has the webhook, the sender does not know);
- otherwise 200.

A ``gone`` path answers 200 until it has seen ``gone_after`` requests, then 410 Gone for
ever (the customer deleted the endpoint mid-run). Every request's Standard Webhooks
signature is verified with the third-party ``standardwebhooks`` package before anything
else; every webhook-id is recorded with what the receiver did with it.
"""

import asyncio
import hashlib
import random
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from aiohttp import web
from standardwebhooks.webhooks import Webhook, WebhookVerificationError


@dataclass(frozen=True)
class Rates:
    fail: float = 0.0
    throttle: float = 0.0
    slow: float = 0.0
    drop: float = 0.0

    def pick(self, draw: float) -> str:
        for name in ("fail", "throttle", "slow", "drop"):
            rate = getattr(self, name)
            if draw < rate:
                return name
            draw -= rate
        return "ok"


@dataclass
class Copy:
    """One request as the receiver saw it."""

    path: str
    action: str  # ok, fail, throttle, slow, drop, gone
    at: float
    body_sha: str


@dataclass
class Evidence:
    copies: dict[str, list[Copy]] = field(default_factory=lambda: defaultdict(list))
    bad_signatures: int = 0
    # Requests whose signature verified, counted where the verifier said so.
    verified: int = 0
    unsigned: int = 0
    actions: Counter = field(default_factory=Counter)


class ChaosReceiver:
    def __init__(self, *, seed: int, slow_seconds: float = 3.0) -> None:
        self.rng = random.Random(seed)
        self.slow_seconds = slow_seconds
        self.paths: dict[str, tuple[str, Rates, int]] = {}  # path -> (mode, rates, gone_after)
        self.secrets: dict[str, Webhook] = {}
        self.evidence = Evidence()
        self.lock = threading.Lock()
        self._seen_by_path: Counter = Counter()
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="chaos-receiver", daemon=True)
        self.port = 0

    def add(self, path: str, *, secret: str = "", rates: Rates = Rates(), gone_after=None):
        mode = "gone" if gone_after is not None else "chaos"
        self.paths[path] = (mode, rates, gone_after or 0)
        if secret:
            self.secrets[path] = Webhook(secret)

    def set_secret(self, path: str, secret: str) -> None:
        self.secrets[path] = Webhook(secret)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def start(self) -> "ChaosReceiver":
        self._thread.start()
        assert self._started.wait(10), "receiver did not start"
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def snapshot(self) -> Evidence:
        with self.lock:
            return Evidence(
                copies={k: list(v) for k, v in self.evidence.copies.items()},
                bad_signatures=self.evidence.bad_signatures,
                verified=self.evidence.verified,
                unsigned=self.evidence.unsigned,
                actions=Counter(self.evidence.actions),
            )

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        path = request.path
        headers = {k.lower(): v for k, v in request.headers.items()}
        verifier = self.secrets.get(path)
        msg_id = headers.get("webhook-id", "")
        try:
            if verifier is None or not msg_id:
                raise WebhookVerificationError("no secret for this path or no webhook-id")
            verifier.verify(body, headers)
        except WebhookVerificationError:
            with self.lock:
                self.evidence.bad_signatures += 1
            return web.Response(status=400, text="bad signature")
        mode, rates, gone_after = self.paths.get(path, ("chaos", Rates(), 0))
        with self.lock:
            self.evidence.verified += 1
            self._seen_by_path[path] += 1
            if mode == "gone":
                action = "gone" if self._seen_by_path[path] > gone_after else "ok"
            else:
                action = rates.pick(self.rng.random())
            self.evidence.copies[msg_id].append(
                Copy(path, action, time.time(), hashlib.sha256(body).hexdigest()[:16])
            )
            self.evidence.actions[action] += 1
        if action == "fail":
            return web.Response(status=500, text="chaos")
        if action == "throttle":
            return web.Response(status=429, headers={"Retry-After": "1"}, text="slow down")
        if action == "gone":
            return web.Response(status=410, text="gone")
        if action == "slow":
            await asyncio.sleep(self.slow_seconds)
        if action == "drop":
            request.transport.abort()
            raise asyncio.CancelledError
        return web.Response(status=200, text="ok")

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=4 * 1024 * 1024)
        app.router.add_route("POST", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())
