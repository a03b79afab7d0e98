"""Drain-and-count soak: publish events through the real scheduler, relay and workers to
a misbehaving receiver while a driver kill -9s those processes, arms them to die at the
named crash points, drops their database connections and restarts PostgreSQL; post
signed inbound events with duplicates and reordering to a real gunicorn, and enqueue
background jobs for ``run_jobs`` processes killed the same way, at the same time; then
drain, count, and fail unless the ledger balances.

    python -m tests.chaos.soak --events 100000          # make soak
    python -m tests.chaos.soak --events 800 --short     # what the test suite runs

Everything runs against a private PostgreSQL cluster made for the run (pgcluster.py),
never the shared server. The exit status is 0 only if every check of the ledger holds;
see docs/reliability.md for what each line means.
"""

import argparse
import base64
import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from tests.chaos.pgcluster import PrivateCluster, free_port

ROOT = Path(__file__).resolve().parents[2]

# Which named crash points (deliveries/jobs/faults.py) each role can be armed with.
FAULT_POINTS = {
    "relay": ["relay.before_publish", "relay.after_publish"],
    "worker": ["worker.before_take_commit", "worker.after_lease", "worker.after_send"],
    "scheduler": [],
    "jobs": [],
}
STARTUP_SECONDS = 8.0  # time a restarted command needs to be up, on a busy 2-core machine
CRASH_EXIT_CODE = (
    137  # deliveries.jobs.faults.CRASH_EXIT_CODE (not imported: Django is not set up yet)
)


@dataclass
class Config:
    events: int
    seed: int
    rate: float  # events published per second
    kill_every: tuple[float, float]
    fault_rate: float  # share of restarts armed with a crash point
    workers: int
    inbound: int
    jobs: int
    job_workers: int
    drain_timeout: float
    json_path: str | None = None


def child_env(cluster: PrivateCluster) -> dict[str, str]:
    """The environment of every process of the run: the private cluster, loopback
    egress, and short clocks so that a run drains in minutes, not days."""
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "DATABASE_URL": cluster.url,
        "DATABASE_CONN_MAX_AGE": "60",
        "EGRESS_ALLOW_NETWORKS": "127.0.0.0/8",
        "DELIVERY_RETRY_SCHEDULE": "0.5,1,2,4",
        "DELIVERY_RETRY_JITTER": "0.2",
        "DELIVERY_RETRY_AFTER_MAX": "2",
        "DELIVERY_TIMEOUT": "1.5",
        "DELIVERY_MAX_TIMEOUT": "2",
        "DELIVERY_LEASE_SECONDS": "10",  # the worker holds at least max timeout + 15 s
        "QUEUE_VISIBILITY_TIMEOUT": "8",
        "SCHEDULER_STALE_ENQUEUED_SECONDS": "20",
        "RELAY_CLAIM_SECONDS": "5",
        "INGEST_HANDLER_MODULES": "tests.chaos.handlers",
        # Background jobs: the soak's job types (tests/chaos/jobs.py); a killed worker's
        # jobs and entity locks come back after their timeout + 3 s; a job whose entity
        # lock is held is tried again 0.2 s later.
        "JOBS_MODULES": "tests.chaos.jobs",
        "JOBS_LEASE_MARGIN": "3",
        "JOBS_LOCK_RETRY": "0.2",
        "JOBS_CONCURRENCY": "8",
        "LOG_LEVEL": "WARNING",
        "FAULT_INJECT_AT": "",
    }


def setup_django(cluster: PrivateCluster) -> dict[str, str]:
    """Point this process at the private cluster with the run's environment, set Django
    up, migrate, and create the handlers' effect table. Returns the environment for the
    children."""
    env = child_env(cluster)
    os.environ.update({k: v for k, v in env.items() if k != "PYTHONPATH"})
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    from tests.chaos.handlers import EFFECT_TABLE_SQL

    call_command("migrate", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute(EFFECT_TABLE_SQL)
    return env


# --- The fleet of processes under test ---------------------------------------------------


@dataclass
class Proc:
    role: str
    kind: str
    popen: subprocess.Popen
    fault: str = ""
    log: Path | None = None
    started: float = field(default_factory=time.monotonic)
    job_log: Path | None = None  # where its job runs are written (tests/chaos/jobs.py)


class Fleet:
    """The real commands as child processes; only the driver kills them, and only these."""

    def __init__(self, env: dict, log_dir: Path, workers: int, job_workers: int) -> None:
        self.env = env
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, Proc] = {}
        self.commands = {
            "scheduler": ("scheduler", ["run_scheduler"]),
            "relay": ("relay", ["run_relay"]),
            **{
                f"worker-{i}": ("worker", ["run_workers", "--lanes", "3"])
                for i in range(1, workers + 1)
            },
            **{f"jobs-{i}": ("jobs", ["run_jobs"]) for i in range(1, job_workers + 1)},
        }
        self.kills: Counter = Counter()
        self.fault_deaths: Counter = Counter()
        self.armed: Counter = Counter()
        self.unexpected: list[str] = []
        self.starts = 0
        # Each start's job-run file, and the wall-clock time its process was seen dead
        # (None while it lives): a run it started and never ended ends there.
        self.job_logs: dict[Path, float | None] = {}

    @property
    def killable(self) -> list[str]:
        return sorted(self.commands)

    def start(self, role: str, *, fault: str = "", fault_after: int = 1) -> None:
        kind, args = self.commands[role]
        env = {**self.env, "PGAPPNAME": f"soak-{role}"}
        if fault:
            env.update(FAULT_INJECT_AT=fault, FAULT_INJECT_AFTER=str(fault_after))
            self.armed[fault] += 1
        job_log = None
        if kind == "jobs":
            job_log = self.log_dir / f"job-runs-{role}-{self.starts}.jsonl"
            env["SOAK_JOB_LOG"] = str(job_log)
            self.job_logs[job_log] = None
        log = self.log_dir / f"{role}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(
                [sys.executable, str(ROOT / "manage.py"), *args],
                env=env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.procs[role] = Proc(role, kind, popen, fault, log, job_log=job_log)
        self.starts += 1

    def _dead(self, proc: Proc) -> None:
        if proc.job_log is not None and self.job_logs.get(proc.job_log) is None:
            self.job_logs[proc.job_log] = time.time()

    def kill(self, role: str) -> None:
        """SIGKILL ``role``; one that already died by itself (since the last reap) is
        accounted for as reap does, not killed, since the caller starts it again."""
        proc = self.procs[role]
        rc = proc.popen.poll()
        if rc is not None:
            self._account(role, proc, rc)
            return
        proc.popen.send_signal(signal.SIGKILL)
        proc.popen.wait(10)
        self._dead(proc)
        self.kills[proc.kind] += 1

    def reap(self, restart: bool = True) -> None:
        """Restart what died by itself: a crash point reached is expected; any other exit
        (a command that gave up on a dropped connection, say) is a failure of the run."""
        for role, proc in list(self.procs.items()):
            rc = proc.popen.poll()
            if rc is None:
                continue
            self._account(role, proc, rc)
            if restart:
                self.start(role)

    def _account(self, role: str, proc: Proc, rc: int) -> None:
        self._dead(proc)  # seen dead now: at most one pass of the driver's loop late
        if rc == CRASH_EXIT_CODE and proc.fault:
            self.fault_deaths[proc.fault] += 1
        else:
            tail = proc.log.read_text(errors="replace")[-1500:] if proc.log else ""
            self.unexpected.append(f"{role} exited {rc}: {tail}")

    def stop(self, timeout: float = 60) -> dict[str, int]:
        """SIGTERM everything (the graceful path: finish the work under way, exit 0).
        A process restarted a moment ago is first given time to finish starting: before
        its handler is installed, SIGTERM ends it by the default action (nothing lost,
        but not the graceful path under test)."""
        youngest = max((p.started for p in self.procs.values()), default=0.0)
        time.sleep(max(0.0, youngest + STARTUP_SECONDS - time.monotonic()))
        for proc in self.procs.values():
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        codes = {}
        deadline = time.monotonic() + timeout
        for role, proc in self.procs.items():
            try:
                codes[role] = proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                codes[role] = proc.popen.wait()
            self._dead(proc)
        return codes


# --- Outbound publisher ------------------------------------------------------------------

ENDPOINTS = {
    # path: (share of events, receiver behaviour)
    "/a": 0.3,  # 500s, 429s, timeouts, lost acknowledgements
    "/b": 0.3,  # the same
    "/healthy": 0.3,  # always 200 at once: its latency is the head-of-line figure
    "/gone": 0.1,  # 200 for a while, then 410 Gone for ever
}


def event_type_for(i: int, rng: random.Random) -> str:
    draw, acc = rng.random(), 0.0
    for path, share in ENDPOINTS.items():
        acc += share
        if draw < acc:
            return "soak" + path.replace("/", ".")
    return "soak.healthy"


@dataclass
class CommitStats:
    committed: int = 0
    rolled_back: int = 0
    db_errors: int = 0
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)


def commit_in_batches(
    total: int,
    batch: int,
    wait,
    write,
    rng: random.Random,
    stats: CommitStats,
    stop: threading.Event,
) -> None:
    """The application's writes: ``write(chunk)`` for ``total`` items, ``batch`` to a
    transaction, each batch once ``wait(its first item)`` (the seconds still to wait)
    says it is time. Each item carries an idempotency key, so that a batch whose commit
    is in doubt (the server went away during COMMIT) is retried without writing anything
    twice. One batch in twenty is rolled back on purpose (the process dies before it
    commits), then written again."""
    from django.db import InterfaceError, OperationalError, connection, transaction

    seq = 0

    class _DiesBeforeCommit(Exception):
        pass

    try:
        while seq < total and not stop.is_set():
            ahead = wait(seq)
            if ahead > 0:
                time.sleep(ahead)
                continue
            chunk = list(range(seq, min(total, seq + batch)))
            try:
                with transaction.atomic():
                    write(chunk)
                    if rng.random() < 0.05:
                        raise _DiesBeforeCommit
            except _DiesBeforeCommit:
                stats.rolled_back += 1
                continue
            except (OperationalError, InterfaceError):
                stats.db_errors += 1
                with contextlib.suppress(Exception):
                    connection.close()
                time.sleep(0.5)
                continue
            seq += len(chunk)
            stats.committed = seq
    except Exception as exc:  # the run must fail loudly, not stop writing quietly
        stats.error = repr(exc)
        raise
    finally:
        connection.close()
        stats.done.set()


def publish(cfg: Config, tenant_id, stats: CommitStats, stop: threading.Event) -> None:
    """The application's events, 25 a transaction, at ``cfg.rate`` a second."""
    from deliveries.models import Event
    from deliveries.services import publish_event

    rng = random.Random(cfg.seed + 1)
    types = [event_type_for(i, rng) for i in range(cfg.events)]

    def write(chunk: list[int]) -> None:
        keys = [f"soak-{i}" for i in chunk]
        done = set(
            Event.objects.filter(tenant_id=tenant_id, idempotency_key__in=keys).values_list(
                "idempotency_key", flat=True
            )
        )
        for i, key in zip(chunk, keys, strict=True):
            if key not in done:
                publish_event(
                    tenant=tenant_id,
                    event_type=types[i],
                    payload={"seq": i, "type": types[i], "pad": "x" * 200},
                    entity_id=f"soak:{i % 997}",
                    idempotency_key=key,
                )

    started = time.monotonic()

    def wait(seq: int) -> float:
        return seq / cfg.rate - (time.monotonic() - started)

    commit_in_batches(cfg.events, 25, wait, write, rng, stats, stop)


# --- Background jobs ---------------------------------------------------------------------

ENTITIES = 8  # the entity lock keys the locked jobs share


def job_mix(n: int, seed: int) -> list[tuple[str, dict]]:
    """(type, payload) of each job, by a seeded draw: plain and entity-locked jobs that
    succeed, jobs that fail once or twice then succeed, jobs that ask for a retry after
    0.5 s, jobs that ``Fail`` and jobs that spend their attempts (tests/chaos/jobs.py).
    Locked jobs take 30-150 ms, so that two overlapping would show and a kill -9 finds
    some in the middle of a run."""
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        draw = rng.random()
        entity = rng.randrange(ENTITIES)
        if draw < 0.30:
            job_type, locked = "soak.ok", False
        elif draw < 0.60:
            job_type, locked = "soak.ok", True
        elif draw < 0.75:
            job_type, locked = "soak.flaky", rng.random() < 0.5
        elif draw < 0.83:
            job_type, locked = "soak.retry_after", rng.random() < 0.4
        elif draw < 0.92:
            job_type, locked = "soak.fail", rng.random() < 0.4
        else:
            job_type, locked = "soak.exhaust", rng.random() < 0.4
        ms = rng.uniform(30, 150) if locked else rng.uniform(0, 50)
        payload = {"i": i, "ms": round(ms, 1)}
        if locked:
            payload["entity"] = entity
        if job_type == "soak.flaky":
            payload["succeed_on"] = rng.choice((2, 3))
        jobs.append((job_type, payload))
    return jobs


def enqueue_jobs(
    cfg: Config, stats: CommitStats, published: CommitStats, stop: threading.Event
) -> None:
    """The application's background jobs, ten a transaction, keeping pace with the
    events ``published`` (so they meet the same chaos however fast this machine
    publishes); ``enqueue`` with an idempotency key returns the job a batch in doubt
    already wrote."""
    from deliveries.jobs.background import enqueue

    jobs = job_mix(cfg.jobs, cfg.seed + 3)

    def write(chunk: list[int]) -> None:
        for i in chunk:
            job_type, payload = jobs[i]
            enqueue(job_type, payload, idempotency_key=f"soak-job-{i}")

    def wait(seq: int) -> float:
        behind = published.committed * cfg.jobs < seq * cfg.events
        return 0.05 if behind and not published.done.is_set() else 0.0

    commit_in_batches(cfg.jobs, 10, wait, write, random.Random(cfg.seed + 4), stats, stop)


# --- Inbound sender ----------------------------------------------------------------------


@dataclass
class SendStats:
    events: int = 0
    copies: int = 0
    accepted: int = 0
    duplicate: int = 0
    retried: int = 0
    failed: int = 0
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)
    occurred: dict = field(default_factory=dict)  # event id -> (entity, occurred_at)


def send_inbound(cfg: Config, url: str, secret: str, stats: SendStats, pace: float) -> None:
    """A provider: every event once, a fifth of them again, all shuffled (so events of
    one entity arrive out of order and copies arrive before and after each other), each
    copy freshly signed (Standard Webhooks) and retried until the server answers 2xx."""
    from ingest.schemes import get_scheme

    scheme = get_scheme("standard")
    rng = random.Random(cfg.seed + 2)
    n = cfg.inbound
    entities = max(1, n // 8)
    base = datetime.now(UTC) - timedelta(hours=1)
    bodies = {}
    for i in range(n):
        event_id = f"in_{i}"
        entity = f"ent_{i % entities}"
        occurred = base + timedelta(milliseconds=i)
        stats.occurred[event_id] = (entity, occurred)
        bodies[event_id] = json.dumps(
            {
                "type": "thing.updated",
                "timestamp": occurred.isoformat(),
                "data": {"id": entity, "n": i},
            }
        ).encode()
    copies = list(bodies) + [f"in_{i}" for i in range(n) if rng.random() < 0.2]
    rng.shuffle(copies)
    stats.events = n
    try:
        for event_id in copies:
            answer = post_signed(scheme, url, secret, event_id, bodies[event_id], stats)
            if answer is None:
                stats.failed += 1
            elif answer.get("status") == "duplicate":
                stats.duplicate += 1
            else:
                stats.accepted += 1
            time.sleep(pace)
    except Exception as exc:
        stats.error = repr(exc)
        raise
    finally:
        stats.done.set()


def post_signed(scheme, url, secret, event_id, body, stats, patience: float = 120):
    """POST one copy, freshly signed, until the server answers 2xx (as a provider
    retries); returns the JSON answer, or None if it never did."""
    deadline = time.monotonic() + patience
    while True:
        headers = scheme.sign(body=body, secret=secret, event_id=event_id)
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")  # noqa: S310
        try:
            with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
                stats.copies += 1
                return json.loads(response.read() or b"{}")
        except (urllib.error.URLError, OSError, ValueError):
            stats.retried += 1
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)


# --- The ledger --------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def outbound_ledger(cfg: Config, tenant_id, receiver, paths: dict) -> dict:
    from deliveries.models import Attempt, Delivery, Event, Outcome

    evidence = receiver.snapshot()
    events = {
        e["id"]: e
        for e in Event.objects.filter(tenant_id=tenant_id).values(
            "id", "idempotency_key", "event_type", "created_at", "body"
        )
    }
    seqs = sorted(int(e["idempotency_key"].removeprefix("soak-")) for e in events.values())
    deliveries = list(
        Delivery.objects.filter(tenant_id=tenant_id).values(
            "id", "event_id", "endpoint_id", "state", "last_outcome", "lease_expiries"
        )
    )
    path_of = {endpoint_id: path for path, endpoint_id in paths.items()}
    by_id = {str(d["id"]): d for d in deliveries}
    gone_endpoint = paths["/gone"]
    from deliveries.models import Endpoint

    gone_at = Endpoint.objects.get(id=gone_endpoint).disabled_at

    states = Counter(d["state"] for d in deliveries)
    cut_outcomes = {Outcome.ENDPOINT_GONE, Outcome.ENDPOINT_DISABLED}
    delivered = states["succeeded"]
    cut_off = sum(
        1 for d in deliveries if d["state"] == "dead" and d["last_outcome"] in cut_outcomes
    )
    dead_by_policy = states["dead"] - cut_off
    in_flight = len(deliveries) - delivered - states["dead"]

    problems: list[str] = []
    lost = 0
    unexpected = 0
    # Every committed event has its delivery (an event for /gone published after the
    # endpoint was disabled has none, by design: it was never subscribed).
    with_delivery = {d["event_id"] for d in deliveries}
    no_subscriber = 0
    for event_id, e in events.items():
        if event_id in with_delivery:
            continue
        if e["event_type"] == "soak.gone" and gone_at and e["created_at"] >= gone_at:
            no_subscriber += 1
        else:
            lost += 1
            problems.append(f"event {event_id} has no delivery")
    if seqs != list(range(cfg.events)):
        lost += cfg.events - len(set(seqs))
        problems.append(f"published sequence has gaps or repeats: {len(seqs)} events")

    latencies, healthy_latencies = [], []
    duplicates = 0
    ids_per_event: dict = {}
    for msg_id, copies in evidence.copies.items():
        d = by_id.get(msg_id)
        if d is None:
            unexpected += len(copies)
            problems.append(f"receiver saw webhook-id {msg_id} that no delivery has")
            continue
        event = events[d["event_id"]]
        body_sha = hashlib.sha256(bytes(event["body"])).hexdigest()[:16]
        for c in copies:
            if c.path != path_of[d["endpoint_id"]] or c.body_sha != body_sha:
                unexpected += 1
                problems.append(f"{msg_id}: a copy at {c.path} with body {c.body_sha}")
        ids_per_event.setdefault(d["event_id"], set()).add(msg_id)
        duplicates += len(copies) - 1
        acked = [c.at for c in copies if c.action == "ok"]
        if d["state"] == "succeeded":
            if not acked:
                lost += 1
                problems.append(f"{msg_id} recorded succeeded, the receiver never answered 2xx")
                continue
            latency = min(acked) - event["created_at"].timestamp()
            latencies.append(latency)
            if path_of[d["endpoint_id"]] == "/healthy":
                healthy_latencies.append(latency)
    for d in deliveries:
        if d["state"] == "succeeded" and str(d["id"]) not in evidence.copies:
            lost += 1
            problems.append(f"{d['id']} recorded succeeded, never received")
    split = sum(1 for ids in ids_per_event.values() if len(ids) > 1)
    if split:
        unexpected += split
        problems.append(f"{split} events reached the receiver under more than one webhook-id")
    unexpected += evidence.bad_signatures
    if evidence.bad_signatures:
        problems.append(f"{evidence.bad_signatures} copies failed signature verification")
    if in_flight:
        problems.append(f"{in_flight} deliveries not terminal after the drain: {dict(states)}")

    # Counted from both ends: every committed event has one delivery (each event type
    # has one endpoint), or none because its endpoint was disabled first.
    balanced = len(deliveries) + no_subscriber == len(events)
    if not balanced:
        problems.append(
            f"{len(events)} events, {len(deliveries)} deliveries, {no_subscriber} without one"
        )
    attempts = Attempt.objects.filter(delivery__tenant_id=tenant_id).count()
    return {
        "events": len(events),
        "deliveries": len(deliveries),
        "delivered": delivered,
        "dead_by_policy": dead_by_policy,
        "cut_off": cut_off,
        "in_flight": in_flight,
        "no_subscriber": no_subscriber,
        "balanced": balanced,
        "lost": lost,
        "unexpected": unexpected,
        "copies": sum(len(c) for c in evidence.copies.values()),
        "duplicates": duplicates,
        "signatures_verified": evidence.verified,
        "bad_signatures": evidence.bad_signatures,
        "receiver_actions": dict(evidence.actions),
        "attempts": attempts,
        "lease_expiries": sum(d["lease_expiries"] for d in deliveries),
        "latency_p50": percentile(latencies, 0.5),
        "latency_p99": percentile(latencies, 0.99),
        "latency_max": max(latencies, default=0.0),
        "healthy_p99": percentile(healthy_latencies, 0.99),
        "healthy_max": max(healthy_latencies, default=0.0),
        "problems": problems[:20],
    }


def inbound_ledger(stats: SendStats) -> dict:
    """One application per event: exactly one effect row for every event sent, none for
    anything else, and each entity's version is its newest event whatever the order."""
    from django.db import connection

    from ingest.models import EntityVersion, InboundEvent
    from tests.chaos.handlers import SOURCE

    with connection.cursor() as cursor:
        cursor.execute("SELECT event_id, count(*) FROM chaos_effect GROUP BY event_id")
        effects = dict(cursor.fetchall())
    sent = set(stats.occurred)
    states = Counter(
        InboundEvent.objects.filter(source__slug=SOURCE).values_list("state", flat=True)
    )
    problems = []
    missing = sorted(sent - set(effects))
    twice = sorted(k for k, v in effects.items() if v > 1)
    foreign = sorted(set(effects) - sent)
    if missing:
        problems.append(f"{len(missing)} events never applied, e.g. {missing[:3]}")
    if twice:
        problems.append(f"{len(twice)} events applied more than once, e.g. {twice[:3]}")
    if foreign:
        problems.append(f"{len(foreign)} effects for events never sent")
    newest: dict = {}
    for entity, occurred in stats.occurred.values():
        newest[entity] = max(newest.get(entity, occurred), occurred)
    versions = dict(
        EntityVersion.objects.filter(key__startswith=f"{SOURCE}:").values_list("key", "applied_at")
    )
    wrong_version = [e for e, t in newest.items() if versions.get(f"{SOURCE}:{e}") != t]
    if wrong_version:
        problems.append(f"{len(wrong_version)} entities not at their newest event")
    if stats.error:
        problems.append(f"the sender stopped: {stats.error}")
    if stats.failed:
        problems.append(f"{stats.failed} copies never acknowledged by the server")
    unfinished = sum(n for s, n in states.items() if s not in ("processed", "skipped"))
    if unfinished:
        problems.append(f"inbound events not processed: {dict(states)}")
    return {
        "events": stats.events,
        "copies_posted": stats.copies,
        "accepted": stats.accepted,
        "duplicate_answers": stats.duplicate,
        "post_retries": stats.retried,
        "stored": sum(states.values()),
        "processed": states["processed"],
        "applied_once": sum(1 for k in sent if effects.get(k) == 1),
        "applied_twice": len(twice),
        "never_applied": len(missing),
        "entities_at_newest": len(newest) - len(wrong_version),
        "entities": len(newest),
        "problems": problems,
    }


@dataclass
class JobRunSpan:
    """One run of a job function as its process wrote it (tests/chaos/jobs.py)."""

    job: str
    attempt: int
    key: str
    start: float
    end: float
    outcome: str  # ok, retry, error, fail; "killed": its process died during it


def read_job_runs(job_logs: dict) -> tuple[list[JobRunSpan], list[str]]:
    """Every run in the job-run files; a run without an end ends when its process was
    seen dead (kill -9, or the stop)."""
    spans, problems = [], []
    for path, died in job_logs.items():
        if not path.exists():
            continue
        open_runs: dict[tuple, dict] = {}
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            ident = (rec["job"], rec["attempt"])
            if rec["ev"] == "start":
                open_runs[ident] = rec
                continue
            begun = open_runs.pop(ident, None)
            if begun is None:
                problems.append(f"{path.name}: an end without a start: {line}")
                continue
            spans.append(
                JobRunSpan(
                    rec["job"], rec["attempt"], rec["key"], begun["t"], rec["t"], rec["outcome"]
                )
            )
        for (job_id, attempt), begun in open_runs.items():
            if died is None:
                problems.append(f"{path.name}: run of {job_id} unfinished, process not seen dead")
                died = float("inf")
            spans.append(JobRunSpan(job_id, attempt, begun["key"], begun["t"], died, "killed"))
    return spans, problems


def lock_overlaps(spans: list[JobRunSpan]) -> list[tuple[JobRunSpan, JobRunSpan]]:
    """Pairs of runs under one entity lock key whose intervals intersect: for each key,
    by start time, a run that starts before the latest end of the runs before it."""
    by_key: dict[str, list[JobRunSpan]] = {}
    for span in spans:
        if span.key:
            by_key.setdefault(span.key, []).append(span)
    overlaps = []
    for runs in by_key.values():
        runs.sort(key=lambda r: r.start)
        latest = runs[0]
        for run in runs[1:]:
            if run.start < latest.end:
                overlaps.append((latest, run))
            if run.end > latest.end:
                latest = run
    return overlaps


def jobs_ledger(cfg: Config, stats: CommitStats, job_logs: dict) -> dict:
    """Every job enqueued ends done or, the ones designed to die, dead with their reason;
    none left pending or running; no two runs under one entity lock overlap in time;
    every done job's function completed at least once; a recorded ``Retry(after=s)`` is
    honoured (the next attempt starts s seconds after the run that asked at least)."""
    from deliveries.jobs.models import Job, JobRun
    from tests.chaos.jobs import EXHAUST_ATTEMPTS, FAIL_REASON

    jobs = {
        str(j["id"]): j
        for j in Job.objects.filter(type__startswith="soak.").values(
            "id", "type", "state", "dead_reason", "idempotency_key", "payload"
        )
    }
    problems: list[str] = []
    lost = unexpected = 0
    seqs = sorted(int(j["idempotency_key"].removeprefix("soak-job-")) for j in jobs.values())
    if seqs != list(range(stats.committed)):
        lost += max(0, stats.committed - len(set(seqs)))
        problems.append(f"enqueued sequence has gaps or repeats: {len(seqs)} jobs")
    states = Counter(j["state"] for j in jobs.values())
    exhausted = f"attempts exhausted ({EXHAUST_ATTEMPTS}): "
    designed_to_die = {"soak.fail", "soak.exhaust"}

    def reason_ok(j) -> bool:
        if j["type"] == "soak.fail":
            return j["dead_reason"] == FAIL_REASON
        # Its last attempt either raised or was cut by a kill: both spend it.
        return j["dead_reason"].startswith(exhausted) or (
            j["dead_reason"] == "lease expired on the last attempt"
        )

    done = dead_by_policy = 0
    dead_reasons: Counter = Counter()
    for job_id, j in jobs.items():
        if j["state"] in ("pending", "running"):
            lost += 1
            problems.append(f"job {job_id} ({j['type']}) still {j['state']} after the drain")
        elif j["type"] in designed_to_die:
            if j["state"] == "dead" and reason_ok(j):
                dead_by_policy += 1
                dead_reasons[
                    j["dead_reason"].split(": ")[0]
                    if j["type"] == "soak.exhaust"
                    else j["dead_reason"]
                ] += 1
            else:
                unexpected += 1
                problems.append(
                    f"job {job_id} ({j['type']}) ended {j['state']}: {j['dead_reason']}"
                )
        elif j["state"] == "done":
            done += 1
        else:
            unexpected += 1
            problems.append(f"job {job_id} ({j['type']}) ended {j['state']}: {j['dead_reason']}")

    spans, read_problems = read_job_runs(job_logs)
    problems += read_problems[:5]
    completed = Counter(s.job for s in spans if s.outcome == "ok")
    never_ran = [k for k, j in jobs.items() if j["state"] == "done" and not completed[k]]
    if never_ran:
        lost += len(never_ran)
        problems.append(f"{len(never_ran)} jobs done whose function never completed")
    foreign = {s.job for s in spans} - set(jobs)
    if foreign:
        unexpected += len(foreign)
        problems.append(f"{len(foreign)} jobs ran that were never committed (rolled back?)")
    overlaps = lock_overlaps(spans)
    for a, b in overlaps[:5]:
        problems.append(
            f"lock {a.key}: {b.job}#{b.attempt} started {a.end - b.start:.3f} s before "
            f"{a.job}#{a.attempt} ({a.outcome}) ended"
        )

    runs = Counter(
        JobRun.objects.filter(job__type__startswith="soak.").values_list("outcome", flat=True)
    )
    recorded = set(
        JobRun.objects.filter(
            job__type="soak.retry_after", outcome__in=["retry", "lost"]
        ).values_list("job_id", "attempt", "outcome")
    )
    by_attempt: dict[tuple, list[JobRunSpan]] = {}
    for span in spans:
        by_attempt.setdefault((span.job, span.attempt), []).append(span)
    retry_checked = retry_early = 0
    for job_id, attempt, outcome in recorded:
        # A retry recorded for the attempt that the sweep did not take back first.
        if outcome != "retry" or (job_id, attempt, "lost") in recorded:
            continue
        asked = [s for s in by_attempt.get((str(job_id), attempt), []) if s.outcome == "retry"]
        after = jobs[str(job_id)]["payload"].get("after", 0.5)
        for asking in asked:
            for nxt in by_attempt.get((str(job_id), attempt + 1), []):
                retry_checked += 1
                if nxt.start < asking.end + after:
                    retry_early += 1
                    gap = nxt.start - asking.end
                    problems.append(f"job {job_id} ran again {gap:.3f} s after Retry({after})")
    if stats.error:
        problems.insert(0, f"the enqueuer stopped: {stats.error}")
        lost += cfg.jobs - stats.committed
    return {
        "enqueued": len(jobs),
        "done": done,
        "dead_by_policy": dead_by_policy,
        "dead_reasons": dict(dead_reasons),
        "designed_to_die": sum(1 for j in jobs.values() if j["type"] in designed_to_die),
        "lost": lost,
        "unexpected": unexpected,
        "states": dict(states),
        "runs_logged": len(spans),
        "runs_killed": sum(1 for s in spans if s.outcome == "killed"),
        "completed_more_than_once": sum(1 for n in completed.values() if n > 1),
        "locked_runs": sum(1 for s in spans if s.key),
        "lock_keys": len({s.key for s in spans if s.key}),
        "overlaps": len(overlaps),
        "retry_after_checked": retry_checked,
        "retry_after_early": retry_early,
        "runs_recorded": dict(runs),
        "rolled_back": stats.rolled_back,
        "db_errors": stats.db_errors,
        "problems": problems[:20],
    }


def print_ledger(out: dict, chaos: dict, inbound: dict, jobs: dict, cfg: Config) -> None:
    rows = [
        ("seed", cfg.seed),
        ("events published", out["events"]),
        ("deliveries published", out["deliveries"]),
        ("  delivered", out["delivered"]),
        ("  dead by policy", out["dead_by_policy"]),
        ("  cut off (410, endpoint disabled)", out["cut_off"]),
        ("  still in flight", out["in_flight"]),
        ("events for the disabled endpoint (no delivery)", out["no_subscriber"]),
        ("balanced", "yes" if out["balanced"] else "NO"),
        ("lost", out["lost"]),
        ("unexpected", out["unexpected"]),
        ("copies received", out["copies"]),
        ("duplicates (same webhook-id)", out["duplicates"]),
        ("signatures verified / bad", f"{out['signatures_verified']} / {out['bad_signatures']}"),
        ("attempts recorded", out["attempts"]),
        ("lease expiries", out["lease_expiries"]),
        (
            "receiver actions",
            ", ".join(f"{k} {v}" for k, v in sorted(out["receiver_actions"].items())),
        ),
        (
            "latency p50 / p99 / max (s)",
            f"{out['latency_p50']:.2f} / {out['latency_p99']:.2f} / {out['latency_max']:.2f}",
        ),
        ("healthy endpoint p99 / max (s)", f"{out['healthy_p99']:.2f} / {out['healthy_max']:.2f}"),
        ("kill -9", ", ".join(f"{k} {v}" for k, v in sorted(chaos["kills"].items())) or "0"),
        (
            "armed crash points",
            ", ".join(f"{k} {v}" for k, v in sorted(chaos["armed"].items())) or "0",
        ),
        (
            "died at crash points",
            ", ".join(f"{k} {v}" for k, v in sorted(chaos["fault_deaths"].items())) or "0",
        ),
        ("PostgreSQL restarts", chaos["pg_restarts"]),
        ("connections terminated", chaos["terminated"]),
        (
            "publish batches rolled back / db errors",
            f"{chaos['rolled_back']} / {chaos['publish_db_errors']}",
        ),
        ("unexpected process exits", len(chaos["unexpected_exits"])),
        (
            "graceful stop exit codes",
            ", ".join(f"{k} {v}" for k, v in sorted(chaos["stop_codes"].items())),
        ),
        ("inbound events / copies posted", f"{inbound['events']} / {inbound['copies_posted']}"),
        (
            "  accepted / duplicate answers",
            f"{inbound['accepted']} / {inbound['duplicate_answers']}",
        ),
        (
            "  applied once / twice / never",
            f"{inbound['applied_once']} / {inbound['applied_twice']} / {inbound['never_applied']}",
        ),
        (
            "  entities at their newest event",
            f"{inbound['entities_at_newest']} / {inbound['entities']}",
        ),
        ("jobs enqueued", jobs["enqueued"]),
        ("  done", jobs["done"]),
        (
            "  dead by policy (of designed to die)",
            f"{jobs['dead_by_policy']} ({jobs['designed_to_die']}): "
            + ", ".join(f"{k} {v}" for k, v in sorted(jobs["dead_reasons"].items())),
        ),
        ("  lost (pending or running after the drain)", jobs["lost"]),
        ("  unexpected", jobs["unexpected"]),
        (
            "  runs logged / cut by kill -9",
            f"{jobs['runs_logged']} / {jobs['runs_killed']}",
        ),
        ("  completed more than once (at least once)", jobs["completed_more_than_once"]),
        (
            "  runs under entity locks / keys / overlaps",
            f"{jobs['locked_runs']} / {jobs['lock_keys']} / {jobs['overlaps']}",
        ),
        (
            "  Retry(after) checked / early",
            f"{jobs['retry_after_checked']} / {jobs['retry_after_early']}",
        ),
        (
            "  runs recorded",
            ", ".join(f"{k} {v}" for k, v in sorted(jobs["runs_recorded"].items())),
        ),
        (
            "  enqueue batches rolled back / db errors",
            f"{jobs['rolled_back']} / {jobs['db_errors']}",
        ),
        ("drain (s) / total (s)", f"{chaos['drain_seconds']:.0f} / {chaos['total_seconds']:.0f}"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n== soak ledger")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    for p in (
        out["problems"] + inbound["problems"] + jobs["problems"] + chaos["unexpected_exits"][:5]
    ):
        print(f"! {p}")


# --- The run -----------------------------------------------------------------------------


def run(cfg: Config) -> int:
    print(
        f"soak: seed {cfg.seed}, {cfg.events} events, {cfg.inbound} inbound, {cfg.jobs} jobs",
        flush=True,
    )

    def interrupted(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    # SIGTERM (and SIGINT, even where a background shell ignores it) unwind through the
    # clean-up below: every child stopped, the private cluster removed.
    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    started = time.monotonic()
    cluster = PrivateCluster().start()
    fleet = web = receiver = None
    try:
        env = setup_django(cluster)
        from django.db import connection

        from deliveries import services
        from deliveries.jobs.models import Job, Outbox, QueueMessage
        from deliveries.models import Delivery, Tenant
        from ingest.models import InboundEvent
        from ingest.sources import source_create
        from tests.chaos.handlers import SOURCE
        from tests.chaos.receiver import ChaosReceiver, Rates

        rng = random.Random(cfg.seed)

        receiver = ChaosReceiver(seed=cfg.seed, slow_seconds=2.5).start()
        tenant = Tenant.objects.create(name="soak")
        chaos_rates = Rates(fail=0.08, throttle=0.04, slow=0.01, drop=0.03)
        paths = {}
        for path in ENDPOINTS:
            endpoint, secret = services.endpoint_create(
                tenant=tenant,
                url=receiver.url(path),
                event_types=["soak" + path.replace("/", ".")],
                timeout=1.5,
            )
            paths[path] = endpoint.id
            if path == "/gone":
                receiver.add(path, secret=secret, gone_after=max(50, cfg.events // 40))
            elif path == "/healthy":
                receiver.add(path, secret=secret)
            else:
                receiver.add(path, secret=secret, rates=chaos_rates)
        inbound_secret = "whsec_" + base64.b64encode(os.urandom(24)).decode()
        source_create(slug=SOURCE, scheme="standard", secrets=[inbound_secret])

        fleet = Fleet(env, cluster.dir / "logs", cfg.workers, cfg.job_workers)
        for role in fleet.killable:
            fleet.start(role)
        web_port = free_port()
        web_log = (cluster.dir / "logs" / "web.log").open("ab")
        web = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-c", "project/gunicorn.conf.py"],
            env={
                **env,
                "GUNICORN_BIND": f"127.0.0.1:{web_port}",
                "GUNICORN_WORKERS": "2",
                "PGAPPNAME": "soak-web",
            },
            cwd=ROOT,
            stdout=web_log,
            stderr=subprocess.STDOUT,
        )

        connection.close()
        pub = CommitStats()
        stop_publishing = threading.Event()
        threading.Thread(
            target=publish, args=(cfg, tenant.id, pub, stop_publishing), daemon=True
        ).start()
        queued = CommitStats()
        threading.Thread(
            target=enqueue_jobs, args=(cfg, queued, pub, stop_publishing), daemon=True
        ).start()
        sent = SendStats()
        publish_seconds = cfg.events / cfg.rate
        threading.Thread(
            target=send_inbound,
            args=(
                cfg,
                f"http://127.0.0.1:{web_port}/ingest/{SOURCE}/",
                inbound_secret,
                sent,
                publish_seconds / max(1, cfg.inbound * 1.2) * 0.8,
            ),
            daemon=True,
        ).start()

        # Chaos while the traffic flows.
        restart_at = rng.uniform(0.3, 0.5)
        terminate_at = rng.uniform(0.6, 0.8)
        pg_restarts = terminated = 0
        next_kill = time.monotonic() + rng.uniform(*cfg.kill_every)
        last_report = time.monotonic()
        while not (pub.done.is_set() and sent.done.is_set() and queued.done.is_set()):
            time.sleep(0.1)
            fleet.reap()
            progress = pub.committed / cfg.events
            if not pg_restarts and progress >= restart_at:
                away = cluster.restart("immediate")
                pg_restarts += 1
                print(
                    f"soak: PostgreSQL restarted (immediate) at {progress:.0%}, {away:.1f} s",
                    flush=True,
                )
            if not terminated and progress >= terminate_at:
                terminated = cluster.terminate_backends()
                print(f"soak: {terminated} connections terminated at {progress:.0%}", flush=True)
            if time.monotonic() >= next_kill:
                # Every kind of process is killed at least once, then any at random.
                spared = [r for r in fleet.killable if not fleet.kills[fleet.commands[r][0]]]
                role = rng.choice(spared or fleet.killable)
                fleet.kill(role)
                points = FAULT_POINTS[fleet.commands[role][0]]
                if points and rng.random() < cfg.fault_rate:
                    fleet.start(role, fault=rng.choice(points), fault_after=rng.randint(1, 20))
                else:
                    fleet.start(role)
                next_kill = time.monotonic() + rng.uniform(*cfg.kill_every)
            if time.monotonic() - last_report > 15:
                last_report = time.monotonic()
                print(
                    f"soak: published {pub.committed}/{cfg.events}, inbound copies {sent.copies}, "
                    f"jobs {queued.committed}/{cfg.jobs}, kills {sum(fleet.kills.values())}",
                    flush=True,
                )

        def waiting() -> dict:
            found = Counter(
                f"delivery {s}"
                for s in Delivery.objects.exclude(state__in=["succeeded", "dead"]).values_list(
                    "state", flat=True
                )
            ) + Counter(
                f"inbound {s}"
                for s in InboundEvent.objects.filter(
                    state__in=["pending", "enqueued", "processing"]
                ).values_list("state", flat=True)
            )
            found += Counter(
                f"job {s}"
                for s in Job.objects.filter(state__in=["pending", "running"]).values_list(
                    "state", flat=True
                )
            )
            found["queue messages"] = QueueMessage.objects.count()
            connection.close()
            return dict(found)

        # Drain: no more chaos; whatever is still armed may yet die at its point and is
        # restarted unarmed.
        drain_started = time.monotonic()
        print("soak: published; draining", flush=True)
        drained = False
        while time.monotonic() - drain_started < cfg.drain_timeout:
            fleet.reap()
            for role, proc in list(fleet.procs.items()):
                if (
                    proc.fault
                    and proc.popen.poll() is None
                    and time.monotonic() - drain_started > 10
                ):
                    fleet.kill(role)
                    fleet.start(role)
            try:
                busy = (
                    Delivery.objects.filter(state__in=["pending", "enqueued", "leased"]).exists()
                    or InboundEvent.objects.filter(
                        state__in=["pending", "enqueued", "processing"]
                    ).exists()
                    or Outbox.objects.filter(published_at__isnull=True).exists()
                    or QueueMessage.objects.exists()
                    or Job.objects.filter(state__in=["pending", "running"]).exists()
                )
            finally:
                connection.close()
            if not busy:
                drained = True
                break
            if time.monotonic() - last_report > 10:
                last_report = time.monotonic()
                print(f"soak: draining, waiting for {waiting()}", flush=True)
            time.sleep(1)
        drain_seconds = time.monotonic() - drain_started
        fleet.reap(restart=False)
        stop_codes = fleet.stop()
        web.send_signal(signal.SIGTERM)
        stop_codes["web"] = web.wait(30)
        receiver.stop()

        out = outbound_ledger(cfg, tenant.id, receiver, paths)
        if pub.error:
            out["problems"].insert(0, f"the publisher stopped: {pub.error}")
            out["lost"] += cfg.events - pub.committed
        inbound = inbound_ledger(sent)
        jobs = jobs_ledger(cfg, queued, fleet.job_logs)
        chaos = {
            "kills": dict(fleet.kills),
            "armed": dict(fleet.armed),
            "fault_deaths": dict(fleet.fault_deaths),
            "pg_restarts": pg_restarts,
            "terminated": terminated,
            "rolled_back": pub.rolled_back,
            "publish_db_errors": pub.db_errors,
            "unexpected_exits": fleet.unexpected,
            "stop_codes": stop_codes,
            "drained": drained,
            "drain_seconds": drain_seconds,
            "total_seconds": time.monotonic() - started,
        }
        print_ledger(out, chaos, inbound, jobs, cfg)
        ok = (
            drained
            and out["balanced"]
            and out["lost"] == 0
            and out["unexpected"] == 0
            and out["in_flight"] == 0
            and out["bad_signatures"] == 0
            and not inbound["problems"]
            and not jobs["problems"]
            and jobs["lost"] == 0
            and jobs["unexpected"] == 0
            and jobs["overlaps"] == 0
            and jobs["done"] + jobs["dead_by_policy"] == jobs["enqueued"] == cfg.jobs
            and not fleet.unexpected
            and all(code == 0 for code in stop_codes.values())
            and pg_restarts == 1
        )
        if cfg.json_path:
            Path(cfg.json_path).write_text(
                json.dumps(
                    {
                        "ok": ok,
                        "seed": cfg.seed,
                        "outbound": out,
                        "inbound": inbound,
                        "jobs": jobs,
                        "chaos": chaos,
                    },
                    default=str,
                    indent=2,
                )
            )
        print("soak: PASS" if ok else "soak: FAIL (the ledger does not balance)", flush=True)
        return 0 if ok else 1
    finally:
        for p in fleet.procs.values() if fleet else []:
            if p.popen.poll() is None:
                p.popen.kill()
        if web is not None and web.poll() is None:
            web.terminate()  # the master stops its workers
            try:
                web.wait(20)
            except subprocess.TimeoutExpired:
                web.kill()
        cluster.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--rate", type=float, default=None, help="events published per second")
    parser.add_argument("--kill-every", type=float, nargs=2, default=None, metavar=("MIN", "MAX"))
    parser.add_argument("--fault-rate", type=float, default=0.4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--inbound", type=int, default=None, help="inbound events (events / 10)")
    parser.add_argument("--jobs", type=int, default=None, help="background jobs (events / 4)")
    parser.add_argument("--job-workers", type=int, default=2, help="run_jobs processes")
    parser.add_argument("--drain-timeout", type=float, default=600)
    parser.add_argument("--short", action="store_true", help="the test suite's settings")
    parser.add_argument("--json", dest="json_path", default=None)
    a = parser.parse_args(argv)
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1, 10**6)
    cfg = Config(
        events=a.events,
        seed=seed,
        rate=a.rate or (100.0 if a.short else 150.0),
        # --short publishes for about 8 s: a kill every 0.5-1.5 s makes at least five,
        # enough for the first round to reach every kind of process.
        kill_every=tuple(a.kill_every or ((0.5, 1.5) if a.short else (2.0, 6.0))),
        fault_rate=a.fault_rate,
        workers=a.workers,
        inbound=a.inbound if a.inbound is not None else max(50, a.events // 10),
        jobs=a.jobs if a.jobs is not None else max(100, a.events // 4),
        job_workers=a.job_workers,
        drain_timeout=a.drain_timeout,
        json_path=a.json_path,
    )
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
