"""What every peer shares: the workload, and the driver that times a peer's drain.

The workload is the service's: deliver a 1 KiB JSON body to the local receiver
(``bench/receiver.py``) in a POST signed the Standard Webhooks way (``webhook-id``,
``webhook-timestamp``, ``webhook-signature: v1,<base64 HMAC-SHA256 of id.timestamp.body>``,
keyed with the base64 part of a ``whsec_`` secret). Each job carries its payload (as an
application would enqueue it) and its message id; the task encodes, signs and posts it
over a keep-alive connection kept per worker process, and fails on any answer but 200.

The driver (``drive``): reset the peer's queue, enqueue N jobs with no worker running,
reset the receiver, start the peer's worker processes as its documentation says, and
wait until the receiver has counted N distinct ``webhook-id``s; then stop the workers
(SIGTERM to each process group, SIGKILL after a grace) and print one JSON line: the
enqueue time, the drain time from the workers' start (start-up included) and the
receiver's first and last arrival (``N / (last - first)`` is the figure compared across
systems, start-up excluded).
"""

import argparse
import base64
import contextlib
import ctypes
import hashlib
import hmac
import json
import os
import signal
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


def drive(
    name: str,
    args: argparse.Namespace,
    *,
    reset: Callable[[], None],
    enqueue: Callable[[int], None],
    workers: list[list[str]],
    env: dict,
    settings: dict,
) -> int:
    n = args.events
    reset()
    t0 = time.perf_counter()
    enqueue(n)
    enqueue_seconds = time.perf_counter() - t0
    receiver_reset(args.receiver)
    procs = []
    logs = []
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
        counts = {}
        cpu = 0.0
        while True:
            time.sleep(0.1)
            counts = receiver_counts(args.receiver)
            if counts["distinct_webhook_ids"] >= n:
                break
            dead = [p.returncode for p in procs if p.poll() is not None]
            if dead:  # a worker that stops once the queue is empty (the baseline)
                counts = receiver_counts(args.receiver)
                if counts["distinct_webhook_ids"] >= n:
                    break
            if dead or time.perf_counter() > deadline:
                raise SystemExit(
                    f"{name}: {counts['distinct_webhook_ids']} of {n} delivered; "
                    f"workers exited {dead}; logs in {args.logs}"
                )
            cpu = _tree_cpu({p.pid for p in procs})
        drain = time.perf_counter() - started
        cpu = max(cpu, _tree_cpu({p.pid for p in procs}))
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
    steady = counts["last_at"] - counts["first_at"]
    print(
        json.dumps(
            {
                "peer": name,
                "events": n,
                "enqueue_seconds": round(enqueue_seconds, 3),
                "drain_seconds": round(drain, 3),
                "per_second_from_start": round(n / drain, 1),
                "first_to_last_seconds": round(steady, 3),
                "per_second": round(n / steady, 1) if steady > 0 else None,
                "receiver_requests": counts["requests"],
                "duplicates": counts["requests"] - counts["distinct_webhook_ids"],
                "worker_cpu_seconds": round(cpu, 2),
                "settings": settings,
            }
        ),
        flush=True,
    )
    return 0


def python() -> str:
    return sys.executable
