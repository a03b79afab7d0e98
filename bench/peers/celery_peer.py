"""Peer: Celery with its Redis broker, a prefork worker with one child per core."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.peers import common


def main() -> int:
    args = common.arguments(__doc__.splitlines()[0]).parse_args()
    env = common.peer_env(PEER_WORKERS=str(args.processes), PEER_RECEIVER_URL=args.receiver)
    os.environ.update(env)
    import redis

    from bench.peers.celery_app import QUEUE, app, deliver, noop

    def reset() -> None:
        redis.Redis.from_url(common.REDIS_URL).flushdb()  # only the bench's own db

    task = {"post": deliver, "noop": noop}[args.workload]

    def enqueue(n: int) -> None:
        with app.producer_or_acquire() as producer:
            for i in range(n):
                kwargs = common.job_arguments(args.workload, i)
                task.apply_async(kwargs=kwargs, producer=producer)

    worker = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "bench.peers.celery_app",
        "worker",
        "--pool",
        "prefork",
        "--concurrency",
        str(args.processes),
        "--queues",
        QUEUE,
        "--loglevel",
        "WARNING",
        # Celery's optimizing guide: no cluster chatter for a single worker.
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]
    return common.drive(
        "celery-redis",
        args,
        reset=reset,
        enqueue=enqueue,
        workers=[worker],
        env=env,
        settings={
            "pool": "prefork",
            "concurrency": args.processes,
            "prefetch_multiplier": app.conf.worker_prefetch_multiplier,
            "task_ignore_result": True,
            "flags": ["--without-gossip", "--without-mingle", "--without-heartbeat"],
        },
    )


if __name__ == "__main__":
    sys.exit(main())
