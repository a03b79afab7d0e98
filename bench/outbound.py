"""Outbound throughput: the whole delivery pipeline against a bare aiohttp POST loop.

One run (``make bench``, or ``python bench/outbound.py --events 20000 --repeat 3``):

1. A dedicated PostgreSQL database (``webhooks_bench`` next to the one in
   ``DATABASE_URL``), created if missing and migrated.
2. One receiver process (``bench/receiver.py``) on 127.0.0.1; both measurements below
   post to it.
3. ``--repeat`` times, alternating:

   * **bare**: ``--events`` POSTs of the same 1 KiB JSON body from one aiohttp
     ``ClientSession`` (keep-alive), once at each ``--concurrency`` (requests in flight;
     64 and 256 unless given); the faster of them is the repeat's bare loop
     (``best_bare``);
   * **service**: truncate the delivery tables, publish ``--events`` events to one
     endpoint with ``deliveries.services.publish_event`` (transactions of 1000; timed on
     its own as the publish rate), then start the real ``run_scheduler`` and
     ``run_workers`` processes (and ``run_relay`` with a broker outside the database,
     ``--env QUEUE_BROKER_CLASS=…``) and time from their start until every delivery is
     ``succeeded``. The receiver must have seen every delivery id; failing that, the run
     fails loudly.

4. Medians, their ratio (service / bare), the requests in flight of each repeat's bare
   loop, CPU seconds spent by each process (and by the
   PostgreSQL backends of each, by ``application_name``) go to
   ``bench/results/outbound.json`` and a Markdown table on stdout.

The pipeline is deployed as docs/deployment.md says (one ``run_workers`` per core) with
the product's default settings unless given: ``--workers``,
``--lanes``, ``--batch-size``, ``--worker-concurrency``, and ``--env NAME=VALUE`` for any
setting read from the environment (``SCHEDULER_PAGE_SIZE``, ``RELAY_INTERVAL``, ...).
``--py-spy DIR`` records a py-spy profile of every pipeline process during the last
service run (py-spy is pinned in requirements/bench.txt).
"""

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PUBLISH_BATCH = 1000
BODY_SIZE = 1024
POLL_SECONDS = 0.5
# The state counts of the timeline are read every this many polls.
TIMELINE_EVERY = 2
# Whether any delivery is not finished yet: one probe of delivery_state_created.
_UNFINISHED_SQL = """
SELECT count(*) FROM (
    SELECT 1 FROM deliveries_delivery WHERE state IN ('pending', 'enqueued', 'leased') LIMIT 1
) AS t
"""
CLK_TCK = os.sysconf("SC_CLK_TCK")

# Every table receiving and processing inbound events writes; emptied before each
# inbound run (bench/ingest.py, run.py's inbound scenario).
INBOUND_TABLES = (
    "ingest_inboundevent",
    "ingest_handlerrun",
    "ingest_entityversion",
    "ingest_verificationfailure",
    "deliveries_outbox",
    "deliveries_queuemessage",
    "deliveries_entitylock",
)
# Every table the deliveries app writes; emptied before each service run.
DELIVERY_TABLES = (
    "deliveries_attempt",
    "deliveries_outbox",
    "deliveries_queuemessage",
    "deliveries_deliverylisting",
    "deliveries_delivery",
    "deliveries_event",
    "deliveries_endpointthrottle",
    "deliveries_endpointsecret",
    "deliveries_endpoint",
    "deliveries_apikey",
    "deliveries_entitylock",
    "deliveries_looprun",
    "deliveries_tenant",
)


class BenchError(RuntimeError):
    """A run that did not do what it must (lost or failed deliveries, a dead child, a
    timeout): the figures would be meaningless, so the benchmark stops."""


# --- Processes -----------------------------------------------------------------------

_children: list[subprocess.Popen] = []


def _die_with_parent() -> None:
    # Linux: the child gets SIGTERM if the benchmark itself is killed (even with -9).
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def spawn(argv: list[str], *, env: dict, log: Path | None = None, **kw) -> subprocess.Popen:
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 - closed by stop()
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdout=kw.pop("stdout", out),
        stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
        preexec_fn=_die_with_parent,
        start_new_session=True,
        **kw,
    )
    proc._bench_log = out  # type: ignore[attr-defined]
    _children.append(proc)
    return proc


def stop(procs: list[subprocess.Popen], *, grace: float = 15.0) -> None:
    """SIGTERM (the loops finish their unit of work), then SIGKILL after ``grace``."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait()
        log = getattr(p, "_bench_log", None)
        if log not in (None, subprocess.DEVNULL):
            log.close()
        if p in _children:
            _children.remove(p)


def stop_all(*_args) -> None:
    stop(list(_children), grace=5.0)


def proc_cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a process (all its threads); 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def child_pids(parent: int) -> set[int]:
    """The pids of the live processes whose parent is ``parent``."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == parent:
                    found.add(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return found


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies over all cores since boot."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + parts[4]
    return sum(parts) - idle, sum(parts)


def postgres_cpu_seconds(*, reaped: bool = False) -> float:
    """CPU of every PostgreSQL server process on the machine (backends, WAL writer,
    checkpointer, autovacuum; other databases' too, so run on a quiet machine). With
    ``reaped``, also the backends that have exited since the server started (the time of
    the children it reaped, which the postmaster keeps): for a measurement whose
    connections close before it is read."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/comm") as f:
                if not f.read().startswith("postgres"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in fields[11 : 15 if reaped else 13]) / CLK_TCK
    return total


def database_backends_cpu(database: str) -> dict[int, float]:
    """CPU seconds of each live PostgreSQL backend connected to ``database``, by pid,
    found by its process title (``postgres: [cluster:] user database host(port)
    state``): exact for one database's work on a server that other databases share."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].split()
        except OSError:
            continue
        words = [w for w in title[1:] if not w.endswith(b":")]  # the cluster's name
        if title[:1] == [b"postgres:"] and words[1:2] == [database.encode()]:
            out[int(entry)] = proc_cpu_seconds(int(entry))
    return out


# --- Database ------------------------------------------------------------------------


def with_db(url: str, name: str, application_name: str | None = None) -> str:
    parts = urlsplit(url)
    query = f"application_name={application_name}" if application_name else ""
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, query, ""))


def ensure_database(base_url: str, name: str) -> None:
    import psycopg

    conninfo = urlunsplit(urlsplit(base_url)._replace(query="", fragment=""))
    try:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
                return
            owner = urlsplit(base_url).username or "webhooks"
            conn.execute(f'CREATE DATABASE "{name}" OWNER "{owner}"')
            return
    except psycopg.Error as exc:
        first_error = exc
    # The service role may lack CREATEDB; the local superuser trusts local connections.
    parts = urlsplit(base_url)
    host, port = parts.hostname or "127.0.0.1", str(parts.port or 5432)
    create = f'CREATE DATABASE "{name}" OWNER "{parts.username or "webhooks"}"'
    psql = ["psql", "-X", "-q", "-h", host, "-p", port, "-U", "postgres", "-d", "postgres"]
    done = subprocess.run(
        [*psql, "-c", create],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise BenchError(f"cannot create database {name}: {first_error}; {done.stderr.strip()}")


def migrate(env: dict) -> None:
    done = subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise BenchError(f"migrate failed:\n{done.stdout}\n{done.stderr}")


def setup_django(db_url: str) -> None:
    os.environ["DATABASE_URL"] = db_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    os.environ["EGRESS_ALLOW_NETWORKS"] = "127.0.0.0/8"
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()


def sql(query: str, params: list | None = None) -> list[tuple]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(query, params or [])
        return cursor.fetchall() if cursor.description else []


def truncate() -> None:
    sql(f"TRUNCATE {', '.join(DELIVERY_TABLES)} RESTART IDENTITY CASCADE")


def truncate_inbound() -> None:
    sql(f"TRUNCATE {', '.join(INBOUND_TABLES)} CASCADE")


# --- Payloads ------------------------------------------------------------------------


def payload(seq: int) -> dict:
    """A JSON payload that ``encode_payload`` turns into exactly BODY_SIZE bytes."""
    from deliveries.services import encode_payload

    base = {"type": "bench.event", "seq": seq, "data": ""}
    pad = BODY_SIZE - len(encode_payload(base))
    base["data"] = "x" * pad
    assert len(encode_payload(base)) == BODY_SIZE
    return base


# --- Receiver ------------------------------------------------------------------------


@dataclass
class Receiver:
    proc: subprocess.Popen
    port: int

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def counts(self) -> dict:
        with urllib.request.urlopen(self.url("/count"), timeout=10) as r:  # noqa: S310
            return json.loads(r.read())

    def reset(self) -> None:
        req = urllib.request.Request(self.url("/reset"), method="POST", data=b"")  # noqa: S310
        with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310
            r.read()

    def cpu(self) -> float:
        return proc_cpu_seconds(self.proc.pid)


def start_receiver(cpu: int | None) -> Receiver:
    argv = [sys.executable, str(ROOT / "bench" / "receiver.py"), "--port", "0"]
    if cpu is not None:
        argv += ["--cpu", str(cpu)]
    proc = spawn(argv, env=dict(os.environ), stdout=subprocess.PIPE)
    line = proc.stdout.readline().decode().strip()
    if not line.startswith("listening "):
        raise BenchError(f"receiver did not start: {line!r}")
    return Receiver(proc, int(line.split()[1]))


# --- Bare loop -----------------------------------------------------------------------

# Requests in flight in the bare loop. Every repeat runs it at each of these, and the
# faster run is that repeat's bare loop (``best_bare``): which count is faster moves with
# the machine, and a baseline held back by its own client's concurrency would flatter
# every ratio taken against it.
BARE_CONCURRENCIES = (64, 256)


def best_bare(runs: list[dict]) -> dict:
    """The bare loop of one repeat: the fastest of ``runs`` (``run_bare`` at each of
    BARE_CONCURRENCIES, each with its ``concurrency`` and ``per_second``), the baseline
    every outbound ratio and the CPU per request of that repeat are taken from. The run
    itself, its CPU figures included, with ``rates_by_concurrency``: the rate of every run
    it was picked from. A run without a rate is never picked unless none has one; on a
    tie the first run wins."""
    if not runs:
        raise ValueError("no bare loop run to pick from")
    rated = [r for r in runs if r.get("per_second")] or runs[:1]
    best = max(rated, key=lambda r: r.get("per_second") or 0)
    rates = {str(r["concurrency"]): r.get("per_second") for r in runs}
    return {**best, "rates_by_concurrency": rates}


async def _bare(url: str, body: bytes, n: int, concurrency: int) -> dict:
    import aiohttp

    statuses: dict[int, int] = {}
    remaining = n

    async def one_sender(session: aiohttp.ClientSession) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            async with session.post(
                url, data=body, headers={"content-type": "application/json"}
            ) as response:
                await response.read()
                statuses[response.status] = statuses.get(response.status, 0) + 1

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.perf_counter()
        await asyncio.gather(*(one_sender(session) for _ in range(concurrency)))
        seconds = time.perf_counter() - started
    return {"seconds": seconds, "statuses": statuses}


async def _signed(url: str, body: bytes, n: int, concurrency: int) -> dict:
    """The bare loop's N POSTs, each sent the way the worker sends a delivery: its headers
    (``deliveries.signing.delivery_headers``: a fresh timestamp and Standard Webhooks
    signature per request, a distinct ``webhook-id``) through ``deliveries.core.egress`` with
    its checks, capped reading and pool, on 127.0.0.0/8 only. No database, no lease, no
    recording: what the request itself costs the client."""
    from ipaddress import ip_network

    from bench.peers.common import SECRET  # the peers' bench secret: one for every signer
    from deliveries.core.egress import EgressPolicy, EgressSession
    from deliveries.signing import delivery_headers

    statuses: dict[int, int] = {}
    # The ids exist before the clock starts, as a leased delivery's id does.
    ids = [f"01000000-0000-7000-8000-{i:012d}" for i in range(n)]
    secrets = [SECRET]
    policy = EgressPolicy(allow_networks=(ip_network("127.0.0.0/8"),))

    async def one_sender(egress: EgressSession) -> None:
        while ids:
            msg_id = ids.pop()
            headers = delivery_headers(
                {}, secrets, msg_id=msg_id, timestamp=int(time.time()), body=body
            )
            response = await egress.post(url, body=body, headers=headers, timeout=30.0)
            statuses[response.status] = statuses.get(response.status, 0) + 1

    async with EgressSession(policy, pool_size=concurrency) as egress:
        started = time.perf_counter()
        await asyncio.gather(*(one_sender(egress) for _ in range(concurrency)))
        seconds = time.perf_counter() - started
    return {"seconds": seconds, "statuses": statuses}


def run_bare(receiver: Receiver, n: int, concurrency: int, *, signed: bool = False) -> dict:
    """The bare loop (``signed``: the signed, checked loop of ``_signed``) against the
    receiver, with its CPU and the receiver's."""
    from deliveries.services import encode_payload

    body = encode_payload(payload(0))
    receiver.reset()
    cpu_self, cpu_recv = proc_cpu_seconds(os.getpid()), receiver.cpu()
    busy0, total0 = machine_cpu()
    loop = _signed if signed else _bare
    out = asyncio.run(loop(receiver.url("/signed" if signed else "/bare"), body, n, concurrency))
    busy1, total1 = machine_cpu()
    client = proc_cpu_seconds(os.getpid()) - cpu_self
    receiver_cpu = receiver.cpu() - cpu_recv
    counts = receiver.counts()
    distinct = counts["distinct_webhook_ids"] == (n if signed else 0)
    if out["statuses"] != {200: n} or counts["requests"] != n or not distinct:
        label = "signed loop" if signed else "bare loop"
        raise BenchError(f"{label}: statuses {out['statuses']}, receiver counted {counts}")
    return {
        "concurrency": concurrency,
        "seconds": round(out["seconds"], 3),
        "per_second": round(n / out["seconds"], 1),
        "receiver_requests": counts["requests"],
        "cpu_seconds": {"client": round(client, 2), "receiver": round(receiver_cpu, 2)},
        "machine_cpu_busy": round((busy1 - busy0) / max(1, total1 - total0), 3),
        "other_cpu_seconds": _other_cpu(busy1 - busy0, [client, receiver_cpu]),
    }


def _other_cpu(busy_jiffies: int, ours: list[float]) -> float:
    """Machine CPU seconds not spent by the measured processes: kernel work on their
    behalf, but also anything else running (another test suite skews the figures)."""
    return round(busy_jiffies / CLK_TCK - sum(ours), 2)


# --- Service -------------------------------------------------------------------------


@dataclass
class Pipeline:
    """The service's processes; a flag left None is the product's default."""

    workers: int
    lanes: int | None
    batch_size: int | None
    worker_concurrency: int | None
    env: dict = field(default_factory=dict)

    def commands(self) -> list[tuple[str, list[str]]]:
        manage = [sys.executable, "manage.py"]
        out = [("scheduler", [*manage, "run_scheduler"])]
        broker = {**os.environ, **self.env}.get("QUEUE_BROKER_CLASS", "")
        if broker and not broker.endswith(".DatabaseBroker"):
            # The database broker's workers take the outbox themselves: no relay.
            out.append(("relay", [*manage, "run_relay"]))
        worker = [*manage, "run_workers"]
        if self.lanes:
            worker += ["--lanes", str(self.lanes)]
        if self.batch_size:
            worker += ["--batch-size", str(self.batch_size)]
        if self.worker_concurrency:
            worker += ["--concurrency", str(self.worker_concurrency)]
        out += [(f"workers{i}", worker) for i in range(self.workers)]
        return out


@dataclass
class FloorPipeline:
    """bench/floor.py's processes in the service's places: the service's statements with
    the least Python around them (one scheduler and ``workers`` worker processes of
    ``lanes`` connections taking ``batch`` outbox rows each; no relay, as the service
    runs none with the database broker)."""

    workers: int
    lanes: int = 2
    batch: int = 128
    options: tuple[str, ...] = ()  # floor.py worker flags: "egress", "db-thread"
    env: dict = field(default_factory=dict)

    def commands(self) -> list[tuple[str, list[str]]]:
        floor = [sys.executable, str(ROOT / "bench" / "floor.py")]
        worker = [*floor, "worker", "--lanes", str(self.lanes), "--batch", str(self.batch)]
        worker += [f"--{option}" for option in self.options]
        return [
            ("floor-scheduler", [*floor, "scheduler"]),
            *[(f"floor-workers{i}", worker) for i in range(self.workers)],
        ]


@dataclass(frozen=True)
class Layout:
    """Who the N events go to: ``tenants`` tenants with ``endpoints`` endpoints each, the
    events dealt round-robin, one delivery each (every endpoint subscribes to an event
    type of its own). The default is one tenant with one endpoint: a single hot
    endpoint, as every peer is measured."""

    tenants: int = 1
    endpoints: int = 1

    def __post_init__(self) -> None:
        if self.tenants < 1 or self.endpoints < 1:
            raise ValueError("a layout needs at least one tenant and one endpoint")


def publish(n: int, url: str, layout: Layout = Layout()) -> dict:
    from django.db import transaction

    from deliveries.models import Tenant
    from deliveries.services import endpoint_create, publish_event

    targets = []  # (tenant, event type), one per endpoint
    for t in range(layout.tenants):
        tenant = Tenant.objects.create(name="bench" if t == 0 else f"bench-{t}")
        for e in range(layout.endpoints):
            event_type = "bench.event" if t == e == 0 else f"bench.event.{t}.{e}"
            # One endpoint alone takes every event type, as the product's default does.
            subscribed = [event_type] if layout != Layout() else []
            endpoint_create(tenant=tenant, url=url, event_types=subscribed)
            targets.append((tenant, event_type))
    bodies = [payload(i) for i in range(n)]
    started = time.perf_counter()
    for start in range(0, n, PUBLISH_BATCH):
        with transaction.atomic():
            for i in range(start, min(n, start + PUBLISH_BATCH)):
                tenant, event_type = targets[i % len(targets)]
                publish_event(tenant=tenant, event_type=event_type, payload=bodies[i])
    seconds = time.perf_counter() - started
    analyze()
    return {"seconds": round(seconds, 3), "per_second": round(n / seconds, 1)}


def analyze() -> None:
    # A steady-state table has statistics; a freshly truncated one does not. Without
    # this, the first plans of the run are made for an empty table.
    sql("ANALYZE deliveries_delivery, deliveries_event, deliveries_endpoint")


# The rows publishing wrote, copied aside so that later repeats start from the very same
# state without paying for publishing again (unless --publish-every-run).
SNAPSHOT_TABLES = (
    "deliveries_tenant",
    "deliveries_endpoint",
    "deliveries_endpointsecret",
    "deliveries_event",
    "deliveries_delivery",
)


def snapshot_save() -> None:
    for table in SNAPSHOT_TABLES:
        sql(f"DROP TABLE IF EXISTS bench_snapshot_{table}")
        sql(f"CREATE TABLE bench_snapshot_{table} AS SELECT * FROM {table}")


def snapshot_restore(url: str) -> None:
    truncate()
    for table in SNAPSHOT_TABLES:
        sql(f"INSERT INTO {table} SELECT * FROM bench_snapshot_{table}")
    sql("UPDATE deliveries_endpoint SET url = %s", [url])
    analyze()


def take_out_published() -> None:
    """Empty the delivery table while the pipeline's processes start (a service runs
    continuously, so process start-up is not delivery time); the snapshot keeps the rows
    and ``release_published`` writes them back. The table's statistics stay from the
    last ANALYZE."""
    sql("TRUNCATE deliveries_delivery, deliveries_deliverylisting CASCADE")


def release_published() -> None:
    """Write the published deliveries back, due, in one transaction that wakes the
    scheduler, as a burst of publishes does: each row one version, as ``publish_event``
    leaves it, and listed by the table's trigger. (Parking the rows and making them due
    with two UPDATEs instead would leave three versions of each, and three entries in
    every index, which no publish leaves.)"""
    from django.db import transaction

    from deliveries.jobs import wakeup

    with transaction.atomic():
        sql("INSERT INTO deliveries_delivery SELECT * FROM bench_snapshot_deliveries_delivery")
        wakeup.notify(wakeup.DUE)


def snapshot_shape() -> tuple[int, Layout | None, int]:
    """Deliveries in the saved snapshot, the layout they were published to and their
    body size (0, None, 0: none saved)."""
    if not sql("SELECT to_regclass('bench_snapshot_deliveries_delivery')")[0][0]:
        return 0, None, 0
    deliveries = sql("SELECT count(*) FROM bench_snapshot_deliveries_delivery")[0][0]
    tenants, endpoints = sql(
        "SELECT count(DISTINCT tenant_id), count(*) FROM bench_snapshot_deliveries_endpoint"
    )[0]
    body = sql("SELECT coalesce(max(length(body)), 0) FROM bench_snapshot_deliveries_event")
    return deliveries, Layout(tenants, endpoints // max(1, tenants)), body[0][0]


def backend_cpu_by_app(db_name: str) -> dict[str, float]:
    """CPU seconds of this database's live backends, summed by application_name."""
    out: dict[str, float] = {}
    for pid, app in sql(
        "SELECT pid, application_name FROM pg_stat_activity WHERE datname = %s", [db_name]
    ):
        out[app or "?"] = out.get(app or "?", 0.0) + proc_cpu_seconds(pid)
    return out


def attempts_by_process(procs: list[tuple[str, subprocess.Popen]]) -> dict[str, int]:
    """The attempts each worker process made, by its role: an attempt row records its
    worker's ``host:pid``. A name no process here has is kept as it is."""
    roles = {p.pid: role for role, p in procs}
    out = {}
    for worker, count in sql("SELECT worker, count(*) FROM deliveries_attempt GROUP BY worker"):
        pid = worker.rpartition(":")[2]
        out[roles.get(int(pid), worker) if pid.isdigit() else worker] = count
    return dict(sorted(out.items()))


def pipeline_env(base_url: str, db_name: str, role: str, extra: dict) -> dict:
    """A pipeline process's environment: the product's defaults but for ``extra``, its
    database connection named after its role (``application_name``, by which its
    backends' CPU is counted), and the receiver's loopback network let through the
    egress guard, which refuses it by default."""
    return {
        **os.environ,
        **extra,
        "DATABASE_URL": with_db(base_url, db_name, f"bench-{role}"),
        "EGRESS_ALLOW_NETWORKS": "127.0.0.0/8",
    }


def run_service(
    receiver: Receiver,
    n: int,
    pipeline: Pipeline,
    *,
    db_name: str,
    base_url: str,
    timeout: float,
    logs: Path,
    py_spy: Path | None,
    py_spy_mode: str = "gil",
    fresh_publish: bool = True,
    layout: Layout = Layout(),
    hook: str = "/hook",
) -> dict:
    if fresh_publish:
        truncate()
        pub = publish(n, receiver.url(hook), layout)
        snapshot_save()
    else:
        snapshot_restore(receiver.url(hook))
        pub = {"seconds": None, "per_second": None}
    receiver.reset()
    take_out_published()
    sql("DELETE FROM deliveries_looprun")
    procs: list[tuple[str, subprocess.Popen]] = []
    spies: list[subprocess.Popen] = []
    timeline: list[tuple[float, dict]] = []
    started = time.perf_counter()
    try:
        for role, argv in pipeline.commands():
            env = pipeline_env(base_url, db_name, role, pipeline.env)
            procs.append((role, spawn(argv, env=env, log=logs / f"{role}.log")))
        if py_spy:
            spies = [
                spawn(
                    [shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")]
                    + ["record", "--nonblocking", "--threads", "--format", "raw"]
                    + _PY_SPY_MODES[py_spy_mode]
                    + ["-r", "200", "-o", str(py_spy / f"{role}.txt"), "--pid", str(p.pid)],
                    env=dict(os.environ),
                    log=logs / f"py-spy-{role}.log",
                )
                for role, p in procs
            ]
        startup = _wait_until_running(procs, started + 60)
        # CPU from here on: the drain's, not the processes' start-up (imports, Django's
        # set-up and checks: about 0.8 s of CPU each, which spread over N would read as
        # tens of microseconds per delivery).
        proc_cpu0 = {role: proc_cpu_seconds(p.pid) for role, p in procs}
        bench_app_cpu = backend_cpu_by_app(db_name)
        cpu_recv, cpu_self = receiver.cpu(), proc_cpu_seconds(os.getpid())
        pg0 = postgres_cpu_seconds()
        busy0, total0 = machine_cpu()
        # The clock starts when the release commits (the scheduler cannot see the rows
        # before) and stops at the last delivery's finished_at, which the worker stamps
        # when it records the success: both read this machine's clock, so the poll
        # below only has to notice the end, and it does so with a probe of one index
        # entry, not a count of N rows (the bench's own queries compete for the same
        # two cores; a GROUP BY over N rows every POLL_SECONDS cost about 4% of the
        # run's CPU). The state counts of the timeline are read every TIMELINE_EVERY.
        release_published()
        released_at = time.time()
        # The release is the bench's doing, not the pipeline's: its backend's CPU counts
        # from here.
        bench_app_cpu["bench-ctl"] = backend_cpu_by_app(db_name).get("bench-ctl", 0.0)
        started = time.perf_counter()
        deadline = started + timeout
        polls = 0
        while True:
            time.sleep(POLL_SECONDS)
            polls += 1
            now = time.perf_counter() - started
            unfinished = sql(_UNFINISHED_SQL)[0][0]
            if polls % TIMELINE_EVERY == 0 or not unfinished:
                states = dict(sql("SELECT state, count(*) FROM deliveries_delivery GROUP BY state"))
                timeline.append((round(now, 2), states))
                if states.get("dead"):
                    raise BenchError(f"{states['dead']} deliveries went dead: {states}")
            if not unfinished:
                break
            for role, p in procs:
                if p.poll() is not None:
                    raise BenchError(f"{role} exited with {p.returncode} mid-run")
            if time.perf_counter() > deadline:
                raise BenchError(f"not drained after {timeout:.0f} s: {timeline[-1:]}")
        first, last = sql(
            "SELECT extract(epoch FROM min(finished_at)), extract(epoch FROM max(finished_at))"
            " FROM deliveries_delivery WHERE state = 'succeeded'"
        )[0]
        seconds = float(last) - released_at
        first_success = float(first) - released_at
        busy1, total1 = machine_cpu()
        cpu = {role: round(proc_cpu_seconds(p.pid) - proc_cpu0[role], 2) for role, p in procs}
        backend = backend_cpu_by_app(db_name)
        backend = {
            app: round(s - bench_app_cpu.get(app, 0.0), 2) for app, s in sorted(backend.items())
        }
        pg = postgres_cpu_seconds() - pg0
        recv_cpu = receiver.cpu() - cpu_recv
        cpu["bench_poller"] = round(proc_cpu_seconds(os.getpid()) - cpu_self, 2)
    finally:
        stop([p for _, p in procs])
        stop(spies, grace=30)
    outputs = {role: (logs / f"{role}.log").read_text()[-2000:].strip() for role, _ in procs}

    counts = receiver.counts()
    succeeded = sql("SELECT count(*) FROM deliveries_delivery WHERE state = 'succeeded'")[0][0]
    attempts = sql("SELECT count(*) FROM deliveries_attempt")[0][0]
    by_worker = attempts_by_process(procs)
    if succeeded != n or counts["distinct_webhook_ids"] < n or counts["requests"] < n:
        raise BenchError(f"service: {succeeded} of {n} succeeded; receiver counted {counts}")
    steady = round(n / (seconds - first_success), 1) if seconds > first_success else None
    return {
        "startup_seconds": round(startup, 2),
        "seconds": round(seconds, 3),
        "per_second": round(n / seconds, 1),
        "first_success_after": round(first_success, 2),
        "per_second_after_first_success": steady,
        "publish_seconds": pub["seconds"],
        "publish_per_second": pub["per_second"],
        "receiver_requests": counts["requests"],
        "duplicates": counts["requests"] - n,
        "attempts": attempts,
        "attempts_by_worker": by_worker,
        "cpu_seconds": {
            **cpu,
            "receiver": round(recv_cpu, 2),
            # Backends of this run's processes, by application_name (exact), and every
            # PostgreSQL process on the machine (with the WAL writer, the checkpointer,
            # autovacuum, and other databases' backends: inexact on a shared server).
            "postgres_by_app": backend,
            "postgres_backends": round(sum(backend.values()), 2),
            "postgres_all": round(pg, 2),
        },
        "machine_cpu_busy": round((busy1 - busy0) / max(1, total1 - total0), 3),
        "other_cpu_seconds": _other_cpu(
            busy1 - busy0, [*cpu.values(), recv_cpu, sum(backend.values())]
        ),
        "process_output": {
            role: text.splitlines()[-1] if text else "" for role, text in outputs.items()
        },
        "timeline": _thin(timeline, 40),
    }


def _wait_until_running(procs: list, deadline: float) -> float:
    """Seconds until every pipeline process has recorded its run (LoopRun row), plus a
    short settle so the workers' event loops are up; the clock starts after this."""
    t0 = time.perf_counter()
    while sql("SELECT count(*) FROM deliveries_looprun WHERE finished_at IS NULL")[0][0] < len(
        procs
    ):
        for role, p in procs:
            if p.poll() is not None:
                raise BenchError(f"{role} exited with {p.returncode} during start-up")
        if time.perf_counter() > deadline:
            raise BenchError("the pipeline did not start within 60 s")
        time.sleep(0.1)
    time.sleep(0.5)
    return time.perf_counter() - t0


# py-spy sampling: "gil" samples the thread holding the GIL (where a GIL-bound process
# spends its Python CPU), "cpu" every thread that is not idle, "wall" every thread.
_PY_SPY_MODES = {"gil": ["--gil"], "cpu": [], "wall": ["--idle"]}


def _thin(timeline: list, keep: int) -> list:
    if len(timeline) <= keep:
        return timeline
    step = len(timeline) / keep
    picked = [timeline[int(i * step)] for i in range(keep)]
    return [*picked, timeline[-1]]


# --- Report --------------------------------------------------------------------------


def versions(db_name: str) -> dict:
    import aiohttp
    import django
    import psycopg

    return {
        "python": platform.python_version(),
        "django": django.get_version(),
        "aiohttp": aiohttp.__version__,
        "psycopg": psycopg.__version__,
        "postgres": sql("SHOW server_version")[0][0],
        "postgres_settings": dict(
            sql(
                "SELECT name, setting FROM pg_settings WHERE name IN ('shared_buffers', "
                "'synchronous_commit', 'fsync', 'max_connections', 'work_mem')"
            )
        ),
        "database": db_name,
    }


def foreign_share(run: dict, cpus: int) -> float:
    """Share of the machine's CPU that the measured processes did not use during a run:
    kernel work on their behalf plus anything else running (another test suite)."""
    return max(0.0, run["other_cpu_seconds"]) / (run["seconds"] * cpus)


def bare_loop_line(bare: list[dict]) -> str:
    """How each run's bare loop was picked (``best_bare``): the requests in flight of the
    faster, and every count's rate."""
    counts = " and ".join(str(c) for c in bare[0]["rates_by_concurrency"]) if bare else ""
    each = "; ".join(
        f"{b['concurrency']} ("
        + ", ".join(f"{c}: {r or 0:,.0f}/s" for c, r in b["rates_by_concurrency"].items())
        + ")"
        for b in bare
    )
    return (
        f"Bare loop: the faster of {counts} requests in flight in each run, the baseline "
        f"of that run's ratio. By run: {each}."
    )


def markdown(result: dict) -> str:
    cpus = result["cpu_count"]
    rows = [
        "| run | bare req/s (in flight) | service deliveries/s | ratio "
        "| service after 1st success/s | publish events/s | other CPU bare / service |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for i, (b, s) in enumerate(zip(result["bare"], result["service"], strict=False), 1):
        rows.append(
            f"| {i} | {b['per_second']:,.0f} ({b['concurrency']}) | {s['per_second']:,.0f} | "
            f"{s['per_second'] / b['per_second']:.2f} | "
            f"{s['per_second_after_first_success'] or 0:,.0f} | "
            + (f"{s['publish_per_second']:,.0f} | " if s["publish_per_second"] else "(restored) | ")
            + f"{foreign_share(b, cpus):.0%} / {foreign_share(s, cpus):.0%} |"
        )
    m = result["median"]
    rows.append(
        f"| **median** | **{m['bare_per_second']:,.0f}** | **{m['service_per_second']:,.0f}** | "
        f"**{m['ratio']:.2f}** (pairs: {m['ratio_of_pairs']:.2f}) | "
        f"{m['service_per_second_after_first_success']:,.0f} | "
        + (f"{m['publish_per_second']:,.0f} | |" if m["publish_per_second"] else "(reused) | |")
    )
    verdict = "meets" if result["meets_target"] else "DOES NOT meet"
    rows.append("")
    rows.append(bare_loop_line(result["bare"]))
    rows.append(
        f"N = {result['events']:,} events, {cpus} CPUs; target ratio >= "
        f"{result['target_ratio']} with N >= {result['target_events']:,}: {verdict}."
    )
    if result["floor"]:
        m = result["median"]
        rows.append(
            f"Statements floor (bench/floor.py: the service's SQL, the least Python): "
            f"{m['floor_per_second']:,.0f}/s, {m['floor_ratio']:.2f} of the bare loop."
        )
    busy = [foreign_share(r, cpus) for r in result["bare"] + result["service"]]
    if max(busy) > 0.1:
        rows.append(
            f"Warning: up to {max(busy):.0%} of the machine's CPU went to other processes "
            "during the runs; the figures are skewed, rerun on a quiet machine."
        )
    return "\n".join(rows)


def database_url() -> str:
    """``DATABASE_URL``, or the local server's (found or started by
    scripts/ensure_postgres.sh, as ``make test`` does)."""
    return (
        os.environ.get("DATABASE_URL")
        or subprocess.run(
            [str(ROOT / "scripts" / "ensure_postgres.sh")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )


def parse_env(items: list[str]) -> dict:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--env wants NAME=VALUE, got {item!r}")
        out[name] = value
    return out


def main(argv: list[str] | None = None) -> int:
    global BODY_SIZE  # --body-bytes: payload() and the bare loop's body read it
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000, help="N (default 20,000)")
    parser.add_argument(
        "--tenants", type=int, default=1, help="publish to this many tenants (default 1)"
    )
    parser.add_argument("--endpoints", type=int, default=1, help="endpoints per tenant (default 1)")
    parser.add_argument(
        "--body-bytes",
        type=int,
        default=BODY_SIZE,
        help=f"the JSON body of every request, bare and delivered (default {BODY_SIZE})",
    )
    parser.add_argument(
        "--flaky",
        action="store_true",
        help="the receiver answers 503 to the first copy of every delivery: each succeeds "
        "on its first retry (set DELIVERY_RETRY_SCHEDULE with --env to keep the wait short)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs of each; medians reported")
    parser.add_argument(
        "--concurrency",
        type=int,
        action="append",
        default=None,
        help="bare loop: requests in flight; repeat it to run the loop at each, the faster "
        "run being the repeat's baseline (default: "
        + " and ".join(str(c) for c in BARE_CONCURRENCIES)
        + ")",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="run_workers processes (default: one per core, as docs/deployment.md runs them)",
    )
    parser.add_argument("--lanes", type=int, default=None, help="run_workers --lanes")
    parser.add_argument("--batch-size", type=int, default=None, help="run_workers --batch-size")
    parser.add_argument("--worker-concurrency", type=int, default=None)
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="setting for the pipeline"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per drain")
    parser.add_argument("--db-name", default="webhooks_bench")
    parser.add_argument("--receiver-cpu", type=int, default=None, help="pin the receiver")
    parser.add_argument("--only", choices=("bare", "service", "floor"), default=None)
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also run bench/floor.py (the service's statements, bare) after the service",
    )
    parser.add_argument(
        "--floor-option",
        action="append",
        default=[],
        choices=("egress", "db-thread"),
        help="the floor's workers post through deliveries.core.egress, or run their statements "
        "on blocking connections in a thread pool, as the service's worker does",
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "outbound.json")
    parser.add_argument(
        "--py-spy",
        type=Path,
        default=None,
        metavar="DIR",
        help="record py-spy profiles (raw collapsed stacks) of the last service run here",
    )
    parser.add_argument("--py-spy-mode", choices=sorted(_PY_SPY_MODES), default="gil")
    parser.add_argument(
        "--publish-every-run",
        action="store_true",
        help="publish anew before every service run (default: publish once, then restore "
        "the published rows from a copy)",
    )
    parser.add_argument(
        "--reuse-published",
        action="store_true",
        help="start from the rows an earlier invocation published (same --events), if any: "
        "for iterating on pipeline settings",
    )
    args = parser.parse_args(argv)
    bare_concurrencies = tuple(args.concurrency or BARE_CONCURRENCIES)

    base_url = database_url()
    db_url = with_db(base_url, args.db_name, "bench-ctl")
    pipeline = Pipeline(
        workers=args.workers,
        lanes=args.lanes,
        batch_size=args.batch_size,
        worker_concurrency=args.worker_concurrency,
        env=parse_env(args.env),
    )
    layout = Layout(args.tenants, args.endpoints)
    BODY_SIZE = args.body_bytes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logs = Path(tempfile.mkdtemp(prefix="bench-outbound-"))
    if args.py_spy:
        args.py_spy.mkdir(parents=True, exist_ok=True)

    ensure_database(base_url, args.db_name)
    child_env = {**os.environ, "DATABASE_URL": db_url}
    migrate(child_env)
    setup_django(db_url)
    receiver = start_receiver(args.receiver_cpu)
    result: dict = {
        "benchmark": "outbound",
        "events": args.events,
        "layout": {"tenants": layout.tenants, "endpoints_per_tenant": layout.endpoints},
        "flaky": args.flaky,
        "body_bytes": BODY_SIZE,
        "repeat": args.repeat,
        "cpu_count": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "versions": versions(args.db_name),
        "bare_concurrencies": list(bare_concurrencies),
        "pipeline": {
            "workers": pipeline.workers,
            "lanes": pipeline.lanes,
            "batch_size": pipeline.batch_size,
            "worker_concurrency": pipeline.worker_concurrency,
            "env": pipeline.env,
        },
        "target_ratio": 0.5,
        "target_events": 20_000,
        # Per run, the faster bare loop (best_bare); every run at each count in bare_runs.
        "bare": [],
        "bare_runs": [],
        "service": [],
        "floor": [],
    }
    reuse = args.reuse_published and snapshot_shape() == (args.events, layout, BODY_SIZE)
    result["publish_reused_from_earlier_invocation"] = reuse
    try:

        def drain(i: int, which, *, first_publishes: bool) -> dict:
            run = run_service(
                receiver,
                args.events,
                which,
                db_name=args.db_name,
                base_url=base_url,
                timeout=args.timeout,
                logs=logs,
                py_spy=args.py_spy if i == args.repeat - 1 else None,
                py_spy_mode=args.py_spy_mode,
                fresh_publish=args.publish_every_run or (i == 0 and first_publishes),
                layout=layout,
                hook="/flaky/hook" if args.flaky else "/hook",
            )
            published = run["publish_per_second"]
            name = "floor" if which is not pipeline else "service"
            result[name].append(run)
            print(
                f"[{i + 1}/{args.repeat}] {name}: {run['per_second']:,.0f} deliveries/s "
                f"({run['seconds']:.1f} s"
                + (f"; publish {published:,.0f} events/s" if published else "")
                + f"; CPU s {json.dumps(run['cpu_seconds'])})",
                flush=True,
            )
            return run

        for i in range(args.repeat):
            if args.only != "service":
                runs = [run_bare(receiver, args.events, c) for c in bare_concurrencies]
                bare = best_bare(runs)
                result["bare_runs"].append(runs)
                result["bare"].append(bare)
                rates = ", ".join(f"{r['per_second']:,.0f} at {r['concurrency']}" for r in runs)
                print(f"[{i + 1}/{args.repeat}] bare: {rates} req/s", flush=True)
            if args.only in (None, "service"):
                drain(i, pipeline, first_publishes=not reuse)
            if args.only == "floor" or (args.floor and args.only is None):
                drain(
                    i,
                    FloorPipeline(workers=args.workers, options=tuple(args.floor_option)),
                    first_publishes=not reuse and args.only == "floor",
                )
    except BenchError as exc:
        print(f"FAILED: {exc}\nchild logs: {logs}", file=sys.stderr)
        return 1
    finally:
        stop_all()

    def median(runs: list[dict], key: str) -> float:
        values = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(values) if values else 0.0

    bare_ps = median(result["bare"], "per_second")
    service_ps = median(result["service"], "per_second")
    result["median"] = {
        # The median of each run's faster bare loop, and of the loop at each count.
        "bare_per_second": bare_ps,
        "bare_per_second_by_concurrency": {
            str(c): median(
                [r for runs in result["bare_runs"] for r in runs if r["concurrency"] == c],
                "per_second",
            )
            for c in bare_concurrencies
        },
        "service_per_second": service_ps,
        "ratio": round(service_ps / bare_ps, 3) if bare_ps else None,
        # Each service run against the bare run just before it: steadier than the ratio
        # of medians when the machine's load drifts.
        "ratio_of_pairs": round(
            statistics.median(
                s["per_second"] / b["per_second"]
                for b, s in zip(result["bare"], result["service"], strict=False)
            ),
            3,
        )
        if result["bare"] and result["service"]
        else None,
        "service_per_second_after_first_success": median(
            result["service"], "per_second_after_first_success"
        ),
        "publish_per_second": median(result["service"], "publish_per_second"),
        "floor_per_second": median(result["floor"], "per_second") or None,
    }
    if result["floor"] and bare_ps:
        result["median"]["floor_ratio"] = round(result["median"]["floor_per_second"] / bare_ps, 3)
    result["meets_target"] = bool(
        result["median"]["ratio"] is not None
        and result["median"]["ratio"] >= result["target_ratio"]
        and args.events >= result["target_events"]
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2, default=str) + "\n")
    if result["bare"] and result["service"]:
        print()
        print(markdown(result))
    print(f"\nresults: {args.output}")
    shutil.rmtree(logs, ignore_errors=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        stop_all()
        sys.exit(130)
