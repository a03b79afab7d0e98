"""A real local HTTP receiver for tests: an aiohttp server on 127.0.0.1 in its own thread.

Each path has a behaviour: a function of how many times this ``webhook-id`` was seen at
this path (1 for the first copy) that returns (status, headers, body), or sleeps first.
Every request is recorded with its exact headers and body bytes.
"""

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float

    @property
    def webhook_id(self) -> str:
        return self.headers.get("webhook-id", "")


Behaviour = Callable[[int], tuple[int, dict, bytes]]


def always(status: int, headers: dict | None = None, body: bytes = b"") -> Behaviour:
    return lambda n: (status, headers or {}, body)


def fail_first(times: int, status: int = 500, headers: dict | None = None) -> Behaviour:
    """Fail the first ``times`` copies of each webhook-id, then answer 200."""
    return lambda n: (status, headers or {}, b"nope") if n <= times else (200, {}, b"ok")


class Receiver:
    def __init__(self) -> None:
        self.behaviours: dict[str, Behaviour] = {}
        self.delays: dict[str, float] = {}
        self.received: list[Received] = []
        self._seen: Counter = Counter()
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self.port = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def url(self, path: str = "/ok") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def start(self) -> "Receiver":
        self._thread.start()
        assert self._started.wait(10), "receiver did not start"
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def requests_to(self, path: str) -> list[Received]:
        with self._lock:
            return [r for r in self.received if r.path == path]

    def wait_for(self, count: int, timeout: float = 10.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.received) >= count:
                    return list(self.received)
            time.sleep(0.02)
        raise AssertionError(f"receiver saw {len(self.received)} requests, wanted {count}")

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        path = request.path
        with self._lock:
            self.received.append(
                Received(
                    path, {k.lower(): v for k, v in request.headers.items()}, body, time.time()
                )
            )
            self._seen[(path, request.headers.get("webhook-id"))] += 1
            n = self._seen[(path, request.headers.get("webhook-id"))]
        delay = self.delays.get(path, 0.0)
        if delay:
            await asyncio.sleep(delay)
        behaviour = self.behaviours.get(path, always(200, body=b"ok"))
        status, headers, payload = behaviour(n)
        return web.Response(status=status, headers=headers, body=payload)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())
