"""A minimal local webhook receiver for the benchmarks: one aiohttp process.

Every POST is answered ``200`` with a two-byte body after reading the request body (a
POST to ``/status/NNN/...`` with status NNN instead, for the failure path; to
``/flaky/...`` with 503 for the first copy of each ``webhook-id``, for the retry path),
and counted: all requests, and distinct ``webhook-id`` values (so the outbound benchmark can
tell duplicates from deliveries), with the wall-clock time (``time.time()``) of the first
and the last request and of each ``webhook-id``'s first arrival. ``GET /count`` returns the
counters as JSON, ``GET /arrivals`` every ``webhook-id`` with its first arrival time (the
latency benchmark), and ``POST /reset`` zeroes them. The bare client loop, the service and
the peers are measured against the same process, so whatever this costs is in all of them.

    python bench/receiver.py --port 0 [--cpu 1]

prints ``listening <port>`` on stdout once it accepts connections.
"""

import argparse
import asyncio
import contextlib
import os
import socket
import sys
import time

from aiohttp import web


class Counts:
    def __init__(self) -> None:
        self.requests = 0
        self.body_bytes = 0
        # webhook-id -> time.time() of its first arrival
        self.ids: dict[str, float] = {}
        self.first_at: float | None = None
        self.last_at: float | None = None

    def as_dict(self) -> dict:
        return {
            "requests": self.requests,
            "body_bytes": self.body_bytes,
            "distinct_webhook_ids": len(self.ids),
            "first_at": self.first_at,
            "last_at": self.last_at,
        }


def make_app(counts: Counts) -> web.Application:
    async def hook(request: web.Request) -> web.Response:
        body = await request.read()
        now = time.time()
        if counts.first_at is None:
            counts.first_at = now
        counts.last_at = now
        counts.requests += 1
        counts.body_bytes += len(body)
        webhook_id = request.headers.get("webhook-id")
        first_copy = bool(webhook_id) and webhook_id not in counts.ids
        if first_copy:
            counts.ids[webhook_id] = now
        status = 200
        if request.path.startswith("/status/"):
            status = int(request.path.split("/")[2])
        elif request.path.startswith("/flaky/") and first_copy:
            status = 503
        return web.Response(status=status, body=b"ok", content_type="text/plain")

    async def count(request: web.Request) -> web.Response:
        return web.json_response(counts.as_dict())

    async def arrivals(request: web.Request) -> web.Response:
        return web.json_response(counts.ids)

    async def reset(request: web.Request) -> web.Response:
        counts.__init__()
        return web.json_response(counts.as_dict())

    app = web.Application()
    app.router.add_get("/count", count)
    app.router.add_get("/arrivals", arrivals)
    app.router.add_post("/reset", reset)
    app.router.add_post("/{tail:.*}", hook)
    return app


async def serve(port: int) -> None:
    counts = Counts()
    runner = web.AppRunner(make_app(counts), access_log=None, handle_signals=True)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    site = web.SockSite(runner, sock, backlog=4096)
    await site.start()
    print(f"listening {sock.getsockname()[1]}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--cpu", type=int, default=None, help="pin the process to this core")
    args = parser.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    with contextlib.suppress(KeyboardInterrupt, web.GracefulExit):
        asyncio.run(serve(args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
