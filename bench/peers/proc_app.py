"""The procrastinate peer's app: PsycopgConnector on the peer database, one async task
posting with one aiohttp session per worker process."""

import os

import aiohttp
from procrastinate import App, PsycopgConnector

from bench.peers.common import post_async

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
