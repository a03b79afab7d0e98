"""The procrastinate peer's app: PsycopgConnector on the peer database, one async task
posting with one aiohttp session per worker process, and an async no-op task."""

import os

import aiohttp
from procrastinate import App, PsycopgConnector

from bench.peers.common import mark_done, post_async

RECEIVER = os.environ.get("PEER_RECEIVER_URL", "") + "/hook"
QUEUE = "bench_peers"

app = App(connector=PsycopgConnector(conninfo=os.environ.get("PEER_DB_URL", "")))
_session: aiohttp.ClientSession | None = None


@app.task(name="bench.deliver", queue=QUEUE)
async def deliver(data: dict, msg_id: str) -> None:
    global _session
    if _session is None:
        _session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    await post_async(_session, RECEIVER, data, msg_id)


@app.task(name="bench.noop", queue=QUEUE)
async def noop(seq: int) -> None:
    mark_done(seq)
