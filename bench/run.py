"""The benchmark harness: the service against the bare limits and its peers, side by side.

    python bench/run.py                 # every scenario, full size, 3 repeats (make bench)
    python bench/run.py --quick         # small N, 1 repeat: for iterating on the harness
    python bench/run.py --scenarios throughput,growth --repeat 5

It starts what it needs (the bench databases next to the one ``DATABASE_URL`` names,
``bench/receiver.py``, gunicorn, the pipeline's processes, each peer's workers; Redis
through ``scripts/ensure_redis.sh``, database 7 only, flushed by the peers that use it),
runs each scenario ``--repeat`` times and writes ``bench/results/results.json`` (every
run, medians, ratios, core count, load average, versions), ``results.md`` (the tables)
and ``results.png`` (the chart); the jobs scenario the same to ``jobs.json``, ``jobs.md``
and ``jobs.png``. Scenarios (see docs/benchmarks.md):

* ``throughput``: N signed 1 KiB deliveries to the receiver by the bare aiohttp loop (at
  64 and at 256 requests in flight; the faster run of each repeat is its baseline), a bare
  SKIP LOCKED queue, the service, the statements floor (bench/floor.py: the service's SQL
  without the service's Python) and each peer (bench/peers/); rate = N over the
  receiver's first-to-last arrival, ratios taken within each repeat;
* ``latency``: the service running, an open-model publisher publishing at fixed rates;
  latency = the receiver's first arrival of each delivery minus its scheduled time;
* ``inbound``: the receive view under gunicorn and the pipeline processing the events
  with a no-op handler: acknowledged/s and processed/s; then a stored backlog processed
  by the pipeline alone (processing's own capacity);
* ``growth``: one scheduler pass (and one with every endpoint at its ceiling), one
  worker claim batch and the peak RSS of ``run_scheduler --once`` with 10,000 and
  10,000,000 due deliveries (seeded with set-based SQL);
* ``jobs``: the host's background jobs (``run_jobs``), the peers and a bare SKIP LOCKED
  queue each draining N enqueued jobs, no-op jobs and one-POST jobs; rate = N over the
  first-to-last completion (no-op: marks in a shared file; POST: the receiver).
"""

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

import outbound as ob  # noqa: E402 - bench/ is not a package
import peak_rss  # noqa: E402
from peers.common import REDIS_URL as PEERS_REDIS_URL  # noqa: E402

RESULTS = BENCH / "results"
PEERS = {
    # name: (script, extra arguments)
    "django-q2 ORM": ("djq.py", ["--broker", "orm"]),
    "django-q2 Redis": ("djq.py", ["--broker", "redis"]),
    "procrastinate": ("procrastinate_peer.py", []),
    "Celery Redis": ("celery_peer.py", []),
}
BASELINE_SKIP_LOCKED = "bare SKIP LOCKED"
BASELINE_FLOOR = "statements floor"
BASELINE_SIGNED = "bare loop, signed and checked"
# The bare aiohttp loop of each repeat: the faster of its runs at each of
# ob.BARE_CONCURRENCIES requests in flight (ob.best_bare). Every outbound ratio and the CPU
# per request are taken against it; its runs at each count have rows of their own.
BARE_LOOP = "bare aiohttp loop"


def bare_loop_at(concurrency: int) -> str:
    """The row of the bare loop's runs at ``concurrency`` requests in flight."""
    return f"{BARE_LOOP}, {concurrency} in flight"


# Every scenario runs the product's defaults (deliveries/core/conf.py DEFAULTS, one
# run_workers per core as docs/deployment.md runs them) but for what is set here, each
# with its reason. Every process: EGRESS_ALLOW_NETWORKS=127.0.0.0/8 (ob.pipeline_env),
# as the receiver listens on loopback, which the egress guard refuses by default.
#
# Throughput only (SERVICE_ENV, service_pipeline), where one tenant's one endpoint takes
# all N deliveries:
SERVICE_ENV = {
    # The peers have no per-endpoint or per-tenant ceiling. The defaults (500, 2,000)
    # are the product's isolation: one endpoint that hangs holds at most 500 of the
    # workers' request slots, one tenant's backlog cannot fill the queue.
    "DELIVERY_ENDPOINT_MAX_CONCURRENCY": "5000",
    "DELIVERY_TENANT_MAX_IN_FLIGHT": "5000",
}
# Messages per take: one take fills a worker's room (256 requests in flight and 128
# leased ahead). The default, 200, also bounds the inbound events one processing
# transaction runs the host's handlers for (docs/inbound.md), too many at once there.
SERVICE_BATCH_SIZE = 500
# Requests in flight per worker process: 256, the bare loop's larger count, against a
# receiver that answers at once. The default, 512, leaves the healthy endpoints room
# beside one that hangs at its ceiling of 500 (docs/reliability.md), at some CPU per
# request here. The signed loop keeps as many in flight as one worker process.
SERVICE_CONCURRENCY = 256
# The Redis broker's row: django-q2's Redis broker on the peers' Redis database (7,
# flushed before each run), the relay publishing to it.
REDIS_BROKER_ENV = {
    "QUEUE_BROKER_CLASS": "deliveries.jobs.brokers.redis.RedisBroker",
    "REDIS_URL": PEERS_REDIS_URL,
}
SERVICE_REDIS = "service, Redis broker"
# Worker processes dividing the work with no coordination but the database.
SPREAD_WORKERS = 4
SERVICE_SPREAD = f"service, {SPREAD_WORKERS} worker processes"
INBOUND_SLUG = "benchin"
INBOUND_SECRET = "whsec_bench_inbound"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[k]


def receiver_rate(counts: dict, n: int) -> float | None:
    span = (counts.get("last_at") or 0) - (counts.get("first_at") or 0)
    return round(n / span, 1) if span > 0 else None


pipeline_env = ob.pipeline_env


def start_pipeline(pipeline, base_url: str, db_name: str, logs: Path, extra_env=None) -> list:
    ob.sql("DELETE FROM deliveries_looprun")
    procs = []
    for role, argv in pipeline.commands():
        env = pipeline_env(base_url, db_name, role, {**pipeline.env, **(extra_env or {})})
        procs.append((role, ob.spawn(argv, env=env, log=logs / f"{role}.log")))
    ob._wait_until_running(procs, time.perf_counter() + 90)
    return procs


# --- Throughput ----------------------------------------------------------------------


def run_peer(name: str, script: str, extra: list, n: int, ctx: dict) -> dict:
    argv = [
        sys.executable,
        str(BENCH / "peers" / script),
        *extra,
        "--events",
        str(n),
        "--receiver",
        ctx["receiver"].url(""),
        "--db-url",
        ctx["peer_db_url"],
        "--timeout",
        str(ctx["timeout"]),
        "--logs",
        str(ctx["logs"]),
    ]
    busy0, total0 = ob.machine_cpu()
    done = subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=ctx["timeout"] + 300
    )
    busy1, total1 = ob.machine_cpu()
    if done.returncode != 0:
        raise ob.BenchError(f"peer {name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if out["duplicates"]:
        log(f"  {name}: {out['duplicates']} duplicate requests")
    out["machine_cpu_busy"] = round((busy1 - busy0) / max(1, total1 - total0), 3)
    return out


def service_pipeline(env: dict, workers: int | None = None) -> "ob.Pipeline":
    """The service as the throughput scenario runs it: one run_workers process per core
    (or ``workers``), the product's defaults but for the settings above."""
    return ob.Pipeline(
        workers=workers or os.cpu_count() or 1,
        lanes=None,
        batch_size=SERVICE_BATCH_SIZE,
        worker_concurrency=SERVICE_CONCURRENCY,
        env={**SERVICE_ENV, **env},
    )


def default_pipeline(env: dict) -> "ob.Pipeline":
    """The service with the product's defaults, one run_workers process per core: the
    latency and inbound scenarios, where no ceiling, batch or concurrency binds (1,000
    events a second to one endpoint keep about a hundred in flight)."""
    return ob.Pipeline(
        workers=os.cpu_count() or 1, lanes=None, batch_size=None, worker_concurrency=None, env=env
    )


def _request_us(loop: dict, n: int) -> float | None:
    """CPU per request of a client loop run: its client and the receiver."""
    cpu = loop.get("cpu_seconds") or {}
    return (cpu["client"] + cpu["receiver"]) * 1e6 / n if cpu else None


def _postgres_us(drains: list[dict], n: int) -> float | None:
    """PostgreSQL's CPU per delivery running the design's statements: the least of
    ``drains`` (the service's run and the floor's, same repeat)."""
    postgres = [
        d["cpu_seconds"]["postgres_all"]
        for d in drains
        if (d.get("cpu_seconds") or {}).get("postgres_all")
    ]
    return min(postgres) * 1e6 / n if postgres else None


def statements_ceiling(bare: dict, drains: list[dict], n: int, cores: int) -> dict | None:
    """The most the design's statements leave of the bare loop, from CPU alone.

    Any implementation pays per delivery at least what the bare loop pays per request (its
    client and the receiver) plus what PostgreSQL spends per delivery running the design's
    statements. With every core busy, that caps the rate at cores / (the two together).
    The estimate flatters the ceiling: it charges nothing for signing or the egress
    checks, for the scheduler's and relay's Python, for the workers' Python beyond a bare
    client, or for the kernel (``design_bound`` charges the first two)."""
    request_us, postgres_us = _request_us(bare, n), _postgres_us(drains, n)
    if request_us is None or postgres_us is None or not bare.get("per_second"):
        return None
    per_second = cores * 1e6 / (request_us + postgres_us)
    return {
        "bare_request_cpu_us": round(request_us, 1),
        "postgres_cpu_us": round(postgres_us, 1),
        "per_second": round(per_second, 1),
        "over_bare_loop": round(per_second / bare["per_second"], 3),
    }


def design_bound(
    bare: dict, signed: dict, service: dict, drains: list[dict], n: int, cores: int
) -> dict | None:
    """The most the design leaves of the bare loop on this machine, from CPU alone: the
    statements ceiling with the request as the worker sends it (``signed``: the worker's
    headers and signature, through the egress module) and the design's scheduler and relay
    processes (their CPU in the service's run) charged too. Still nothing for the
    workers' own Python (claims, recording, leases, ceilings) or for the kernel, and every
    core busy all the time: no implementation of the design in Python goes faster."""
    request_us, postgres_us = _request_us(signed, n), _postgres_us(drains, n)
    cpu = service.get("cpu_seconds") or {}
    if request_us is None or postgres_us is None or not bare.get("per_second"):
        return None
    if "scheduler" not in cpu:
        return None
    # No relay runs with the database broker: its workers take the outbox themselves.
    processes_us = (cpu["scheduler"] + cpu.get("relay", 0.0)) * 1e6 / n
    per_second = cores * 1e6 / (request_us + postgres_us + processes_us)
    return {
        "signed_request_cpu_us": round(request_us, 1),
        "postgres_cpu_us": round(postgres_us, 1),
        "scheduler_relay_cpu_us": round(processes_us, 1),
        "per_second": round(per_second, 1),
        "over_bare_loop": round(per_second / bare["per_second"], 3),
    }


def ratio_in_repeats(systems: dict[str, list[dict]], of: str, other: str) -> float | None:
    """The median over the repeats of ``of``'s rate ÷ ``other``'s, each ratio taken
    within one repeat (the two measured minutes apart on the same machine)."""
    pairs = [
        s["per_second"] / o["per_second"]
        for s, o in zip(systems.get(of, []), systems.get(other, []), strict=False)
        if s["per_second"] and o["per_second"]
    ]
    return round(median(pairs), 3) if pairs else None


def over_fastest_peer(systems: dict[str, list[dict]], peers: list[str], of: str) -> float | None:
    """The median over the repeats of ``of``'s rate ÷ the fastest peer's in that repeat."""
    ratios = []
    for i, s in enumerate(systems.get(of, [])):
        best = max(
            ((systems[p][i]["per_second"] or 0) for p in peers if i < len(systems.get(p, []))),
            default=0,
        )
        if best and s["per_second"]:
            ratios.append(s["per_second"] / best)
    return round(median(ratios), 3) if ratios else None


# Keys of a service run's cpu_seconds that are no pipeline process.
_NOT_PIPELINE = {"bench_poller", "receiver", "postgres_by_app", "postgres_backends", "postgres_all"}
CPU_TARGET = 1.6
# Throughput at the defaults against the bare loop and the fastest peer, each a ratio
# taken within a repeat (docs/benchmarks.md, "Targets").
THROUGHPUT_TARGETS = {"service_over_bare_loop": 0.6, "service_over_fastest_peer": 5.0}
# No-op inbound events processed a second from a stored backlog.
INBOUND_TARGET = 15_000


def _meets(tp: dict, key: str) -> bool:
    """Whether a throughput run's ratio ``key`` meets today's target: a results file
    rendered again is judged against THROUGHPUT_TARGETS, not the targets it was run with."""
    ratio = tp["ratios"].get(key)
    return bool(ratio and ratio >= THROUGHPUT_TARGETS[key])


def cpu_over_bare_loop(bare: dict, service: dict, n: int) -> dict | None:
    """CPU per delivery of every process the delivery takes (the pipeline's, the
    receiver, every PostgreSQL process) ÷ the bare loop's CPU per request (its client and
    the receiver), both from the same repeat."""
    request_us = _request_us(bare, n)
    cpu = service.get("cpu_seconds") or {}
    if request_us is None or "postgres_all" not in cpu:
        return None
    processes = sum(v for k, v in cpu.items() if k not in _NOT_PIPELINE)
    delivery_us = (processes + cpu["receiver"] + cpu["postgres_all"]) * 1e6 / n
    return {
        "service_cpu_us": round(delivery_us, 1),
        "bare_request_cpu_us": round(request_us, 1),
        "ratio": round(delivery_us / request_us, 3),
    }


def cpu_summary(systems: dict[str, list[dict]], n: int) -> dict:
    """``cpu_over_bare_loop`` of each repeat (``runs``), then the median of each figure
    and whether the median ratio meets CPU_TARGET."""
    runs = [
        c
        for bare, service in zip(systems[BARE_LOOP], systems["service"], strict=False)
        if (c := cpu_over_bare_loop(bare, service, n))
    ]
    out: dict = {"runs": runs, **{k: median(c[k] for c in runs) for k in (runs[0] if runs else {})}}
    out["meets"] = bool(runs and out["ratio"] <= CPU_TARGET)
    return out


def spread_check(run: dict, n: int, workers: int) -> dict:
    """Each worker process's share of the N attempts (0 for one that took none), once
    every delivery is known to have gone out once: a run where one was sent twice, or
    attempted by anything but these processes, fails."""
    by_worker = run["attempts_by_worker"]
    shares = {f"workers{i}": by_worker.get(f"workers{i}", 0) for i in range(workers)}
    if run["receiver_requests"] != n or run["duplicates"] or run["attempts"] != n:
        raise ob.BenchError(
            f"{SERVICE_SPREAD}: {run['receiver_requests']} requests and {run['attempts']} "
            f"attempts for {n} deliveries"
        )
    if sum(shares.values()) != n:
        raise ob.BenchError(f"{SERVICE_SPREAD}: attempts by process {by_worker}")
    return shares


def scenario_throughput(ctx: dict) -> dict:
    n, receiver = ctx["events"], ctx["receiver"]
    pipeline = service_pipeline({})
    redis_pipeline = service_pipeline(REDIS_BROKER_ENV)
    spread_pipeline = service_pipeline({}, workers=SPREAD_WORKERS)
    systems: dict[str, list[dict]] = {}

    def add(name: str, run: dict) -> None:
        systems.setdefault(name, []).append(run)
        log(f"  {name}: {run['per_second'] or 0:,.0f}/s")

    def drain(which, *, fresh_publish: bool) -> dict:
        """The service's pipeline (or the floor's) on the published rows, its rate taken
        at the receiver like every other system's."""
        run = ob.run_service(
            receiver,
            n,
            which,
            db_name=ctx["db_name"],
            base_url=ctx["base_url"],
            timeout=ctx["timeout"],
            logs=ctx["logs"],
            py_spy=None,
            fresh_publish=fresh_publish,
        )
        run.pop("timeline", None)
        run["wall_per_second"] = run["per_second"]
        run["per_second"] = receiver_rate(receiver.counts(), n)
        return run

    def client_loop(concurrency: int, *, signed: bool) -> dict:
        loop = ob.run_bare(receiver, n, concurrency, signed=signed)
        loop["wall_per_second"] = loop["per_second"]
        loop["per_second"] = receiver_rate(receiver.counts(), n)
        return loop

    for i in range(ctx["repeat"]):
        log(f"throughput {i + 1}/{ctx['repeat']}, N = {n:,}")
        for concurrency in ob.BARE_CONCURRENCIES:
            add(bare_loop_at(concurrency), client_loop(concurrency, signed=False))
        add(BASELINE_SIGNED, client_loop(SERVICE_CONCURRENCY, signed=True))
        add(BASELINE_SKIP_LOCKED, run_peer(BASELINE_SKIP_LOCKED, "skiplocked.py", [], n, ctx))
        add("service", drain(pipeline, fresh_publish=(i == 0)))
        flush_bench_redis()
        add(SERVICE_REDIS, drain(redis_pipeline, fresh_publish=False))
        spread = drain(spread_pipeline, fresh_publish=False)
        spread["shares"] = spread_check(spread, n, SPREAD_WORKERS)
        add(SERVICE_SPREAD, spread)
        log(f"    attempts by process: {spread['shares']}")
        add(BASELINE_FLOOR, drain(ob.FloorPipeline(workers=pipeline.workers), fresh_publish=False))
        for name, (script, extra) in PEERS.items():
            if name in ctx["skip_peers"]:
                continue
            add(name, run_peer(name, script, extra, n, ctx))

    summary = throughput_summary(systems, n, os.cpu_count() or 1)
    log(f"  {BARE_LOOP}: in flight by repeat {summary['bare_loop']['better_by_repeat']}")
    return {
        "events": n,
        "service_pipeline": {
            "workers": pipeline.workers,
            "batch_size": pipeline.batch_size,
            "worker_concurrency": pipeline.worker_concurrency,
            "env": pipeline.env,
            "redis_broker_env": REDIS_BROKER_ENV,
            "spread_workers": SPREAD_WORKERS,
        },
        **summary,
    }


def bare_loop_repeats(systems: dict[str, list[dict]]) -> list[dict]:
    """Per repeat, the bare loop that repeat's outbound ratios are taken against:
    ``ob.best_bare`` of its runs at each of ob.BARE_CONCURRENCIES (rows ``bare_loop_at``)."""
    by_count = [systems.get(bare_loop_at(c), []) for c in ob.BARE_CONCURRENCIES]
    return [ob.best_bare(list(runs)) for runs in zip(*by_count, strict=False)]


def throughput_summary(systems: dict[str, list[dict]], n: int, cores: int) -> dict:
    """The throughput scenario's figures from its runs (``systems``: each row's runs, one
    a repeat): the bare loop of each repeat (``bare_loop_repeats``, added to ``systems``
    as BARE_LOOP), the medians, every ratio taken within a repeat, the CPU per delivery
    against the bare request, the statements ceiling and the design bound."""
    systems[BARE_LOOP] = bare_loop_repeats(systems)
    med = {name: median(r["per_second"] for r in runs) for name, runs in systems.items()}
    peers = [name for name in PEERS if name in med]

    def ratio_in_run(other: str, of: str = "service") -> float | None:
        return ratio_in_repeats(systems, of, other)

    fastest = max(peers, key=lambda p: med[p] or 0) if peers else None
    repeats = zip(
        systems[BARE_LOOP],
        systems.get(BASELINE_SIGNED, []),
        systems.get("service", []),
        systems.get(BASELINE_FLOOR, []),
        strict=False,
    )
    ceilings, bounds = [], []
    for bare, signed, service, floor in repeats:
        if c := statements_ceiling(bare, [service, floor], n, cores):
            ceilings.append(c)
        if b := design_bound(bare, signed, service, [service, floor], n, cores):
            bounds.append(b)
    ratios = {
        "service_over_bare_loop": ratio_in_run(BARE_LOOP),
        "redis_broker_over_bare_loop": ratio_in_run(BARE_LOOP, of=SERVICE_REDIS),
        "spread_over_bare_loop": ratio_in_run(BARE_LOOP, of=SERVICE_SPREAD),
        f"service_over_{SERVICE_REDIS}": ratio_in_run(SERVICE_REDIS),
        f"service_over_{SERVICE_SPREAD}": ratio_in_run(SERVICE_SPREAD),
        "service_over_skip_locked": ratio_in_run(BASELINE_SKIP_LOCKED),
        "service_over_statements_floor": ratio_in_run(BASELINE_FLOOR),
        "service_over_signed_loop": ratio_in_run(BASELINE_SIGNED),
        "statements_floor_over_bare_loop": ratio_in_run(BARE_LOOP, of=BASELINE_FLOOR),
        "signed_loop_over_bare_loop": ratio_in_run(BARE_LOOP, of=BASELINE_SIGNED),
        # The fastest peer of each repeat, then the service's ratio to it in that repeat.
        "service_over_fastest_peer": over_fastest_peer(systems, peers, "service")
        if peers
        else None,
        **{f"service_over_{p}": ratio_in_run(p) for p in peers},
        **{
            f"service_over_{bare_loop_at(c)}": ratio_in_run(bare_loop_at(c))
            for c in ob.BARE_CONCURRENCIES
        },
    }
    return {
        "bare_loop": {
            "concurrencies": list(ob.BARE_CONCURRENCIES),
            # Per repeat, the requests in flight of the faster run: the baseline of every
            # ratio to the bare loop in that repeat.
            "better_by_repeat": [b["concurrency"] for b in systems[BARE_LOOP]],
            "median_per_second": {str(c): med.get(bare_loop_at(c)) for c in ob.BARE_CONCURRENCIES},
        },
        "cpu_over_bare_loop": cpu_summary(systems, n),
        "median_per_second": med,
        "fastest_peer": fastest,
        "ratios": ratios,
        # Per repeat, then the median of each figure (statements_ceiling).
        "statements_ceiling": {
            "runs": ceilings,
            **{k: median(c[k] for c in ceilings) for k in (ceilings[0] if ceilings else {})},
        },
        "design_bound": {
            "runs": bounds,
            **{k: median(b[k] for b in bounds) for k in (bounds[0] if bounds else {})},
        },
        "targets": {**THROUGHPUT_TARGETS, "cpu_over_bare_loop": CPU_TARGET},
        "meets": {
            k: bool(ratios[k] and ratios[k] >= target) for k, target in THROUGHPUT_TARGETS.items()
        },
        "runs": systems,
    }


def flush_bench_redis() -> None:
    """Empty the bench's Redis database (REDIS_BROKER_ENV's; the peers' too, which flush
    it themselves): a failed run's messages must not reach the next."""
    import redis

    redis.Redis.from_url(REDIS_BROKER_ENV["REDIS_URL"]).flushdb()


# --- Background jobs -----------------------------------------------------------------

# The two workloads of the jobs scenario (bench/peers/common.py): a job that does nothing
# but mark itself done, and a job making the throughput scenario's signed 1 KiB POST.
JOB_WORKLOADS = ("noop", "post")
# Beside the service as shipped: its no-op as a plain function, run in a worker thread;
# and the service with its connections' prepared statements off (the setting
# DATABASE_PREPARE_THRESHOLD=0), which keeps PostgreSQL from switching the batch
# statements to a generic plan (docs/benchmarks.md says what that costs).
SERVICE_SYNC = "service, sync job"
SERVICE_UNPREPARED = "service, DATABASE_PREPARE_THRESHOLD=0"
# Jobs run at once per run_jobs process (one process per core), per workload: the best
# of 16 to 5,000 in runs of N = 20,000 on the machine of docs/benchmarks.md, for async
# jobs that hold no connection. The default, JOBS_CONCURRENCY 16, is for a host's jobs,
# whose plain functions run in a pool of that many threads, each with its own database
# connection.
JOBS_CONCURRENCY = {"noop": 1000, "post": 128}
JOBS_TARGETS = {"service_over_fastest_peer": 4.0, "service_over_skip_locked": 0.5}
# Scenarios written to a results file of their own (bench/results/<stem>.json, .md, .png);
# the others go to results.json.
RESULTS_FILES = {"jobs": "jobs"}


def results_file(scenario: str) -> str:
    return RESULTS_FILES.get(scenario, "results")


def run_service_jobs(
    workload: str, n: int, ctx: dict, *, sync: bool = False, env: dict | None = None
) -> dict:
    """The service's background jobs, measured as the peers are (``common.measure``):
    N jobs enqueued with ``enqueue`` in transactions of 1000 and no worker running, then
    one ``run_jobs`` process per core; the rate from the first to the last arrival."""
    import argparse

    import bench.background_jobs as bench_jobs  # registers the job types
    from bench.peers import common
    from deliveries.jobs.models import Job

    job_type = bench_jobs.NOOP_SYNC if sync else common.TASK_NAMES[workload]
    cores = os.cpu_count() or 1
    concurrency = JOBS_CONCURRENCY[workload]

    def reset() -> None:
        ob.sql(f"TRUNCATE {bench_jobs.queue_table_names()}")

    def enqueue_all(count: int) -> None:
        bench_jobs.enqueue_all(job_type, workload, count)

    worker = [sys.executable, "manage.py", "run_jobs", "--queue", "default"]
    worker += ["--concurrency", str(concurrency)]
    env = pipeline_env(
        ctx["base_url"],
        ctx["db_name"],
        "jobs",
        {
            "JOBS_MODULES": "bench.background_jobs",
            "PEER_RECEIVER_URL": ctx["receiver"].url(""),
            **(env or {}),
        },
    )
    args = argparse.Namespace(
        events=n,
        db_url=ob.with_db(ctx["base_url"], ctx["db_name"]),
        receiver=ctx["receiver"].url(""),
        timeout=ctx["timeout"],
        logs=ctx["logs"],
        workload=workload,
    )
    busy0, total0 = ob.machine_cpu()
    try:
        out = common.measure(
            "service-jobs",
            args,
            reset=reset,
            enqueue=enqueue_all,
            workers=[worker] * cores,
            env=env,
            settings={
                "processes": cores,
                "concurrency": concurrency,
                "job_type": job_type,
                "env": env or {},
            },
        )
    except SystemExit as exc:  # measure's way of saying the run failed
        raise ob.BenchError(f"service jobs: {exc}") from None
    busy1, total1 = ob.machine_cpu()
    states = dict(ob.sql(f"SELECT state, count(*) FROM {Job._meta.db_table} GROUP BY state"))
    if states.get("done", 0) != n:
        raise ob.BenchError(f"service jobs: {n} enqueued, states {states}")
    out["states"] = states
    out["machine_cpu_busy"] = round((busy1 - busy0) / max(1, total1 - total0), 3)
    return out


def jobs_summary(runs: dict[str, dict[str, list[dict]]], peers: list[str]) -> dict:
    """Per workload: each system's median rate, the fastest peer, and the service's
    ratios (to each peer, to the fastest peer of each repeat, to bare SKIP LOCKED), each
    taken within a repeat, against the targets."""
    out = {}
    for workload, systems in runs.items():
        med = {name: median(r["per_second"] for r in rs) for name, rs in systems.items()}
        present = [p for p in peers if p in systems]
        ratios = {
            "service_over_fastest_peer": over_fastest_peer(systems, present, "service")
            if present
            else None,
            "service_over_skip_locked": ratio_in_repeats(systems, "service", BASELINE_SKIP_LOCKED),
            **{f"service_over_{p}": ratio_in_repeats(systems, "service", p) for p in present},
        }
        for variant, key in ((SERVICE_SYNC, "sync"), (SERVICE_UNPREPARED, "unprepared")):
            if variant in systems:
                ratios[f"{key}_over_service"] = ratio_in_repeats(systems, variant, "service")
        out[workload] = {
            "median_per_second": med,
            "fastest_peer": max(present, key=lambda p: med[p] or 0) if present else None,
            "ratios": ratios,
            "meets": {
                k: bool(ratios[k] is not None and ratios[k] >= target)
                for k, target in JOBS_TARGETS.items()
            },
            "runs": systems,
        }
    return out


def scenario_jobs(ctx: dict) -> dict:
    n = ctx["jobs_events"]
    runs: dict[str, dict[str, list[dict]]] = {w: {} for w in JOB_WORKLOADS}

    def add(workload: str, name: str, run: dict) -> None:
        runs[workload].setdefault(name, []).append(run)
        log(f"  {workload} {name}: {run['per_second'] or 0:,.0f}/s")

    for i in range(ctx["repeat"]):
        for workload in JOB_WORKLOADS:
            log(f"jobs {i + 1}/{ctx['repeat']}, {workload}, N = {n:,}")
            flags = ["--workload", workload]
            add(
                workload,
                BASELINE_SKIP_LOCKED,
                run_peer(BASELINE_SKIP_LOCKED, "skiplocked.py", flags, n, ctx),
            )
            add(workload, "service", run_service_jobs(workload, n, ctx))
            if workload == "noop":
                add(workload, SERVICE_SYNC, run_service_jobs(workload, n, ctx, sync=True))
            unprepared = {"DATABASE_PREPARE_THRESHOLD": "0"}
            add(workload, SERVICE_UNPREPARED, run_service_jobs(workload, n, ctx, env=unprepared))
            for name, (script, extra) in PEERS.items():
                if name not in ctx["skip_peers"]:
                    add(workload, name, run_peer(name, script, [*extra, *flags], n, ctx))
    return {
        "events": n,
        "service": {
            "processes": os.cpu_count() or 1,
            "concurrency": JOBS_CONCURRENCY,
            "command": "manage.py run_jobs --queue default --concurrency C",
        },
        "targets": JOBS_TARGETS,
        "workloads": jobs_summary(runs, list(PEERS)),
    }


# --- Latency -------------------------------------------------------------------------


def scenario_latency(ctx: dict) -> dict:
    receiver = ctx["receiver"]
    from deliveries.models import Tenant
    from deliveries.services import endpoint_create

    pipeline = default_pipeline({})
    out: dict = {"rates": ctx["rates"], "seconds": ctx["latency_seconds"], "runs": {}}
    for i in range(ctx["repeat"]):
        ob.truncate()
        tenant = Tenant.objects.create(name="bench-latency")
        endpoint_create(tenant=tenant, url=receiver.url("/hook"))
        procs = start_pipeline(pipeline, ctx["base_url"], ctx["db_name"], ctx["logs"])
        try:
            for rate in ctx["rates"]:
                log(f"latency {i + 1}/{ctx['repeat']}: {rate}/s for {ctx['latency_seconds']} s")
                run = latency_run(ctx, tenant.id, rate, procs)
                out["runs"].setdefault(str(rate), []).append(run)
                log(
                    f"  p50 {run['p50_ms']} ms, p99 {run['p99_ms']} ms, max {run['max_ms']} ms; "
                    f"published {run['published_per_second']}/s, lost {run['not_arrived']}"
                )
        finally:
            ob.stop([p for _, p in procs])
    out["median"] = {
        rate: {
            k: median(r[k] for r in runs)
            for k in ("p50_ms", "p90_ms", "p99_ms", "max_ms", "published_per_second")
        }
        for rate, runs in out["runs"].items()
    }
    top = out["median"].get("1000") or {}
    out["target"] = {"rate": 1000, "p99_ms": 1000}
    out["meets"] = bool(top.get("p99_ms") is not None and top["p99_ms"] < 1000)
    return out


def latency_run(ctx: dict, tenant_id, rate: int, procs: list) -> dict:
    receiver = ctx["receiver"]
    receiver.reset()
    outputs = []
    publishers = []
    count = int(rate * ctx["latency_seconds"])
    start_at = time.time() + 1.0
    for k in range(ctx["publishers"]):
        path = ctx["logs"] / f"publisher-{rate}-{k}.json"
        outputs.append(path)
        argv = [
            sys.executable,
            str(BENCH / "latency_publisher.py"),
            "--tenant",
            str(tenant_id),
            "--rate",
            str(rate),
            "--count",
            str(count),
            "--start-at",
            repr(start_at),
            "--slice",
            f"{k}/{ctx['publishers']}",
            "--output",
            str(path),
        ]
        env = pipeline_env(ctx["base_url"], ctx["db_name"], f"publisher{k}", {})
        publishers.append(ob.spawn(argv, env=env, log=ctx["logs"] / f"publisher-{k}.log"))
    deadline = time.time() + ctx["latency_seconds"] + 120
    for p in publishers:
        p.wait(max(1, deadline - time.time()))
        if p.returncode != 0:
            raise ob.BenchError(f"publisher exited {p.returncode}: see {ctx['logs']}")
    scheduled: dict[str, float] = {}
    published_until = 0.0
    for path in outputs:
        data = json.loads(path.read_text())
        scheduled.update(data["scheduled"])
        published_until = max(published_until, data["finished_at"])
    # Every event is one delivery here (one endpoint); webhook-id is the delivery id.
    by_delivery = {
        str(d): scheduled[str(e)]
        for d, e in ob.sql(
            "SELECT id, event_id FROM deliveries_delivery WHERE event_id = ANY(%s::uuid[])",
            [list(scheduled)],
        )
    }
    while time.time() < deadline and receiver.counts()["distinct_webhook_ids"] < len(by_delivery):
        for role, p in procs:
            if p.poll() is not None:
                raise ob.BenchError(f"{role} exited during the latency run")
        time.sleep(0.2)
    import urllib.request

    with urllib.request.urlopen(receiver.url("/arrivals"), timeout=30) as r:  # noqa: S310
        arrivals = json.loads(r.read())
    lat = sorted((arrivals[d] - t) * 1000 for d, t in by_delivery.items() if d in arrivals)
    first = min(scheduled.values()) if scheduled else start_at
    return {
        "events": count,
        "published": len(scheduled),
        "published_per_second": round(len(scheduled) / max(1e-9, published_until - first), 1),
        "not_arrived": len(by_delivery) - len(lat),
        "p50_ms": round(percentile(lat, 0.50), 1) if lat else None,
        "p90_ms": round(percentile(lat, 0.90), 1) if lat else None,
        "p99_ms": round(percentile(lat, 0.99), 1) if lat else None,
        "max_ms": round(lat[-1], 1) if lat else None,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


# --- Inbound -------------------------------------------------------------------------


def inbound_source():
    """The bench's Stripe-scheme source, created on first use (the inbound tables are
    emptied between runs, the sources table is not)."""
    from ingest.models import Source
    from ingest.sources import source_create

    return Source.objects.filter(slug=INBOUND_SLUG).first() or source_create(
        slug=INBOUND_SLUG, scheme="stripe", secrets=[INBOUND_SECRET]
    )


def scenario_inbound(ctx: dict) -> dict:
    n = ctx["inbound_events"]
    pipeline = default_pipeline({"INGEST_HANDLER_MODULES": "bench.inbound_noop"})
    # The shipped gunicorn config (cores + 1 processes of 8 threads) unless
    # --gunicorn-workers says otherwise.
    workers = ctx["gunicorn_workers"] or (os.cpu_count() or 1) + 1
    out: dict = {"events": n, "gunicorn_workers": workers, "runs": []}
    for i in range(ctx["repeat"]):
        log(f"inbound {i + 1}/{ctx['repeat']}, N = {n:,}")
        ob.truncate_inbound()
        inbound_source()
        port = ob_free_port()
        env = pipeline_env(
            ctx["base_url"],
            ctx["db_name"],
            "gunicorn",
            {
                "GUNICORN_BIND": f"127.0.0.1:{port}",
                "GUNICORN_WORKERS": str(workers),
                "DEBUG": "0",
                "ALLOWED_HOSTS": "127.0.0.1",
            },
        )
        web = ob.spawn(
            [sys.executable, "-m", "gunicorn", "-c", "project/gunicorn.conf.py", "project.wsgi"],
            env=env,
            log=ctx["logs"] / "gunicorn.log",
        )
        procs = []
        try:
            wait_http(f"http://127.0.0.1:{port}/healthz", web)
            procs = start_pipeline(pipeline, ctx["base_url"], ctx["db_name"], ctx["logs"])
            t0 = time.perf_counter()
            ack = asyncio.run(inbound_load(f"http://127.0.0.1:{port}/ingest/{INBOUND_SLUG}/", n))
            t_ack = time.perf_counter() - t0
            states = wait_inbound_processed(n, time.perf_counter() + ctx["timeout"], 0.1)
            t_done = time.perf_counter() - t0
        finally:
            ob.stop([p for _, p in procs] + [web])
        if ack["statuses"] != {202: n} and ack["statuses"] != {200: n}:
            raise ob.BenchError(f"inbound: answers {ack['statuses']}")
        run = {
            "acknowledged_per_second": round(n / t_ack, 1),
            "processed_per_second": round(n / t_done, 1),
            "ack_seconds": round(t_ack, 3),
            "processed_seconds": round(t_done, 3),
            "statuses": ack["statuses"],
            "states": states,
            **inbound_backlog(ctx, pipeline),
        }
        out["runs"].append(run)
        log(
            f"  acknowledged {run['acknowledged_per_second']:,.0f}/s, "
            f"processed {run['processed_per_second']:,.0f}/s; "
            f"a stored backlog of {ctx['inbound_backlog']:,}: "
            f"{run['backlog_processed_per_second']:,.0f}/s"
        )
    out["backlog_events"] = ctx["inbound_backlog"]
    out["median"] = {
        k: median(r[k] for r in out["runs"])
        for k in ("acknowledged_per_second", "processed_per_second", "backlog_processed_per_second")
    }
    out["target"] = {"backlog_processed_per_second": INBOUND_TARGET}
    out["meets"] = bool((out["median"]["backlog_processed_per_second"] or 0) >= INBOUND_TARGET)
    return out


def store_backlog(n: int) -> None:
    """Empty the inbound tables and store ``n`` events of the bench source, each of an
    entity of its own, with their processing jobs (outbox rows), in one
    ``inbound_store_many``: the backlog a poller's page or a burst received by many web
    processes leaves."""
    from datetime import timedelta

    from django.db import transaction
    from django.utils import timezone

    from ingest.receiving import NewEvent, inbound_store_many

    ob.truncate_inbound()
    source = inbound_source()
    now = timezone.now()
    events = [
        NewEvent(
            event_id=f"evt_{i}",
            event_type="invoice.paid",
            entity_id=f"cus_{i}",
            occurred_at=now + timedelta(milliseconds=i),
            body=json.dumps(
                {"id": f"evt_{i}", "type": "invoice.paid", "data": {"object": {"id": f"cus_{i}"}}}
            ).encode(),
        )
        for i in range(n)
    ]
    with transaction.atomic():
        inbound_store_many(source=source, events=events)


def inbound_backlog(ctx: dict, pipeline) -> dict:
    """Processing's own capacity: a stored backlog (a distinct entity per event, so each
    takes and gives back its lock and version row), then the pipeline started; the rate
    is the events over the time from the first handler run's start to the last commit, as
    throughput's is over the receiver's first-to-last arrival. Acknowledgement is the
    receive view's (above)."""
    n = ctx["inbound_backlog"]
    store_backlog(n)
    procs = start_pipeline(pipeline, ctx["base_url"], ctx["db_name"], ctx["logs"])
    try:
        wait_inbound_processed(n, time.perf_counter() + ctx["timeout"], 0.05)
    finally:
        ob.stop([p for _, p in procs])
    # From the first handler run's start to the last commit (a batch's events share one
    # processed_at, the time of its commit).
    [(first, last)] = ob.sql(
        "SELECT (SELECT min(started_at) FROM ingest_handlerrun),"
        " (SELECT max(processed_at) FROM ingest_inboundevent)"
    )
    span = (last - first).total_seconds()
    runs = ob.sql("SELECT count(*), count(DISTINCT event_id) FROM ingest_handlerrun")[0]
    if runs != (n, n):
        raise ob.BenchError(f"inbound backlog: {runs[0]} handler runs for {runs[1]} events")
    return {
        "backlog_processed_per_second": round(n / span, 1) if span > 0 else None,
        "backlog_processed_seconds": round(span, 3),
    }


# Whether any inbound event is still to be processed: two probes of partial indexes
# (inbound_in_flight, inbound_due), so that watching for the end costs the pipeline
# nothing measurable. Counting every event by state instead took up to 10 ms a poll at
# 20,000 events, 20 times a second, on the cores the pipeline runs on.
_INBOUND_UNFINISHED_SQL = """
SELECT EXISTS (SELECT 1 FROM ingest_inboundevent WHERE state IN ('enqueued', 'processing'))
    OR EXISTS (SELECT 1 FROM ingest_inboundevent WHERE state = 'pending')
"""


def inbound_states() -> dict[str, int]:
    return dict(ob.sql("SELECT state, count(*) FROM ingest_inboundevent GROUP BY state"))


def wait_inbound_processed(n: int, deadline: float, poll: float) -> dict[str, int]:
    """Until no inbound event is left to process; then all ``n`` must be processed (or
    skipped), none failed or dead. Returns the count of events by state."""
    while ob.sql(_INBOUND_UNFINISHED_SQL)[0][0]:
        if time.perf_counter() > deadline:
            raise ob.BenchError(f"inbound: not processed in time: {inbound_states()}")
        time.sleep(poll)
    states = inbound_states()
    if states.get("processed", 0) + states.get("skipped", 0) != n:
        raise ob.BenchError(f"inbound: {n} events, states {states}")
    return states


def ob_free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc) -> None:
    import urllib.error
    import urllib.request

    deadline = time.time() + 60
    while time.time() < deadline:
        if proc.poll() is not None:
            raise ob.BenchError(f"gunicorn exited {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310
                r.read()
                return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.2)
    raise ob.BenchError("gunicorn did not answer within 60 s")


async def inbound_load(url: str, n: int, concurrency: int = 32) -> dict:
    import aiohttp

    sys.path.insert(0, str(BENCH))
    from ingest_load import signed_requests

    statuses: dict[int, int] = {}
    requests = signed_requests(0, n, INBOUND_SECRET)
    it = iter(requests)

    async def sender(session):
        for body, headers in it:
            async with session.post(url, data=body, headers=headers) as r:
                await r.read()
                statuses[r.status] = statuses.get(r.status, 0) + 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        await asyncio.gather(*(sender(s) for _ in range(concurrency)))
    return {"statuses": statuses}


# --- Growth --------------------------------------------------------------------------

# Ids in creation order, as the product's time-ordered (version 7) ids are: each row's
# primary key entry goes to the right-hand end of its index, as publishing leaves it.
# Random ids scatter those inserts over the whole index, which costs more the larger it
# grows (300,000 rows seeded in 50 s that way, 36 s in order).
SEED_SQL = """
WITH ep AS (SELECT %(eps)s::uuid[] AS eps, %(tens)s::uuid[] AS tens)
INSERT INTO deliveries_event (id, tenant_id, event_type, payload_version, entity_id, body,
                              priority, idempotency_key, request_hash, created_at)
SELECT ('e0000000-0000-7000-8000-' || lpad(to_hex(g), 12, '0'))::uuid,
       tens[1 + g %% cardinality(eps)], 'bench.event', 1, '',
       convert_to('{"seq":' || g || '}', 'UTF8'), 0, NULL, '', now() - interval '1 hour'
FROM generate_series(0, %(n)s - 1) g, ep
"""
SEED_DELIVERIES_SQL = """
WITH ep AS (SELECT %(eps)s::uuid[] AS eps, %(tens)s::uuid[] AS tens)
INSERT INTO deliveries_delivery (id, event_id, endpoint_id, tenant_id, state, priority,
    next_attempt_at, attempt_count, policy_attempts, dispatch_count, lease_expiries,
    last_outcome, last_error, created_at, updated_at)
SELECT ('d0000000-0000-7000-8000-' || lpad(to_hex(g), 12, '0'))::uuid,
       ('e0000000-0000-7000-8000-' || lpad(to_hex(g), 12, '0'))::uuid,
       eps[1 + g %% cardinality(eps)],
       tens[1 + g %% cardinality(eps)], 'pending', 0,
       now() - interval '1 hour' + interval '1 ms' * (g %% 3600000), 0, 0, 0, 0, '', '',
       now() - interval '1 hour', now() - interval '1 hour'
FROM generate_series(0, %(n)s - 1) g, ep
"""
# One delivery of each endpoint in flight (leased for an hour).
HOLD_ONE_PER_ENDPOINT_SQL = """
UPDATE deliveries_delivery SET state = 'leased', lease_until = now() + interval '1 hour',
    lease_token = gen_random_uuid()
WHERE id IN (SELECT DISTINCT ON (endpoint_id) id FROM deliveries_delivery
             WHERE state = 'pending' ORDER BY endpoint_id, id)
"""
RESET_SQL = [
    "TRUNCATE deliveries_outbox, deliveries_queuemessage, deliveries_looprun, "
    "deliveries_endpointthrottle",
    "UPDATE deliveries_delivery SET state = 'pending', enqueued_at = NULL, lease_until = NULL, "
    "lease_token = NULL, dispatch_count = 0, attempt_count = 0 WHERE state <> 'pending'",
]


def scenario_growth(ctx: dict) -> dict:
    from deliveries.jobs import brokers as broker
    from deliveries.models import Tenant
    from deliveries.scheduler import scheduler_tick
    from deliveries.services import endpoint_create
    from deliveries.worker import _take

    out: dict = {"sizes": ctx["growth_sizes"], "runs": {}}
    for size in ctx["growth_sizes"]:
        log(f"growth: seeding {size:,} due deliveries")
        ob.truncate()
        eps, tens = [], []
        for t in range(10):
            tenant = Tenant.objects.create(name=f"growth-{t}")
            for _ in range(10):
                eps.append(endpoint_create(tenant=tenant, url=ctx["receiver"].url("/hook"))[0].id)
                tens.append(tenant.id)
        t0 = time.perf_counter()
        params = {"eps": eps, "tens": tens, "n": size}
        ob.sql(SEED_SQL, params)
        ob.sql(SEED_DELIVERIES_SQL, params)
        ob.sql("VACUUM ANALYZE deliveries_delivery")
        ob.sql("ANALYZE deliveries_event")
        seeded = time.perf_counter() - t0
        passes, claims, rss, once_wall = [], [], [], []
        b = broker.get_broker()
        for _ in range(ctx["growth_passes"]):
            for q in RESET_SQL:
                ob.sql(q)
            t = time.perf_counter()
            tick = scheduler_tick()
            passes.append((time.perf_counter() - t) * 1000)
            admitted = tick.counts["enqueued"]
            t = time.perf_counter()
            taken = _take(b, 200, 60.0)
            claims.append((time.perf_counter() - t) * 1000)
            if not admitted or not taken.claimed or not taken.claimed.leased:
                raise ob.BenchError(f"growth: nothing admitted or claimed ({tick.counts})")
        for _ in range(ctx["growth_passes"]):
            for q in RESET_SQL:
                ob.sql(q)
            env = pipeline_env(ctx["base_url"], ctx["db_name"], "scheduler-once", {})
            t = time.perf_counter()
            # Its own peak, not this process's (bench/peak_rss.py says why).
            code, peak_mib, _, err = peak_rss.run(
                [sys.executable, "manage.py", "run_scheduler", "--once"],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            once_wall.append((time.perf_counter() - t) * 1000)
            if code != 0:
                raise ob.BenchError(f"run_scheduler --once: {err[-2000:]}")
            rss.append(peak_mib)
        # Every endpoint at its ceiling while the global one is far off: each due row is
        # held back, and a pass has to find that out (one hot endpoint with a backlog
        # is the common case of this: a bulk publish).
        for q in RESET_SQL:
            ob.sql(q)
        ob.sql("UPDATE deliveries_endpoint SET max_concurrency = 1")
        ob.sql(HOLD_ONE_PER_ENDPOINT_SQL)
        all_full = []
        for _ in range(ctx["growth_passes"]):
            t = time.perf_counter()
            tick = scheduler_tick()
            all_full.append((time.perf_counter() - t) * 1000)
            if tick.counts["enqueued"]:
                raise ob.BenchError(f"growth: admitted past the ceilings ({tick.counts})")
        ob.sql("UPDATE deliveries_endpoint SET max_concurrency = NULL")
        run = {
            "due_rows": size,
            "seed_seconds": round(seeded, 1),
            "scheduler_pass_all_full_ms": [round(x, 1) for x in all_full],
            "scheduler_pass_ms": [round(x, 1) for x in passes],
            "claim_batch_ms": [round(x, 2) for x in claims],
            "scheduler_once_peak_rss_mib": [round(x, 1) for x in rss],
            "scheduler_once_wall_ms": [round(x) for x in once_wall],
            "median": {
                "scheduler_pass_ms": round(median(passes), 1),
                "scheduler_pass_all_full_ms": round(median(all_full), 1),
                "claim_batch_ms": round(median(claims), 2),
                "scheduler_once_peak_rss_mib": round(median(rss), 1),
                "scheduler_once_wall_ms": round(median(once_wall)),
            },
        }
        out["runs"][str(size)] = run
        log(f"  {json.dumps(run['median'])}")
    small, large = (out["runs"][str(s)]["median"] for s in (min(out["sizes"]), max(out["sizes"])))
    out["ratios"] = {k: round(large[k] / small[k], 2) if small[k] else None for k in small}
    out["targets"] = {
        "scheduler_pass_ms": 1.5,
        "scheduler_pass_all_full_ms": 1.5,
        "claim_batch_ms": 1.5,
        "scheduler_once_peak_rss_mib": 1.2,
    }
    out["meets"] = {
        k: bool(out["ratios"][k] is not None and out["ratios"][k] <= v)
        for k, v in out["targets"].items()
    }
    return out


# --- Report --------------------------------------------------------------------------


def admin_reference() -> dict | None:
    path = RESULTS / "admin_log.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    pages = data.get("pages", [])
    return {
        "source": "bench/results/admin_log.json (bench/admin_log.py)",
        "measured_at": data.get("measured_at"),
        "deliveries": data.get("data", {}).get("deliveries"),
        "budget_ms": data.get("budget_ms"),
        "pages": len(pages),
        "over_budget": [p["name"] for p in pages if p["median_ms"] > data.get("budget_ms", 200)],
        "slowest": max(((p["name"], p["median_ms"]) for p in pages), key=lambda x: x[1])
        if pages
        else None,
    }


def fmt(x, digits=0) -> str:
    if x is None:
        return "n/a"
    return f"{x:,.{digits}f}"


def python_speed(result: dict) -> str:
    """The header's note of the machine's Python speed ("" for results made before it
    was recorded)."""
    seconds = result.get("python_loop_seconds")
    return f"Python's 10-million-addition loop {seconds:.2f} s, " if seconds else ""


def markdown(result: dict) -> str:
    lines = [
        f"# Benchmark results ({result['mode']})",
        "",
        f"{result['measured_at']}, {result['cpu_count']} CPUs ({result['cpu_model']}), "
        f"{python_speed(result)}load average at start {result['load_average_at_start']}, at end "
        f"{result['load_average_at_end']}; Python {result['versions']['python']}, Django "
        f"{result['versions']['django']}, PostgreSQL {result['versions']['postgres']}, "
        f"Redis {result['versions'].get('redis_server', '?')}. Medians of each scenario's "
        "repeats; ratios taken within each repeat.",
        "",
    ]
    tp = result["scenarios"].get("throughput")
    if tp:
        n = tp["events"]
        bare = tp["median_per_second"][BARE_LOOP]
        service = tp["median_per_second"]["service"]
        lines += [
            f"## Outbound throughput (N = {n:,}, deliveries/s from the receiver's first to "
            "last arrival)",
            "",
            "| system | deliveries/s | service ÷ this | versions / settings |",
            "| --- | ---: | ---: | --- |",
        ]
        for name, ps in sorted(tp["median_per_second"].items(), key=lambda kv: -(kv[1] or 0)):
            if name == "service":
                ratio = ""
            else:
                key = {
                    BARE_LOOP: "service_over_bare_loop",
                    BASELINE_SKIP_LOCKED: "service_over_skip_locked",
                    BASELINE_FLOOR: "service_over_statements_floor",
                    BASELINE_SIGNED: "service_over_signed_loop",
                }.get(name, f"service_over_{name}")
                ratio = fmt(tp["ratios"].get(key), 2)
            lines.append(
                f"| {'**service**' if name == 'service' else name} | {fmt(ps)} "
                f"| {ratio} | {result['versions'].get(name, '')} |"
            )
        lines += [
            "",
            f"Service ÷ bare loop: **{fmt(tp['ratios']['service_over_bare_loop'], 2)}** "
            f"(target ≥ {THROUGHPUT_TARGETS['service_over_bare_loop']:g}: "
            f"{'met' if _meets(tp, 'service_over_bare_loop') else 'NOT met'}); "
            f"service ÷ fastest peer ({tp['fastest_peer']}): "
            f"**{fmt(tp['ratios']['service_over_fastest_peer'], 2)}** "
            f"(target ≥ {THROUGHPUT_TARGETS['service_over_fastest_peer']:g}: "
            f"{'met' if _meets(tp, 'service_over_fastest_peer') else 'NOT met'}). "
            f"Service: {fmt(service)}/s, bare loop {fmt(bare)}/s.",
            "",
            *bare_loop_markdown(tp),
        ]
        floor_ratio = tp["ratios"].get("statements_floor_over_bare_loop")
        if floor_ratio is not None:
            lines += [
                f"Statements floor ÷ bare loop: **{fmt(floor_ratio, 2)}**: the service's own "
                "SQL driven by the least Python that can run it (bench/floor.py), so about the "
                "most these statements allow with Python driving them.",
                "",
            ]
        ceiling = tp.get("statements_ceiling") or {}
        if ceiling.get("over_bare_loop") is not None:
            lines += [
                f"CPU ceiling of these statements: **{fmt(ceiling['over_bare_loop'], 2)}** of "
                f"the bare loop ({fmt(ceiling['per_second'])}/s). A delivery costs at least "
                f"the bare loop's CPU per request ({fmt(ceiling['bare_request_cpu_us'])} µs: "
                "its client and the receiver) plus PostgreSQL's CPU per delivery, the "
                f"lesser of the service's run and the floor's ({fmt(ceiling['postgres_cpu_us'])} "
                "µs); "
                f"{result['cpu_count']} cores busy all the time deliver no more than that "
                "(nothing charged for any other Python or the kernel).",
                "",
            ]
        bound = tp.get("design_bound") or {}
        if bound.get("over_bare_loop") is not None:
            lines += [
                f"CPU bound of the design: **{fmt(bound['over_bare_loop'], 2)}** of the bare "
                f"loop ({fmt(bound['per_second'])}/s). The ceiling above with the request "
                "as the worker sends it, signed and through the egress module (the signed "
                f"loop's CPU per request, {fmt(bound['signed_request_cpu_us'])} µs with the "
                "receiver's), and the design's scheduler and relay processes "
                f"({fmt(bound['scheduler_relay_cpu_us'])} µs per delivery in the service's "
                f"run) charged too: {result['cpu_count']} cores busy all the time, nothing "
                "for the workers' own Python or the kernel. The service cannot pass it.",
                "",
            ]
        lines += throughput_variants_markdown(tp)
    lat = result["scenarios"].get("latency")
    if lat:
        lines += [
            "## Publish-to-first-attempt latency (open model, from the scheduled time)",
            "",
            "| rate/s | published/s | p50 ms | p90 ms | p99 ms | max ms |",
            "| ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for rate, m in lat["median"].items():
            lines.append(
                f"| {int(rate):,} | {fmt(m['published_per_second'])} | {fmt(m['p50_ms'], 1)} | "
                f"{fmt(m['p90_ms'], 1)} | {fmt(m['p99_ms'], 1)} | {fmt(m['max_ms'], 1)} |"
            )
        lines += ["", f"Target p99 < 1 s at 1,000/s: {'met' if lat['meets'] else 'NOT met'}.", ""]
    inb = result["scenarios"].get("inbound")
    if inb:
        backlog_rate = inb["median"].get("backlog_processed_per_second") or 0
        m = inb["median"]
        lines += [
            f"## Inbound, no-op handler (N = {inb['events']:,}, gunicorn "
            f"{inb['gunicorn_workers']} processes)",
            "",
            "| acknowledged/s | processed/s (from the first request to the last processed) "
            f"| processed/s, a stored backlog of {inb.get('backlog_events', 0):,} |",
            "| ---: | ---: | ---: |",
            f"| {fmt(m['acknowledged_per_second'])} | {fmt(m['processed_per_second'])} "
            f"| {fmt(m.get('backlog_processed_per_second'))} |",
            "",
            f"Target ≥ {INBOUND_TARGET:,} processed/s (the backlog's rate; received and processed "
            "together are bound by the receive view's rate): "
            f"{'met' if backlog_rate >= INBOUND_TARGET else 'NOT met'}.",
            "",
        ]
    gr = result["scenarios"].get("growth")
    if gr:
        small, large = min(gr["sizes"]), max(gr["sizes"])
        a, b = gr["runs"][str(small)]["median"], gr["runs"][str(large)]["median"]
        lines += [
            f"## Growth: {small:,} vs {large:,} due deliveries",
            "",
            f"| measure | {small:,} | {large:,} | ratio | target |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for key, label in (
            ("scheduler_pass_ms", "one scheduler pass (ms)"),
            ("scheduler_pass_all_full_ms", "one scheduler pass, every endpoint full (ms)"),
            ("claim_batch_ms", "one worker claim batch of 200 (ms)"),
            ("scheduler_once_peak_rss_mib", "`run_scheduler --once` peak RSS (MiB)"),
            ("scheduler_once_wall_ms", "`run_scheduler --once` wall (ms)"),
        ):
            target = gr["targets"].get(key)
            verdict = ("≤ " + str(target) + (" ✓" if gr["meets"][key] else " ✗")) if target else ""
            lines.append(
                f"| {label} | {fmt(a[key], 1)} | {fmt(b[key], 1)} | "
                f"{fmt(gr['ratios'][key], 2)} | {verdict} |"
            )
        lines.append("")
    if result["scenarios"].get("jobs"):
        lines += jobs_markdown(result["scenarios"]["jobs"], result["versions"])
    headings = {
        "## Outbound": "throughput",
        "## Publish": "latency",
        "## Inbound": "inbound",
        "## Growth": "growth",
        "## Background jobs": "jobs",
    }
    for i, line in enumerate(list(lines)):
        key = next((k for p, k in headings.items() if line.startswith(p)), None)
        when = result["scenarios"].get(key, {}).get("measured") if key else None
        if when:
            lines[i] = (
                f"{line}\n\nMeasured {when['at']}, "
                f"{when.get('runs', str(when['repeat']) + ' repeat(s)')}; load average "
                f"{when['load_average_before']} before, {when['load_average_after']} after."
            )
    adm = result.get("admin_reference")
    if adm:
        lines += [
            "## The delivery log's admin at 1,000,000 deliveries (reference)",
            "",
            f"From {adm['source']}, measured {adm['measured_at']}: {adm['pages']} pages, budget "
            f"{adm['budget_ms']:.0f} ms; over budget: {', '.join(adm['over_budget']) or 'none'}"
            f"; slowest: {adm['slowest'][0]} {adm['slowest'][1]:.0f} ms.",
            "",
        ]
    return "\n".join(lines)


def bare_loop_markdown(tp: dict) -> list[str]:
    """Which count of requests in flight made each repeat's bare loop, and each count's
    median rate (nothing for results recorded when the loop ran at one count)."""
    loop = tp.get("bare_loop")
    if not loop:
        return []
    counts = " and ".join(str(c) for c in loop["concurrencies"])
    by_repeat = ", ".join(str(c) for c in loop["better_by_repeat"])
    rates = ", ".join(f"{fmt(r)}/s at {c}" for c, r in loop["median_per_second"].items())
    return [
        f"Bare loop: the faster of {counts} requests in flight in each repeat, the baseline "
        "of every ratio to the bare loop and of the CPU per request in that repeat. The "
        f"faster by repeat: {by_repeat} in flight; medians {rates}.",
        "",
    ]


def throughput_variants_markdown(tp: dict) -> list[str]:
    """The Redis broker's and the spread workers' lines, and the CPU per delivery's ratio
    (none for results recorded before they were measured)."""
    lines = []
    ratios, runs = tp["ratios"], tp["runs"]
    if ratios.get("redis_broker_over_bare_loop") is not None:
        lines += [
            f"Service with the Redis broker ÷ bare loop: "
            f"**{fmt(ratios['redis_broker_over_bare_loop'], 2)}** (the database broker's "
            f"{fmt(ratios['service_over_bare_loop'], 2)}); the relay publishing to Redis, "
            "the workers taking their batches from it.",
            "",
        ]
    spread = runs.get(SERVICE_SPREAD) or []
    if spread and ratios.get("spread_over_bare_loop") is not None:
        shares = "; ".join(
            " / ".join(f"{c:,}" for c in r["shares"].values()) for r in spread if r.get("shares")
        )
        lines += [
            f"{SPREAD_WORKERS} worker processes, nothing but the database between them: "
            f"**{fmt(ratios['spread_over_bare_loop'], 2)}** of the bare loop. Deliveries "
            f"each process sent (its attempt rows, by repeat): {shares}; in every repeat "
            f"the receiver counted {tp['events']:,} requests with {tp['events']:,} distinct "
            "webhook-ids: none sent twice.",
            "",
        ]
    # Results recorded before the figure was reported hold what it is computed from.
    cpu = tp.get("cpu_over_bare_loop") or cpu_summary(runs, tp["events"])
    if cpu.get("ratio") is not None:
        each = ", ".join(fmt(c["ratio"], 2) for c in cpu["runs"])
        verdict = "met" if cpu["meets"] else "NOT met"
        lines += [
            f"CPU per delivery ÷ the bare loop's CPU per request: **{fmt(cpu['ratio'], 2)}** "
            f"(repeats {each}; target ≤ {CPU_TARGET}: {verdict}): "
            f"{fmt(cpu['service_cpu_us'])} µs per delivery in every process (the "
            f"pipeline's, the receiver, PostgreSQL's) against "
            f"{fmt(cpu['bare_request_cpu_us'])} µs per request (client and receiver).",
            "",
        ]
    return lines


def cpu_per_job_us(runs: list[dict], key: str) -> float | None:
    """The median over the repeats of a steady CPU figure of a jobs run (from the first
    arrival on, ``common.measure``), in µs per job; None where no run has the figure
    (results recorded before it was measured)."""
    return median(
        [r[key] * 1e6 / r["steady_jobs"] for r in runs if r.get("steady_jobs") and key in r]
    )


def jobs_markdown(jb: dict, versions: dict) -> list[str]:
    """The jobs scenario's table (both workloads, each system) and its ratios."""
    noop, post = jb["workloads"]["noop"], jb["workloads"]["post"]
    service = jb["service"]
    settings = {
        "service": f"{service['processes']} run_jobs, --concurrency "
        + " / ".join(f"{c} ({w})" for w, c in service["concurrency"].items())
        + ", async jobs",
        SERVICE_SYNC: "the no-op as a plain function, in a worker thread",
        SERVICE_UNPREPARED: "the service with prepared statements off: no generic plans",
    }
    lines = [
        f"## Background jobs (N = {jb['events']:,} per run; jobs/s from the first to the last "
        "arrival)",
        "",
        "| system | no-op jobs/s | service ÷ this | CPU µs per no-op job, workers / PostgreSQL "
        "| one-POST jobs/s | service ÷ this | versions / settings |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]

    def ratio(workload: dict, name: str) -> str:
        key = "service_over_skip_locked" if name == BASELINE_SKIP_LOCKED else f"service_over_{name}"
        return "" if name == "service" else fmt(workload["ratios"].get(key), 2)

    names = sorted(noop["median_per_second"], key=lambda k: -(noop["median_per_second"][k] or 0))
    for name in names:
        runs = noop["runs"][name]
        cpu = (
            cpu_per_job_us(runs, "steady_worker_cpu_seconds"),
            cpu_per_job_us(runs, "steady_postgres_cpu_seconds"),
        )
        label = f"**{name}**" if name == "service" else name
        lines.append(
            f"| {label} | {fmt(noop['median_per_second'][name])} | {ratio(noop, name)} "
            f"| {fmt(cpu[0])} / {fmt(cpu[1])} "
            f"| {fmt(post['median_per_second'].get(name)) if name in post['runs'] else ''} "
            f"| {ratio(post, name) if name in post['runs'] else ''} "
            f"| {settings.get(name, versions.get(name, ''))} |"
        )

    def verdict(workload: dict, key: str) -> str:
        return "met" if workload["meets"][key] else "NOT met"

    fastest = "service_over_fastest_peer"
    bare = "service_over_skip_locked"
    lines += [
        "",
        f"Service ÷ fastest peer: no-op **{fmt(noop['ratios'][fastest], 2)}** "
        f"({noop['fastest_peer']}), one POST **{fmt(post['ratios'][fastest], 2)}** "
        f"({post['fastest_peer']}); target ≥ {jb['targets'][fastest]:g}: "
        f"{verdict(noop, fastest)}, {verdict(post, fastest)}. "
        f"Service ÷ bare SKIP LOCKED: no-op **{fmt(noop['ratios'][bare], 2)}**, one POST "
        f"**{fmt(post['ratios'][bare], 2)}**; target ≥ {jb['targets'][bare]:g}: "
        f"{verdict(noop, bare)}, {verdict(post, bare)}.",
        "",
        "A no-op job stamps its slot in a file every worker maps (its finish time and a run "
        "count); a one-POST job sends the throughput scenario's signed 1 KiB POST, counted by "
        "the receiver. CPU: the workers' processes and the backends of the system's database "
        "(none with a Redis broker), from the first look that found a job arrived to the "
        "last arrival, over the jobs that arrived in between: the workers' start-up is left "
        "out.",
        "",
    ]
    return lines


def chart(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scen = result["scenarios"]
    panels = [k for k in ("throughput", "latency", "inbound", "growth", "jobs") if k in scen]
    if not panels:
        return
    cols = min(2, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.5 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, panels, strict=False):
        if key == "throughput":
            items = sorted(scen[key]["median_per_second"].items(), key=lambda kv: kv[1] or 0)
            colors = [
                "tab:red"
                if n == "service"
                else "tab:gray"
                if n.startswith("bare") or n == BASELINE_FLOOR
                else "tab:blue"
                for n, _ in items
            ]
            loop = scen[key].get("bare_loop")
            faster = f" (faster of {', '.join(map(str, loop['concurrencies']))})" if loop else ""
            labels = [n + faster if n == BARE_LOOP else n for n, _ in items]
            ax.barh(labels, [v or 0 for _, v in items], color=colors)
            bare = scen[key]["median_per_second"].get(BARE_LOOP)
            if bare:
                target = THROUGHPUT_TARGETS["service_over_bare_loop"]
                ax.axvline(bare * target, color="tab:red", linestyle="--",
                           label=f"target: {target:g} of the bare loop")  # fmt: skip
            ceiling = (scen[key].get("statements_ceiling") or {}).get("per_second")
            if ceiling:
                ax.axvline(ceiling, color="black", linestyle=":", label="CPU ceiling of the SQL")
            bound = (scen[key].get("design_bound") or {}).get("per_second")
            if bound:
                ax.axvline(bound, color="black", linestyle="-.", label="CPU bound of the design")
            if bare or ceiling or bound:
                ax.legend(loc="lower right", fontsize="small")
            ax.set_xlabel("deliveries/s (median)")
            ax.set_title(f"Outbound throughput, N = {scen[key]['events']:,}")
        elif key == "latency":
            rates = list(scen[key]["median"])
            for q, style in (("p50_ms", "o-"), ("p90_ms", "s-"), ("p99_ms", "^-")):
                ax.plot(
                    [int(r) for r in rates],
                    [scen[key]["median"][r][q] for r in rates],
                    style,
                    label=q.replace("_ms", ""),
                )
            ax.axhline(1000, color="tab:red", linestyle="--", label="p99 target")
            ax.set_yscale("log")
            ax.set_xlabel("offered events/s")
            ax.set_ylabel("publish → first attempt, ms")
            ax.set_title("Latency (open model)")
            ax.legend()
        elif key == "inbound":
            m = scen[key]["median"]
            labels = ["acknowledged/s", "processed/s", "backlog\nprocessed/s"]
            ax.bar(
                labels,
                [
                    m["acknowledged_per_second"] or 0,
                    m["processed_per_second"] or 0,
                    m.get("backlog_processed_per_second") or 0,
                ],
                color="tab:red",
            )
            ax.axhline(INBOUND_TARGET, color="tab:red", linestyle="--", label="target (processed)")
            ax.set_yscale("log")
            ax.set_ylabel("events/s (median)")
            ax.set_title(f"Inbound, no-op handler, N = {scen[key]['events']:,}")
            ax.legend()
        elif key == "jobs":
            workloads = scen[key]["workloads"]
            names = sorted(
                workloads["noop"]["median_per_second"],
                key=lambda k: workloads["noop"]["median_per_second"][k] or 0,
            )
            for offset, (workload, label) in enumerate(
                (("noop", "no-op job"), ("post", "one-POST job"))
            ):
                rates = [workloads[workload]["median_per_second"].get(k) or 0 for k in names]
                ax.barh(
                    [i + 0.4 * offset for i in range(len(names))],
                    rates,
                    height=0.4,
                    label=label,
                    color="tab:red" if offset == 0 else "tab:orange",
                )
            ax.set_yticks([i + 0.2 for i in range(len(names))], names)
            ax.set_xscale("log")
            ax.set_xlabel("jobs/s (median, log scale)")
            ax.set_title(f"Background jobs, N = {scen[key]['events']:,}")
            ax.legend(loc="lower right", fontsize="small")
        else:
            labels = ["scheduler pass", "pass, all full", "claim batch", "peak RSS"]
            keys = [
                "scheduler_pass_ms",
                "scheduler_pass_all_full_ms",
                "claim_batch_ms",
                "scheduler_once_peak_rss_mib",
            ]
            ratios = [scen[key]["ratios"][k] or 0 for k in keys]
            ax.bar(labels, ratios, color="tab:blue")
            for i, k in enumerate(keys):
                ax.hlines(scen[key]["targets"][k], i - 0.4, i + 0.4, colors="tab:red")
            ax.set_ylabel(f"{max(scen[key]['sizes']):,} rows ÷ {min(scen[key]['sizes']):,} rows")
            ax.set_title("Growth (red: target ceiling)")
    fig.suptitle(
        f"{result['cpu_count']} CPUs, load {result['load_average_at_start']} ({result['mode']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def versions(ctx: dict) -> dict:
    import importlib.metadata as md

    out = ob.versions(ctx["db_name"])

    def v(dist: str) -> str:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "?"

    out["django-q2 ORM"] = f"django-q2 {v('django-q2')}"
    out["django-q2 Redis"] = f"django-q2 {v('django-q2')}, redis-py {v('redis')}"
    out["procrastinate"] = f"procrastinate {v('procrastinate')}"
    out["Celery Redis"] = f"celery {v('celery')}, kombu {v('kombu')}"
    counts = " and ".join(str(c) for c in ob.BARE_CONCURRENCIES)
    out[BARE_LOOP] = f"aiohttp {v('aiohttp')}, the faster of {counts} in flight in each repeat"
    for c in ob.BARE_CONCURRENCIES:
        out[bare_loop_at(c)] = f"aiohttp {v('aiohttp')}, {c} in flight"
    out[BASELINE_SKIP_LOCKED] = f"psycopg {v('psycopg')} + aiohttp"
    out[BASELINE_FLOOR] = "the service's SQL from bench/floor.py: no Django, no ceilings"
    out[BASELINE_SIGNED] = (
        f"the bare loop with the worker's headers, through deliveries.core.egress, "
        f"{SERVICE_CONCURRENCY} in flight"
    )
    p = service_pipeline({})
    out["service"] = (
        f"{p.workers} run_workers (--batch-size {p.batch_size} "
        f"--concurrency {p.worker_concurrency}), "
        f"ceilings {int(p.env['DELIVERY_ENDPOINT_MAX_CONCURRENCY']):,}; the rest the defaults"
    )
    out[SERVICE_REDIS] = (
        f"the service with django-q2's Redis broker (Redis db "
        f"{REDIS_BROKER_ENV['REDIS_URL'].rsplit('/', 1)[1]})"
    )
    out[SERVICE_SPREAD] = f"the service with {SPREAD_WORKERS} run_workers"
    out["gunicorn"] = v("gunicorn")
    out["matplotlib"] = v("matplotlib")
    with contextlib.suppress(Exception):
        info = subprocess.run(
            ["redis-cli", "-h", "127.0.0.1", "INFO", "server"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout
        out["redis_server"] = next(
            line.split(":", 1)[1].strip()
            for line in info.splitlines()
            if line.startswith("redis_version")
        )
    return out


def python_loop_seconds(n: int = 10_000_000, rounds: int = 3) -> float:
    """The best of ``rounds`` timings of ``n`` additions in a pure-Python loop: how fast
    this machine runs Python. The service's cost is mostly Python and the bare loop's
    partly C, so their ratio moves with this figure; it places a run among the others."""
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        total = 0
        for i in range(n):
            total += i
        best = min(best, time.perf_counter() - started)
    return round(best, 3)


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small N, 1 repeat")
    parser.add_argument("--scenarios", default="throughput,latency,inbound,growth,jobs")
    parser.add_argument("--events", type=int, default=None, help="throughput N (20,000)")
    parser.add_argument("--jobs-events", type=int, default=None, help="jobs N (20,000)")
    parser.add_argument("--repeat", type=int, default=None, help="runs per scenario (3)")
    parser.add_argument("--rates", default=None, help="latency: events/s, comma-separated")
    parser.add_argument("--latency-seconds", type=float, default=None)
    parser.add_argument("--publishers", type=int, default=2, help="latency publisher processes")
    parser.add_argument("--inbound-events", type=int, default=None)
    parser.add_argument("--inbound-backlog", type=int, default=None, help="stored events (20,000)")
    parser.add_argument(
        "--gunicorn-workers", type=int, default=None, help="inbound: processes (cores + 1)"
    )
    parser.add_argument("--growth-sizes", default=None, help="due rows, comma-separated")
    parser.add_argument("--skip-peers", default="", help="comma-separated peer names")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--output-dir", type=Path, default=RESULTS)
    parser.add_argument(
        "--update",
        action="store_true",
        help="keep the other scenarios of the existing results file (replace only these)",
    )
    parser.add_argument(
        "--render",
        type=Path,
        default=None,
        metavar="RESULTS_JSON",
        help="only write the .md and .png beside this results.json (or jobs.json) again",
    )
    args = parser.parse_args(argv)
    if args.render:
        result = json.loads(args.render.read_text())
        args.render.with_suffix(".md").write_text(markdown(result) + "\n")
        chart(result, args.render.with_suffix(".png"))
        return 0
    q = args.quick
    ctx: dict = {
        "events": args.events or (2000 if q else 20_000),
        "jobs_events": args.jobs_events or (5000 if q else 20_000),
        "repeat": args.repeat or (1 if q else 3),
        "rates": [int(r) for r in (args.rates or ("100,300" if q else "250,500,1000")).split(",")],
        "latency_seconds": args.latency_seconds or (3 if q else 15),
        "publishers": args.publishers,
        "inbound_events": args.inbound_events or (500 if q else 10_000),
        "inbound_backlog": args.inbound_backlog or (2000 if q else 20_000),
        "gunicorn_workers": args.gunicorn_workers,
        "growth_sizes": [
            int(s)
            for s in (args.growth_sizes or ("1000,20000" if q else "10000,10000000")).split(",")
        ],
        "growth_passes": 3 if q else 5,
        "skip_peers": {s.strip() for s in args.skip_peers.split(",") if s.strip()},
        "timeout": args.timeout,
    }
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    base_url = ob.database_url()
    base_name = urlsplit(base_url).path.lstrip("/") or "webhooks"
    ctx["base_url"] = base_url
    ctx["db_name"] = f"{base_name}_bench"
    peer_db = f"{base_name}_bench_peers"
    ctx["peer_db_url"] = ob.with_db(base_url, peer_db)
    ctx["logs"] = Path(tempfile.mkdtemp(prefix="bench-run-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if {"throughput", "jobs"} & set(scenarios):
        subprocess.run([str(ROOT / "scripts" / "ensure_redis.sh")], check=True)
    for name in (ctx["db_name"], peer_db):
        ob.ensure_database(ob.with_db(base_url, "postgres"), name)
    db_url = ob.with_db(base_url, ctx["db_name"], "bench-ctl")
    ob.migrate({**os.environ, "DATABASE_URL": db_url})
    ob.setup_django(db_url)
    ctx["receiver"] = ob.start_receiver(None)
    result: dict = {
        "mode": "quick" if q else "full",
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "python_loop_seconds": python_loop_seconds(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "repeat": ctx["repeat"],
        "versions": versions(ctx),
        "settings": {k: v for k, v in ctx.items() if k not in ("receiver", "logs", "base_url")},
        "scenarios": {},
    }
    result["settings"]["skip_peers"] = sorted(ctx["skip_peers"])
    funcs = {
        "throughput": scenario_throughput,
        "latency": scenario_latency,
        "inbound": scenario_inbound,
        "growth": scenario_growth,
        "jobs": scenario_jobs,
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    result["admin_reference"] = admin_reference()
    # One results file per group of scenarios (results.json, jobs.json), each with the
    # run's header: a run of some scenarios rewrites only their files.
    results: dict[str, dict] = {}
    for stem in dict.fromkeys(results_file(name) for name in scenarios):
        results[stem] = {**result, "scenarios": {}}
        if stem != "results":
            results[stem].pop("admin_reference")
        previous = args.output_dir / f"{stem}.json"
        if args.update and previous.exists():
            results[stem]["scenarios"] = json.loads(previous.read_text()).get("scenarios", {})

    def write(stem: str) -> str:
        # After every scenario, so a failure later in the run keeps what was measured.
        out = results[stem]
        out["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        (args.output_dir / f"{stem}.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
        md_text = markdown(out)
        (args.output_dir / f"{stem}.md").write_text(md_text + "\n")
        chart(out, args.output_dir / f"{stem}.png")
        return md_text

    md_texts: dict[str, str] = {}
    try:
        for name in scenarios:
            load = [round(x, 2) for x in os.getloadavg()]
            started_at = time.strftime("%Y-%m-%d %H:%M:%S %z")
            stem = results_file(name)
            results[stem]["scenarios"][name] = funcs[name](ctx)
            results[stem]["scenarios"][name]["measured"] = {
                "at": started_at,
                "load_average_before": load,
                "load_average_after": [round(x, 2) for x in os.getloadavg()],
                "repeat": ctx["repeat"],
                # Growth does not repeat: each size is seeded once and measured
                # growth_passes times.
                "runs": f"{ctx['growth_passes']} runs of each measure at each size"
                if name == "growth"
                else f"{ctx['repeat']} repeat(s)",
            }
            md_texts[stem] = write(stem)
    except ob.BenchError as exc:
        print(f"FAILED: {exc}\nlogs: {ctx['logs']}", file=sys.stderr)
        return 1
    finally:
        ob.stop_all()
    print("\n" + "\n".join(md_texts.values()))
    files = ", ".join(f"{stem}.{{json,md,png}}" for stem in results)
    print(f"results: {args.output_dir}/ {files}; logs: {ctx['logs']}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        ob.stop_all()
        sys.exit(130)
