"""What every peer shares: the workloads, and the driver that times a peer's drain.

``--workload post`` (the default) is the service's: deliver a 1 KiB JSON body to the local receiver
(``bench/receiver.py``) in a POST signed the Standard Webhooks way (``webhook-id``,
``webhook-timestamp``, ``webhook-signature: v1,<base64 HMAC-SHA256 of id.timestamp.body>``,
keyed with the base64 part of a ``whsec_`` secret). Each job carries its payload (as an
application would enqueue it) and its message id; the task encodes, signs and posts it
over a keep-alive connection kept per worker process, and fails on any answer but 200.
``--workload noop`` is a job that does nothing but say it ran: its payload is
``{"seq": i}`` and its body ``mark_done(seq)``, which stamps the job's slot in a file
mapped into every worker's memory (``Marks``: the time it finished and a run count,
about a microsecond, the same for every system).

The driver (``drive``, ``measure``): reset the peer's queue, enqueue N jobs with no
worker running, reset the receiver (or the marks), start the peer's worker processes as
its documentation says, and wait until N distinct jobs have arrived (the receiver's
distinct ``webhook-id``s, or the marked slots); then stop the workers (SIGTERM to each
process group, SIGKILL after a grace) and print one JSON line: the enqueue time, the
drain time from the workers' start (start-up included) and the first and last arrival
(``N / (last - first)`` is the figure compared across systems, start-up excluded).
"""

import argparse
import base64
import contextlib
import ctypes
import hashlib
import hmac
import json
import mmap
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BODY_SIZE = 1024
# A fixed bench-only secret (not a credential: it signs requests to a local receiver).
SECRET = "whsec_" + base64.b64encode(b"bench-peers-secret-0123456789abc").decode()
_KEY = base64.b64decode(SECRET.removeprefix("whsec_"))
REDIS_DB = int(os.environ.get("BENCH_REDIS_DB", "7"))
REDIS_URL = f"redis://127.0.0.1:6379/{REDIS_DB}"
WORKLOADS = ("post", "noop")
# The task (or job type) name of each workload, the same in every system.
TASK_NAMES = {"post": "bench.deliver", "noop": "bench.noop"}
MARKS_ENV = "PEER_MARKS_FILE"
_DOUBLE = struct.Struct("d")


def payload(seq: int) -> dict:
    """A payload whose compact JSON encoding is exactly BODY_SIZE bytes."""
    base = {"type": "bench.event", "seq": seq, "data": ""}
    base["data"] = "x" * (BODY_SIZE - len(encode(base)))
    return base


def encode(data: dict) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


def signed_headers(msg_id: str, body: bytes) -> dict[str, str]:
    ts = str(int(time.time()))
    mac = hmac.new(_KEY, f"{msg_id}.{ts}.".encode() + body, hashlib.sha256).digest()
    return {
        "content-type": "application/json",
        "webhook-id": msg_id,
        "webhook-timestamp": ts,
        "webhook-signature": "v1," + base64.b64encode(mac).decode(),
    }


_session = None


def post_sync(url: str, data: dict, msg_id: str) -> None:
    """The synchronous task body (django-q2, Celery): one requests.Session per process."""
    global _session
    if _session is None:
        import requests

        _session = requests.Session()
    body = encode(data)
    response = _session.post(url, data=body, headers=signed_headers(msg_id, body), timeout=10)
    if response.status_code != 200:
        raise RuntimeError(f"receiver answered {response.status_code}")


def job_arguments(workload: str, seq: int) -> dict:
    """The keyword arguments of job ``seq``: what each system enqueues and its task gets."""
    if workload == "noop":
        return {"seq": seq}
    return {"data": payload(seq), "msg_id": f"msg_{seq}"}


class Marks:
    """Which no-op jobs have run, and when: a file of N float64 completion times
    (``time.time()``) followed by N one-byte run counts, mapped shared into the driver
    and every worker process. A job writes only its own slot, so no lock is needed;
    two copies of one job racing on its count byte could lose a count, which only ever
    hides a duplicate, never a job."""

    def __init__(self, path: Path, n: int) -> None:
        self.path, self.n = path, n
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 9 * n)

    @classmethod
    def create(cls, n: int, directory: Path | None = None) -> "Marks":
        # In the page cache: the workers' writes are memory writes.
        fd, name = tempfile.mkstemp(prefix="bench-marks-", dir=directory)
        os.ftruncate(fd, 9 * n)
        os.close(fd)
        return cls(Path(name), n)

    @classmethod
    def open(cls, path: str | Path) -> "Marks":
        return cls(Path(path), os.path.getsize(path) // 9)

    def mark(self, seq: int) -> None:
        _DOUBLE.pack_into(self._map, 8 * seq, time.time())
        count = 8 * self.n + seq
        self._map[count] = min(255, self._map[count] + 1)

    def done(self) -> int:
        return self.n - self._map[8 * self.n :].count(0)

    def counts(self) -> dict:
        """In the receiver's terms: runs, distinct jobs, first and last completion."""
        runs = self._map[8 * self.n :]
        times = [t for (t,) in _DOUBLE.iter_unpack(self._map[: 8 * self.n]) if t]
        return {
            "requests": sum(runs),
            "distinct_webhook_ids": self.n - runs.count(0),
            "first_at": min(times, default=None),
            "last_at": max(times, default=None),
        }

    def close(self, *, unlink: bool = False) -> None:
        self._map.close()
        if unlink:
            self.path.unlink(missing_ok=True)


_marks: Marks | None = None


def mark_done(seq: int) -> None:
    """The no-op job's body: stamp slot ``seq`` of the marks file the driver made."""
    global _marks
    if _marks is None:
        _marks = Marks.open(os.environ[MARKS_ENV])
    _marks.mark(seq)


async def post_async(session, url: str, data: dict | bytes, msg_id: str) -> None:
    """The asynchronous task body (procrastinate, the SKIP LOCKED baseline): aiohttp."""
    body = data if isinstance(data, bytes) else encode(data)
    async with session.post(url, data=body, headers=signed_headers(msg_id, body)) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"receiver answered {response.status}")


# --- Driver --------------------------------------------------------------------------


def arguments(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--receiver", required=True, help="http://127.0.0.1:PORT")
    parser.add_argument("--db-url", default=os.environ.get("PEER_DB_URL", ""))
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument(
        "--workload", choices=WORKLOADS, default="post", help="post: the signed POST; noop"
    )
    return parser


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def peer_env(**extra: str) -> dict:
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def receiver_counts(receiver: str) -> dict:
    with urllib.request.urlopen(receiver + "/count", timeout=10) as r:  # noqa: S310
        return json.loads(r.read())


def receiver_reset(receiver: str) -> None:
    req = urllib.request.Request(receiver + "/reset", method="POST", data=b"")  # noqa: S310
    with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310
        r.read()


def _tree_cpu(pgids: set[int]) -> float:
    """CPU seconds of the live processes in these process groups (workers and children)."""
    tck = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) in pgids:
            total += (int(fields[11]) + int(fields[12])) / tck
    return total


def drive(name: str, args: argparse.Namespace, **parts) -> int:
    """Time one peer's drain (``measure``, with its ``parts``: reset, enqueue, workers,
    env, settings) and print its figures as one JSON line."""
    print(json.dumps(measure(name, args, **parts)), flush=True)
    return 0


def measure(
    name: str,
    args: argparse.Namespace,
    *,
    reset: Callable[[], None],
    enqueue: Callable[[int], None],
    workers: list[list[str]],
    env: dict,
    settings: dict,
) -> dict:
    """Reset, enqueue ``args.events`` jobs of ``args.workload`` with no worker running,
    start ``workers``, wait for every job to arrive, stop them; the run's figures."""
    from urllib.parse import urlsplit

    from bench.outbound import database_backends_cpu

    n, workload = args.events, getattr(args, "workload", "post")
    database = urlsplit(args.db_url).path.lstrip("/")
    reset()
    t0 = time.perf_counter()
    enqueue(n)
    enqueue_seconds = time.perf_counter() - t0
    marks = Marks.create(n) if workload == "noop" else None
    if marks:
        env = {**env, MARKS_ENV: str(marks.path)}
        progress = marks.counts
    else:
        receiver_reset(args.receiver)

        def progress() -> dict:
            return receiver_counts(args.receiver)

    procs = []
    logs = []
    pg0 = database_backends_cpu(database)
    started = time.perf_counter()
    try:
        for i, argv in enumerate(workers):
            log = open(args.logs / f"peer-{name}-{i}.log", "wb")  # noqa: SIM115
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    argv,
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
            )
        deadline = started + args.timeout
        cpu = 0.0
        # At the first look that finds a job arrived: (jobs arrived, workers' CPU, the
        # backends' CPU), the start of the steady figures (start-up left out).
        first = None
        while True:
            time.sleep(0.1)
            arrived = marks.done() if marks else progress()["distinct_webhook_ids"]
            if arrived >= n:
                break
            if first is None and arrived:
                pids = {p.pid for p in procs}
                first = (arrived, _tree_cpu(pids), database_backends_cpu(database))
            dead = [p.returncode for p in procs if p.poll() is not None]
            if dead:  # a worker that stopped: every job may have arrived just before
                arrived = marks.done() if marks else progress()["distinct_webhook_ids"]
                if arrived >= n:
                    break
            if dead or time.perf_counter() > deadline:
                raise SystemExit(
                    f"{name}: {arrived} of {n} {'ran' if marks else 'delivered'}; "
                    f"workers exited {dead}; logs in {args.logs}"
                )
            cpu = _tree_cpu({p.pid for p in procs})
        drain = time.perf_counter() - started
        cpu = max(cpu, _tree_cpu({p.pid for p in procs}))
        # The backends of the peer's database, read before the workers stop and their
        # connections close (a backend there before the workers counts from then on).
        pg1 = database_backends_cpu(database)
        postgres = sum(cpu - pg0.get(pid, 0.0) for pid, cpu in pg1.items())
        if first is None:  # every job arrived before the first look
            first = (0, 0.0, pg0)
        steady_postgres = sum(cpu - first[2].get(pid, 0.0) for pid, cpu in pg1.items())
        counts = progress()
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in logs:
            log.close()
        if marks:
            marks.close(unlink=True)
    steady = counts["last_at"] - counts["first_at"]
    return {
        "peer": name,
        "workload": workload,
        "events": n,
        "enqueue_seconds": round(enqueue_seconds, 3),
        "drain_seconds": round(drain, 3),
        "per_second_from_start": round(n / drain, 1),
        "first_to_last_seconds": round(steady, 3),
        "per_second": round(n / steady, 1) if steady > 0 else None,
        "receiver_requests": counts["requests"],
        "duplicates": counts["requests"] - counts["distinct_webhook_ids"],
        "worker_cpu_seconds": round(cpu, 2),
        # The database's backends from the workers' start to the last arrival (none for
        # a Redis broker; the WAL writer and other server processes are not counted).
        "postgres_cpu_seconds": round(postgres, 2),
        # The same from the first look that found a job arrived: the jobs that arrived
        # since and their CPU, without the workers' start-up.
        "steady_jobs": n - first[0],
        "steady_worker_cpu_seconds": round(cpu - first[1], 3),
        "steady_postgres_cpu_seconds": round(steady_postgres, 3),
        "settings": settings,
    }


def python() -> str:
    return sys.executable
