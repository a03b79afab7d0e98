"""Peer: procrastinate on PostgreSQL, one worker process per core, each running several
async jobs at once."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.peers import common


def main() -> int:
    parser = common.arguments(__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32, help="async jobs per process")
    args = parser.parse_args()
    env = common.peer_env(PEER_DB_URL=args.db_url, PEER_RECEIVER_URL=args.receiver)
    os.environ.update(env)
    import psycopg

    from bench.peers.proc_app import QUEUE, app, deliver, noop

    def reset() -> None:
        with psycopg.connect(args.db_url, autocommit=True) as conn:
            if not conn.execute("SELECT to_regclass('procrastinate_jobs')").fetchone()[0]:
                with app.open():
                    app.schema_manager.apply_schema()
            conn.execute("TRUNCATE procrastinate_jobs CASCADE")

    def enqueue(n: int) -> None:
        with app.open():
            task = {"post": deliver, "noop": noop}[args.workload]
            for start in range(0, n, 1000):
                task.batch_defer(
                    *(
                        common.job_arguments(args.workload, i)
                        for i in range(start, min(n, start + 1000))
                    )
                )
        # A queue in steady state has statistics (autovacuum); one just filled has not, and
        # the plans of the first minutes would be made for an empty table. The service's
        # run does the same (bench/outbound.py: analyze()).
        with psycopg.connect(args.db_url, autocommit=True) as conn:
            conn.execute("ANALYZE procrastinate_jobs")

    worker = [
        sys.executable,
        "-m",
        "procrastinate",
        "--app=bench.peers.proc_app.app",
        # Its worker logs every job with its arguments at INFO otherwise (two 1 KiB lines
        # per job): the other peers log warnings only, so does this one.
        "--log-level",
        "warning",
        "worker",
        "--queues",
        QUEUE,
        "--concurrency",
        str(args.concurrency),
    ]
    return common.drive(
        "procrastinate",
        args,
        reset=reset,
        enqueue=enqueue,
        workers=[worker] * args.processes,
        env=env,
        settings={
            "processes": args.processes,
            "concurrency_per_process": args.concurrency,
            "listen_notify": True,
            "delete_jobs": "never (default)",
            "log_level": "warning",
        },
    )


if __name__ == "__main__":
    sys.exit(main())
