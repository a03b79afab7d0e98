"""Valid requests while slow clients trickle theirs: the real gunicorn with the shipped
``project/gunicorn.conf.py`` on PostgreSQL.

One run (``python bench/slow_clients.py``):

1. A dedicated PostgreSQL database (``webhooks_slow_clients_bench`` next to the one in
   ``DATABASE_URL``), migrated, with one Stripe source and one tenant's API key.
2. gunicorn, started with the config under test (``--config``, the shipped one by
   default) and its own defaults for workers and threads unless ``--workers`` says.
3. Two phases of ``--seconds`` each: *quiet* (the probes alone), then *slow*: the
   probes while ``--slow`` clients (10) trickle requests a byte every ``--interval``
   seconds (1): a third send a signed-looking inbound body to ``/ingest/<slug>/``, a
   third a JSON body to ``/api/v1/events/`` with the API key, a third their request
   headers (slowloris). A slow client whose connection the server ends starts again at
   once, so ten are trickling all the time.
4. The probes, one after another on fresh connections: ``GET /healthz``, ``GET
   /api/v1/endpoints/`` with the API key, and a validly signed new Stripe event posted
   to ``/ingest/<slug>/``. Each must answer 200 (a probe that gets anything else, or
   nothing within ``--probe-timeout``, counts as failed at that time). Latency is from
   the connect to the end of the answer.
5. ``bench/results/slow_clients.json`` and a table: p50, p99 and max per probe and
   phase, and how the slow clients' requests ended. Target: every probe of the slow
   phase under one second (``TARGET_SECONDS``).

``--compare CONFIG`` runs the same phases against another gunicorn config afterwards
(for example the sync-worker config this one replaced), reported beside it.
"""

import argparse
import atexit
import contextlib
import http.client
import json
import os
import platform
import select
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Run as a script, bench/ is sys.path[0], and bench/ingest.py would shadow the project's
# ``ingest`` package.
if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
    sys.path[0] = str(ROOT)

from bench.ingest import (  # noqa: E402
    SECRET,
    SLUG,
    BenchError,
    Database,
    free_port,
    manage,
    prepare_database,
    spawn,
    stop,
    stop_all,
)
from bench.outbound import child_pids, database_url, ensure_database, with_db  # noqa: E402
from ingest.schemes import get_scheme  # noqa: E402

RESULTS = HERE / "results"
TARGET_SECONDS = 1.0
KINDS = ("ingest-body", "api-body", "headers")
PROBES = ("healthz", "api", "ingest")


# --- Slow clients --------------------------------------------------------------------


def slow_request_head(kind: str, host: str, *, slug: str, api_key: str) -> bytes:
    """What a slow client of ``kind`` sends at once: everything up to its body (all of
    it but the last byte of the headers for ``headers``, which then trickles)."""
    if kind == "headers":
        return f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n".encode()
    path, auth = (f"/ingest/{slug}/", "") if kind == "ingest-body" else ("/api/v1/events/", "")
    if kind == "api-body":
        auth = f"Authorization: Bearer {api_key}\r\n"
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: 100000\r\nStripe-Signature: t=1,v1=00\r\n{auth}\r\n"
    ).encode()


class SlowClient(threading.Thread):
    """One client trickling a request a byte every ``interval`` seconds, starting over
    whenever the server ends it; counts how each request ended."""

    def __init__(self, kind, port, *, interval, stop_event, slug, api_key) -> None:
        super().__init__(daemon=True)
        self.kind, self.port, self.interval, self.stop_event = kind, port, interval, stop_event
        self.head = slow_request_head(kind, f"127.0.0.1:{port}", slug=slug, api_key=api_key)
        self.endings: dict[str, int] = {}
        self.trickling = threading.Event()  # set once the first request is trickling

    def run(self) -> None:
        while not self.stop_event.is_set():
            ending = self._one_request()
            self.endings[ending] = self.endings.get(ending, 0) + 1

    def _one_request(self) -> str:
        try:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        except OSError:
            return "connect_failed"
        with sock:
            try:
                sock.sendall(self.head)
                self.trickling.set()
                while not self.stop_event.wait(self.interval):
                    if select.select([sock], [], [], 0)[0]:
                        return _ending(sock.recv(4096))
                    sock.sendall(b"x" if self.kind != "headers" else b"X")
            except OSError:
                return "reset"
        return "stopped"


def _ending(answer: bytes) -> str:
    """``"408"``…, or ``"closed"`` when the server hung up without a word."""
    if not answer:
        return "closed"
    parts = answer.split(b" ", 2)
    return parts[1].decode(errors="replace") if len(parts) > 1 else "garbled"


# --- Probes --------------------------------------------------------------------------


def probe(port: int, name: str, *, slug: str, api_key: str, timeout: float) -> tuple[float, int]:
    """(seconds, status) of one valid request on a fresh connection; status 0 when it got
    no answer within ``timeout`` (the seconds are then ``timeout``)."""
    method, path, body, headers = "GET", "/healthz", None, {}
    if name == "api":
        path, headers = "/api/v1/endpoints/", {"Authorization": f"Bearer {api_key}"}
    elif name == "ingest":
        event_id = f"evt_probe_{time.time_ns()}"
        body = json.dumps({"id": event_id, "object": "event", "type": "probe"}).encode()
        method, path = "POST", f"/ingest/{slug}/"
        headers = get_scheme("stripe").sign(body=body, secret=SECRET)
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={**headers, "Connection": "close"})
        response = conn.getresponse()
        response.read()
        return time.perf_counter() - started, response.status
    except OSError:
        return max(time.perf_counter() - started, timeout), 0
    finally:
        conn.close()


def run_phase(port: int, *, seconds: float, slug: str, api_key: str, timeout: float) -> dict:
    """Probe round after round for ``seconds``: {probe: [(seconds, status), …]}."""
    samples: dict[str, list] = {name: [] for name in PROBES}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for name in PROBES:
            samples[name].append(probe(port, name, slug=slug, api_key=api_key, timeout=timeout))
        time.sleep(0.05)
    return samples


def start_slow_clients(port: int, n: int, **kw) -> tuple[list[SlowClient], threading.Event]:
    """``n`` slow clients, dealt over ``KINDS``, each trickling its first request."""
    stop_event = threading.Event()
    clients = [
        SlowClient(KINDS[i % len(KINDS)], port, stop_event=stop_event, **kw) for i in range(n)
    ]
    for client in clients:
        client.start()
    for client in clients:
        if not client.trickling.wait(10):
            raise BenchError(f"slow client {client.kind} could not connect")
    return clients, stop_event


def stop_slow_clients(clients: list[SlowClient], stop_event: threading.Event) -> dict:
    stop_event.set()
    for client in clients:
        client.join(15)
    endings: dict[str, dict[str, int]] = {}
    for client in clients:
        mine = endings.setdefault(client.kind, {})
        for ending, count in client.endings.items():
            mine[ending] = mine.get(ending, 0) + count
    return endings


def summarize(samples: list[tuple[float, int]]) -> dict:
    seconds = sorted(s for s, _ in samples)
    failed = sum(1 for _, status in samples if status != 200)
    if not seconds:
        return {"n": 0}
    return {
        "n": len(seconds),
        "failed": failed,
        "p50_ms": round(statistics.median(seconds) * 1000, 1),
        "p99_ms": round(seconds[min(len(seconds) - 1, int(len(seconds) * 0.99))] * 1000, 1),
        "max_ms": round(seconds[-1] * 1000, 1),
    }


# --- Server --------------------------------------------------------------------------


class Server:
    """gunicorn with ``config`` on a free port."""

    def __init__(self, config: str, *, env: dict, logs: Path, label: str) -> None:
        self.port = free_port()
        self.log = logs / f"gunicorn-{label}.log"
        child_env = {**os.environ, **env, "GUNICORN_BIND": f"127.0.0.1:{self.port}"}
        argv = [sys.executable, "-m", "gunicorn", "-c", config]
        self.proc = spawn(argv, env=child_env, log=self.log)
        self._wait_ready(timeout=120)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"gunicorn exited:\n{self.tail()}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                url = f"http://127.0.0.1:{self.port}/healthz"
                if urllib.request.urlopen(url, timeout=5).status == 200:
                    return
            time.sleep(0.2)
        raise BenchError(f"gunicorn not ready after {timeout:.0f} s:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


def measure(config: str, args, *, env: dict, logs: Path, api_key: str, label: str) -> dict:
    server = Server(config, env=env, logs=logs, label=label)
    kw = {"slug": SLUG, "api_key": api_key, "timeout": args.probe_timeout}
    try:
        time.sleep(2)  # every worker booted (the first answer came from one of them)
        processes = len(child_pids(server.proc.pid))
        quiet = run_phase(server.port, seconds=args.seconds, **kw)
        clients, stop_event = start_slow_clients(
            server.port, args.slow, interval=args.interval, slug=SLUG, api_key=api_key
        )
        try:
            slow = run_phase(server.port, seconds=args.seconds, **kw)
        finally:
            endings = stop_slow_clients(clients, stop_event)
    finally:
        stop(server.proc)
    slow_all = [s for name in PROBES for s in slow[name]]
    return {
        "config": config,
        "worker_processes": processes,
        "quiet": {name: summarize(quiet[name]) for name in PROBES},
        "slow": {name: summarize(slow[name]) for name in PROBES},
        "slow_all": summarize(slow_all),
        "slow_client_endings": endings,
        "target_met": bool(slow_all)
        and all(status == 200 and s < TARGET_SECONDS for s, status in slow_all),
    }


def markdown(result: dict) -> str:
    lines = [
        f"{result['slow_clients']} slow clients, a byte every {result['interval']} s; "
        f"target: every valid request of the slow phase under {TARGET_SECONDS:.0f} s",
        "",
        "| config | processes | phase | probe | n | failed | p50 ms | p99 ms | max ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, run in result["runs"].items():
        for phase in ("quiet", "slow"):
            for name in PROBES:
                s = run[phase][name]
                lines.append(
                    f"| {label} | {run['worker_processes']} | {phase} | {name} | {s['n']} | "
                    f"{s.get('failed', '')} | {s.get('p50_ms', '')} | {s.get('p99_ms', '')} | "
                    f"{s.get('max_ms', '')} |"
                )
    for label, run in result["runs"].items():
        lines.append(
            f"\n{label}: target {'met' if run['target_met'] else 'MISSED'}; slow clients' "
            f"requests ended: {json.dumps(run['slow_client_endings'], sort_keys=True)}"
        )
    return "\n".join(lines)


def create_api_key(env: dict) -> str:
    done = manage(env, "create_tenant", f"slow-clients-{int(time.time())}")
    if done.returncode != 0:
        raise BenchError(f"create_tenant failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout.strip().splitlines()[-1]


def versions() -> dict:
    import django
    import gunicorn

    return {
        "python": platform.python_version(),
        "django": django.get_version(),
        "gunicorn": gunicorn.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="project/gunicorn.conf.py")
    parser.add_argument("--compare", default=None, metavar="CONFIG", help="another config")
    parser.add_argument("--workers", type=int, default=None, help="GUNICORN_WORKERS")
    parser.add_argument("--slow", type=int, default=10, help="slow clients")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between bytes")
    parser.add_argument("--seconds", type=float, default=40.0, help="length of each phase")
    parser.add_argument("--probe-timeout", type=float, default=60.0)
    parser.add_argument("--db-name", default="webhooks_slow_clients_bench")
    parser.add_argument("--output", type=Path, default=RESULTS / "slow_clients.json")
    args = parser.parse_args(argv)

    base_url = database_url()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    atexit.register(stop_all)
    logs = Path(tempfile.mkdtemp(prefix="bench-slow-clients-"))
    ensure_database(base_url, args.db_name)
    env = {
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "DATABASE_URL": with_db(base_url, args.db_name),
        "LOG_LEVEL": "WARNING",
        **({"GUNICORN_WORKERS": str(args.workers)} if args.workers else {}),
    }
    db = Database(with_db(base_url, args.db_name, "bench-ctl"))
    prepare_database(db, {**os.environ, **env})
    api_key = create_api_key({**os.environ, **env})
    result: dict = {
        "benchmark": "slow_clients",
        "cpu_count": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "versions": versions(),
        "slow_clients": args.slow,
        "interval": args.interval,
        "phase_seconds": args.seconds,
        "target_seconds": TARGET_SECONDS,
        "runs": {},
    }
    configs = [("shipped", args.config)] + ([("compare", args.compare)] if args.compare else [])
    try:
        for label, config in configs:
            print(f"{label}: {config}", flush=True)
            result["runs"][label] = measure(
                config, args, env=env, logs=logs, api_key=api_key, label=label
            )
    except BenchError as exc:
        result["failed"] = str(exc)
        print(f"FAILED: {exc}\nlogs: {logs}", file=sys.stderr)
    finally:
        stop_all()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    if result["runs"]:
        print(markdown(result))
    return 1 if "failed" in result or not result["runs"]["shipped"]["target_met"] else 0


if __name__ == "__main__":
    sys.exit(main())
