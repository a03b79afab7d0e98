"""The service's jobs for the harness's jobs scenario (bench/run.py sets
``JOBS_MODULES=bench.background_jobs`` for the ``run_jobs`` processes it starts): the
peers' two workloads (bench/peers/common.py) as ``@job`` functions, under the same type
names as the peers' tasks.

``bench.noop`` and ``bench.deliver`` are ``async def``, run on the worker's event loop,
as procrastinate's tasks and the SKIP LOCKED baseline run theirs; ``bench.noop_sync`` is
the no-op as a plain function, run in a worker thread, as django-q2's and Celery's are.
"""

import os

import aiohttp

from bench.peers import common
from deliveries.jobs.background import job

RECEIVER = os.environ.get("PEER_RECEIVER_URL", "") + "/hook"
NOOP_SYNC = "bench.noop_sync"
_session: aiohttp.ClientSession | None = None


@job(common.TASK_NAMES["noop"], queue="default")
async def noop(seq: int) -> None:
    common.mark_done(seq)


@job(NOOP_SYNC, queue="default")
def noop_sync(seq: int) -> None:
    common.mark_done(seq)


@job(common.TASK_NAMES["post"], queue="default")
async def deliver(data: dict, msg_id: str) -> None:
    """The signed 1 KiB POST, over one keep-alive session per worker process."""
    global _session
    if _session is None:
        _session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    await common.post_async(_session, RECEIVER, data, msg_id)


def queue_table_names() -> str:
    """The jobs' tables, as TRUNCATE and ANALYZE name them."""
    from deliveries.jobs.models import Job, JobRun

    return f"{Job._meta.db_table}, {JobRun._meta.db_table}"


def enqueue_all(job_type: str, workload: str, count: int) -> None:
    """``count`` jobs of ``job_type`` with ``workload``'s arguments (the peers'), enqueued
    with ``enqueue`` in transactions of 1,000 and no worker running, then the tables
    analyzed, as the peers' runs do."""
    from django.db import transaction

    from bench import outbound as ob
    from deliveries.jobs.background import enqueue

    for start in range(0, count, 1000):
        with transaction.atomic():
            for i in range(start, min(count, start + 1000)):
                enqueue(job_type, common.job_arguments(workload, i))
    ob.sql(f"ANALYZE {queue_table_names()}")
