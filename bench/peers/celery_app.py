"""The Celery peer's app: Redis broker (the bench's own db), no result backend, JSON
messages, prefetching tuned for many short tasks (see README.md)."""

import os

from celery import Celery

from bench.peers.common import REDIS_URL, mark_done, post_sync

RECEIVER = os.environ.get("PEER_RECEIVER_URL", "") + "/hook"
QUEUE = "bench_peers"

app = Celery("bench_peers", broker=REDIS_URL)
app.conf.update(
    task_default_queue=QUEUE,
    task_ignore_result=True,
    task_serializer="json",
    accept_content=["json"],
    # Celery's guide on many short tasks: a large prefetch multiplier; acknowledge on
    # receipt (the default, acks_late off).
    worker_prefetch_multiplier=int(os.environ.get("CELERY_PREFETCH", "64")),
    worker_concurrency=int(os.environ.get("PEER_WORKERS", os.cpu_count() or 1)),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@app.task(name="bench.deliver")
def deliver(data: dict, msg_id: str) -> None:
    post_sync(RECEIVER, data, msg_id)


@app.task(name="bench.noop")
def noop(seq: int) -> None:
    mark_done(seq)
