"""CPU per no-op background job: one ``run_jobs`` process draining N enqueued ``bench.noop``
jobs, started as the jobs scenario of bench/run.py starts it (``--concurrency 1000``),
with the CPU seconds of that process and of its database's PostgreSQL backends per 1,000
jobs, and each run's check that every job is done with its run recorded.

CPU rather than a rate, so that a figure holds on a machine other work shares. The
steady figures leave the worker's start-up out: from the first look that found a job run
to the last (``common.measure``).

    .venv/bin/python bench/jobs_cpu.py --events 20000 --repeat 3
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import outbound as ob
from bench.peers import common


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000, help="N (default 20,000)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=1000)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--sync", action="store_true", help="the no-op as a plain function")
    parser.add_argument("--db-name", default=None, help="default: <DATABASE_URL's>_bench_jobs")
    args = parser.parse_args(argv)
    base_url = ob.database_url()
    db_name = args.db_name or f"{urlsplit(base_url).path.lstrip('/') or 'webhooks'}_bench_jobs"
    ob.ensure_database(ob.with_db(base_url, "postgres"), db_name)
    db_url = ob.with_db(base_url, db_name)
    ob.migrate({**os.environ, "DATABASE_URL": db_url})
    ob.setup_django(db_url)
    import bench.background_jobs as bench_jobs  # registers the job types
    from deliveries.jobs.models import Job, JobRun

    job_type = bench_jobs.NOOP_SYNC if args.sync else common.TASK_NAMES["noop"]

    def reset() -> None:
        ob.sql(f"TRUNCATE {bench_jobs.queue_table_names()}")

    def enqueue_all(count: int) -> None:
        bench_jobs.enqueue_all(job_type, "noop", count)

    worker = [sys.executable, "manage.py", "run_jobs", "--queue", "default"]
    worker += ["--concurrency", str(args.concurrency)]
    env = ob.pipeline_env(base_url, db_name, "jobs", {"JOBS_MODULES": "bench.background_jobs"})
    logs = Path(tempfile.mkdtemp(prefix="bench-jobs-cpu-"))
    rows = []
    for i in range(args.repeat):
        run_args = argparse.Namespace(
            events=args.events, db_url=db_url, receiver="", timeout=args.timeout, logs=logs,
            workload="noop",
        )  # fmt: skip
        out = common.measure(
            "jobs-cpu", run_args, reset=reset, enqueue=enqueue_all, workers=[worker], env=env,
            settings={},
        )  # fmt: skip
        done = ob.sql(f"SELECT count(*) FROM {Job._meta.db_table} WHERE state = 'done'")[0][0]
        runs = ob.sql(f"SELECT count(*) FROM {JobRun._meta.db_table}")[0][0]
        if done != args.events or runs != args.events:
            print(f"FAILED: {args.events} enqueued, {done} done, {runs} runs", file=sys.stderr)
            return 1
        per_k, steady_k = 1000 / args.events, 1000 / max(out["steady_jobs"], 1)
        row = {
            "worker_s_per_1k": round(out["worker_cpu_seconds"] * per_k, 4),
            "postgres_s_per_1k": round(out["postgres_cpu_seconds"] * per_k, 4),
            "steady_worker_s_per_1k": round(out["steady_worker_cpu_seconds"] * steady_k, 4),
            "steady_postgres_s_per_1k": round(out["steady_postgres_cpu_seconds"] * steady_k, 4),
            "per_second": out["per_second"],
        }
        rows.append(row)
        print(json.dumps({"run": i + 1, **row}), flush=True)
    keys = [k for k in rows[0] if k.endswith("_per_1k")]
    print(json.dumps({"median": {k: statistics.median(r[k] for r in rows) for k in keys}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
