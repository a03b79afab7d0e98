"""Inbound throughput and acknowledgement latency: the receive view under gunicorn, against
a trivial Django view under the same gunicorn settings, loaded at fixed arrival rates.

One run (``python bench/ingest.py``):

1. A dedicated PostgreSQL database (``webhooks_ingest_bench`` next to the one in
   ``DATABASE_URL``), created if missing and migrated, with one Stripe source
   (``manage.py create_source stripe --scheme stripe --secret whsec_bench``).
2. One load generator process (``bench/ingest_load.py``, aiohttp) for the whole run.
3. For each server in turn, never both at once: the trivial view
   (``bench/ingest_trivial.py``: ``project.settings`` with another URLconf) and the real
   one (``project.wsgi``), each a gunicorn started with ``project/gunicorn.conf.py`` and
   the same ``GUNICORN_WORKERS`` worker processes (the shipped worker class):

   * a warm-up and a closed loop (``--closed-concurrency`` senders, ``--closed-seconds``)
     for the server's maximum throughput, as a cross-check;
   * the ramp: open-model steps of ``--step`` requests/s more each, ``--step-seconds``
     long, from ``--step`` until two steps in a row fail. A step is *sustained* when its
     achieved rate (2xx answers over the time from the first scheduled send to the last
     answer) is at least 95 % of the offered rate and nothing failed (no transport error,
     no non-2xx answer, and for the receive view every answer ``"accepted"`` and one
     stored event per acceptance). *Saturation* is the highest sustained step;
   * ``--half-seconds`` at half of that server's own saturation rate: the latency figures.

   Every request is a new Stripe event (``evt_<n>``) signed right before its step; the
   trivial view gets the very same requests. The ingest tables are truncated before
   every step of the receive view, and after it the stored events must equal the
   ``"accepted"`` answers (and the outbox rows, one per event).
4. ``bench/results/ingest.json`` and a Markdown table: saturation of each server and
   their ratio (target: the receive view sustains at least half of the trivial view's
   rate), latency at half saturation (target: receive view p99 under 50 ms), and the
   CPU of the servers, their PostgreSQL backends and the generator per request.

Latency is measured from each request's *scheduled* send time to the end of its answer,
so queueing anywhere (the generator, the listen backlog, a busy worker) counts. Everything
runs on 127.0.0.1 and is bounded in time (``--budget``); children die with the benchmark.

Options: ``--repeat N`` runs the servers N times, alternating their order, and reports
medians (the ratio is taken per repeat, each server measured next to the other);
``--py-spy DIR`` profiles the receive view's workers during one extra step at its
saturation rate, after the measured ones.
"""

import argparse
import atexit
import contextlib
import ctypes
import json
import os
import platform
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Run as a script, bench/ is sys.path[0], and this very file would shadow the project's
# ``ingest`` package for anything imported later.
if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
    sys.path[0] = str(ROOT)

from bench.outbound import (  # noqa: E402
    CLK_TCK,
    INBOUND_TABLES,
    child_pids,
    database_url,
    ensure_database,
    machine_cpu,
    parse_env,
    proc_cpu_seconds,
    with_db,
)

RESULTS = HERE / "results"
SLUG = "stripe"
SECRET = "whsec_bench"
APPLICATION_NAME = "bench-gunicorn"
SERVERS = {
    "trivial": "bench.ingest_trivial:application",
    "ingest": "project.wsgi:application",
}
LABELS = {
    "trivial": "trivial view",
    "ingest": "receive view (accepted)",
}
# Emptied before every step of the receive view (CASCADE reaches the rest).
TARGET_RATIO = 0.6
TARGET_P99_MS = 50.0
SUSTAINED_SHARE = 0.95


class BenchError(RuntimeError):
    """A run that cannot give meaningful figures (a server that does not start, a
    generator that does not answer, the time budget spent): stop loudly."""


# --- Processes -----------------------------------------------------------------------

_children: list[subprocess.Popen] = []


def _die_with_parent() -> None:
    # Linux: the child gets SIGTERM if the benchmark itself dies (even with SIGKILL).
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def spawn(argv: list[str], *, env: dict, log: Path, **kw) -> subprocess.Popen:
    out = open(log, "wb")  # noqa: SIM115 - closed by stop()
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdout=kw.pop("stdout", out),
        stderr=out,
        preexec_fn=_die_with_parent,
        start_new_session=True,  # its own process group: gunicorn's workers go with it
        **kw,
    )
    proc._bench_log = out  # type: ignore[attr-defined]
    _children.append(proc)
    return proc


def stop(proc: subprocess.Popen, *, grace: float = 10.0) -> None:
    """SIGTERM (gunicorn finishes in-flight requests), then SIGKILL to the whole process
    group after ``grace``."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # Workers left behind by a master that died first.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc._bench_log.close()  # type: ignore[attr-defined]
    if proc in _children:
        _children.remove(proc)


def stop_all() -> None:
    for proc in list(_children):
        stop(proc, grace=5.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- Database ------------------------------------------------------------------------


class Database:
    """The benchmark's own connection (autocommit) to the bench database."""

    def __init__(self, url: str) -> None:
        import psycopg

        self.conn = psycopg.connect(url, autocommit=True)

    def rows(self, query: str, params: list | None = None) -> list[tuple]:
        cursor = self.conn.execute(query, params or [])
        return cursor.fetchall() if cursor.description else []

    def value(self, query: str, params: list | None = None):
        return self.rows(query, params)[0][0]

    def truncate(self) -> None:
        self.rows(f"TRUNCATE {', '.join(INBOUND_TABLES)} CASCADE")

    def backend_cpu(self) -> float:
        """CPU seconds of the servers' backends (their connections are persistent)."""
        pids = self.rows(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s", [APPLICATION_NAME]
        )
        return sum(proc_cpu_seconds(pid) for (pid,) in pids)


def manage(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )


def prepare_database(db: Database, env: dict) -> None:
    """Migrated, empty ingest tables, and exactly one ``stripe`` source with our secret."""
    done = manage(env, "migrate", "--noinput")
    if done.returncode != 0:
        raise BenchError(f"migrate failed:\n{done.stdout}\n{done.stderr}")
    db.truncate()
    # Made afresh every run: its secret is stored encrypted, so what another invocation
    # (or someone by hand) left cannot be compared with ours here.
    db.rows(
        "DELETE FROM ingest_sourcesecret WHERE source_id IN "
        "(SELECT id FROM ingest_source WHERE slug = %s)",
        [SLUG],
    )
    db.rows("DELETE FROM ingest_source WHERE slug = %s", [SLUG])
    done = manage(env, "create_source", SLUG, "--scheme", "stripe", "--secret", SECRET)
    if done.returncode != 0:
        raise BenchError(f"create_source failed:\n{done.stdout}\n{done.stderr}")


# --- Load generator ------------------------------------------------------------------


class Generator:
    """``bench/ingest_load.py``, one JSON command and one JSON answer per line."""

    def __init__(self, logs: Path) -> None:
        self.proc = spawn(
            [sys.executable, str(HERE / "ingest_load.py"), "--secret", SECRET],
            env=dict(os.environ),
            log=logs / "generator.log",
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.logs = logs
        self._read(timeout=30)

    def call(self, cmd: dict, *, timeout: float) -> dict:
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        return self._read(timeout)

    def _read(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            tail = (self.logs / "generator.log").read_text()[-2000:]
            raise BenchError(f"the load generator did not answer within {timeout:.0f} s\n{tail}")
        return json.loads(line)


# --- Servers -------------------------------------------------------------------------


class Server:
    """One gunicorn (master and its worker processes) serving one of ``SERVERS``."""

    def __init__(self, name: str, *, workers: int, db_url: str, env: dict, logs: Path) -> None:
        self.name, self.workers, self.port = name, workers, free_port()
        self.log = logs / f"gunicorn-{name}.log"
        child_env = {
            **os.environ,
            **env,
            "DJANGO_SETTINGS_MODULE": "project.settings",
            "DATABASE_URL": db_url,
            "GUNICORN_BIND": f"127.0.0.1:{self.port}",
            "GUNICORN_WORKERS": str(workers),
        }
        argv = [sys.executable, "-m", "gunicorn", "-c", "project/gunicorn.conf.py", SERVERS[name]]
        self.proc = spawn(argv, env=child_env, log=self.log)
        self._wait_ready(timeout=60)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/ingest/{SLUG}/"

    def _wait_ready(self, timeout: float) -> None:
        """Every worker forked and one of them answering (a GET: 405 from both views)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"gunicorn ({self.name}) exited:\n{self.tail()}")
            if len(child_pids(self.proc.pid)) >= self.workers:
                try:
                    urllib.request.urlopen(self.url, timeout=5)  # noqa: S310 - 127.0.0.1
                except urllib.error.HTTPError as exc:
                    if exc.code == 405:
                        return
                except OSError:
                    pass
            time.sleep(0.2)
        raise BenchError(f"gunicorn ({self.name}) not ready after {timeout:.0f} s:\n{self.tail()}")

    def pids(self) -> list[int]:
        return [self.proc.pid, *child_pids(self.proc.pid)]

    def cpu(self) -> float:
        return sum(proc_cpu_seconds(pid) for pid in self.pids())

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def stop(self) -> None:
        stop(self.proc)


# --- Measurements --------------------------------------------------------------------


class Bench:
    def __init__(self, args, db: Database, gen: Generator) -> None:
        self.args, self.db, self.gen = args, db, gen
        self.next_event = 1
        self.deadline = time.monotonic() + args.budget
        self.cpus = os.cpu_count() or 1

    def _ids(self, n: int) -> int:
        first, self.next_event = self.next_event, self.next_event + n
        return first

    def _check_budget(self) -> None:
        if time.monotonic() > self.deadline:
            raise BenchError(f"time budget of {self.args.budget:.0f} s spent")

    def run(self, server: Server, cmd: dict, seconds: float) -> dict:
        """One generator command against ``server``, with the CPU of everything involved
        over exactly the timed phase, and the stored events checked afterwards."""
        self._check_budget()
        if server.name != "trivial":
            self.db.truncate()
        n = cmd.get("max_requests") or max(1, round(cmd["rate"] * seconds))
        cmd = {**cmd, "url": server.url, "seconds": seconds, "first": self._ids(n)}
        if "rate" in cmd:
            # Sign right before the step, untimed: the generator only sends when timed.
            self.gen.call({**cmd, "op": "prepare"}, timeout=60)
        time.sleep(self.args.settle)
        server_pids = server.pids()
        cpu_server, cpu_pg, cpu_gen = server.cpu(), self.db.backend_cpu(), self._gen_cpu()
        busy0, total0 = machine_cpu()
        wall0 = time.monotonic()
        out = self.gen.call(cmd, timeout=seconds + self.args.request_timeout + 60)
        wall = time.monotonic() - wall0
        busy1, total1 = machine_cpu()
        cpu_server = server.cpu() - cpu_server
        cpu_pg = self.db.backend_cpu() - cpu_pg
        cpu_gen = self._gen_cpu() - cpu_gen
        if server.pids() != server_pids:
            out["warning"] = "a gunicorn worker was replaced during the step (CPU undercounted)"
        n_done = max(1, out["requests"])
        busy = (busy1 - busy0) / CLK_TCK
        out["cpu"] = {
            "wall_seconds": round(wall, 3),
            "server_seconds": round(cpu_server, 3),
            "postgres_backends_seconds": round(cpu_pg, 3),
            "generator_process_seconds": round(cpu_gen, 3),
            "server_us_per_request": round(cpu_server / n_done * 1e6, 1),
            "postgres_us_per_request": round(cpu_pg / n_done * 1e6, 1),
            "generator_us_per_request": round(cpu_gen / n_done * 1e6, 1),
            "machine_busy_share": round((busy1 - busy0) / max(1, total1 - total0), 3),
            # CPU of the machine that none of the measured processes used: kernel work on
            # their behalf, and whatever else runs (another engineer's test suite).
            "other_share": round(
                max(0.0, busy - cpu_server - cpu_pg - cpu_gen) / (wall * self.cpus), 3
            ),
        }
        out["checks"] = self._verify(server, out)
        return out

    def _gen_cpu(self) -> float:
        return proc_cpu_seconds(self.gen.proc.pid)

    def _verify(self, server: Server, out: dict) -> dict:
        non_2xx = sum(v for k, v in out["statuses"].items() if not k.startswith("2"))
        five_xx = sum(v for k, v in out["statuses"].items() if k.startswith("5"))
        checks = {
            "errors": sum(out["errors"].values()),
            "non_2xx": non_2xx,
            "5xx": five_xx,
        }
        if server.name != "trivial":
            stored = self.db.value("SELECT count(*) FROM ingest_inboundevent")
            outbox = self.db.value("SELECT count(*) FROM deliveries_outbox")
            checks.update(
                stored_events=stored,
                outbox_rows=outbox,
                stored_equals_accepted=stored == out["accepted"] == outbox,
                all_accepted=out["accepted"] == out["requests"],
            )
            checks["ok"] = (
                checks["stored_equals_accepted"] and checks["all_accepted"] and non_2xx == 0
            )
        else:
            checks["ok"] = out["ok"] == out["requests"]
        checks["ok"] = bool(checks["ok"] and checks["errors"] == 0)
        return checks

    def open_step(self, server: Server, rate: float, seconds: float) -> dict:
        cmd = {
            "op": "open",
            "rate": rate,
            "conn_limit": self.args.conn_limit,
            "timeout": self.args.request_timeout,
        }
        out = self.run(server, cmd, seconds)
        trivial = server.name == "trivial"
        achieved = out["ok_per_second"] if trivial else out["accepted_per_second"]
        out["achieved_per_second"] = achieved
        out["sustained"] = bool(out["checks"]["ok"] and achieved >= SUSTAINED_SHARE * rate)
        return out

    def closed(self, server: Server, seconds: float, concurrency: int) -> dict:
        cmd = {
            "op": "closed",
            "concurrency": concurrency,
            "max_requests": self.args.closed_max_requests,
            "timeout": self.args.request_timeout,
        }
        return self.run(server, cmd, seconds)

    def measure_server(
        self, name: str, result: dict, *, db_url: str, env: dict, logs: Path
    ) -> None:
        """Everything about one server, into ``result`` (which keeps what was measured
        when a later part fails)."""
        args = self.args
        started = time.monotonic()
        result.update(server=name, app=SERVERS[name])
        server = Server(name, workers=args.workers, db_url=db_url, env=env, logs=logs)
        try:
            warm = self.closed(server, args.warmup_seconds, 2 * args.workers)
            result["warmup"] = _brief(warm)
            if not warm["checks"]["ok"]:
                raise BenchError(f"{name}: warm-up failed: {_brief(warm)}\n{server.tail()}")
            closed = self.closed(server, args.closed_seconds, args.closed_concurrency)
            result["closed_loop"] = closed
            print(
                f"  {name}: closed loop ({args.closed_concurrency} senders) "
                f"{closed['ok_per_second']:,.0f} req/s, p99 {closed['latency_ms'].get('p99')} ms",
                flush=True,
            )
            step_size = args.step or _auto_step(closed["ok_per_second"])
            result["ramp_step"] = step_size
            steps, best = self.ramp(server, closed["ok_per_second"], step_size)
            result["steps"] = steps
            if best is None:
                raise BenchError(f"{name}: not even {steps[-1]['offered_per_second']}/s sustained")
            result["saturation"] = {
                "offered_per_second": best["offered_per_second"],
                "achieved_per_second": best["achieved_per_second"],
                "latency_ms": best["latency_ms"],
                "generator_cpu_share": best["generator_cpu_share"],
                "cpu": best["cpu"],
            }
            half_rate = round(best["offered_per_second"] / 2)
            half = self.open_step(server, half_rate, args.half_seconds)
            print(f"  {name}: half saturation: {_step_line(half)}", flush=True)
            result["half"] = half
            if args.py_spy and name == "ingest":
                result["profile"] = self.profile(server, best["offered_per_second"], logs)
        finally:
            result["server_log_tail"] = server.tail()[-1500:]
            server.stop()
            result["seconds"] = round(time.monotonic() - started, 1)

    def ramp(self, server: Server, closed_rate: float, step: float) -> tuple[list, dict | None]:
        """Open-model steps up from about half the closed loop's rate until two steps in a
        row are not sustained, then one half-step above the best one; (steps, best)."""
        args, steps = self.args, []

        def run(rate: float) -> dict:
            out = self.open_step(server, rate, args.step_seconds)
            steps.append(out)
            print(f"  {server.name}: {_step_line(out)}", flush=True)
            return out

        rate = args.start_rate or max(step, step * int(0.5 * closed_rate / step))
        first = run(rate)
        while not first["sustained"] and rate / 2 >= args.min_rate:
            rate = round(rate / 2)  # the closed loop was optimistic: come down first
            first = run(rate)
        if not first["sustained"]:
            return steps, None
        best, failures = first, 0
        while failures < 2 and rate + step <= args.max_rate:
            rate += step
            out = run(rate)
            best, failures = (out, 0) if out["sustained"] else (best, failures + 1)
        half_step = best["offered_per_second"] + step / 2
        if failures and half_step <= args.max_rate:
            out = run(half_step)
            if out["sustained"]:
                best = out
        return steps, best

    def profile(self, server: Server, rate: float, logs: Path) -> dict:
        """py-spy on every worker during one extra step (not one of the measured ones:
        sampling costs CPU)."""
        out_dir: Path = self.args.py_spy
        out_dir.mkdir(parents=True, exist_ok=True)
        py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        mode = {"gil": ["--gil"], "cpu": [], "wall": ["--idle"]}[self.args.py_spy_mode]
        spies = []
        for pid in child_pids(server.proc.pid):
            argv = [py_spy, "record", "--nonblocking", "--format", "raw", "-r", "100", *mode]
            argv += ["-o", str(out_dir / f"worker-{pid}.txt"), "--pid", str(pid)]
            spies.append(spawn(argv, env=dict(os.environ), log=logs / f"py-spy-{pid}.log"))
        time.sleep(1.0)
        try:
            step = self.open_step(server, rate, self.args.step_seconds)
        finally:
            for spy in spies:
                with contextlib.suppress(ProcessLookupError):
                    spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            for spy in spies:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    spy.wait(20)
                stop(spy)
        print(f"  ingest: profiled step: {_step_line(step)}; stacks in {out_dir}", flush=True)
        return {"mode": self.args.py_spy_mode, "dir": str(out_dir), "step": _brief(step)}


def _auto_step(closed_rate: float) -> float:
    """200/s, or a tenth of the closed loop's rate when that is under 2,000/s (a busy
    machine), rounded to 10/s: five to ten steps up to saturation either way."""
    return 200.0 if closed_rate >= 2000 else max(10.0, round(closed_rate / 10, -1))


def _brief(step: dict) -> dict:
    keys = ("requests", "ok_per_second", "accepted_per_second", "statuses", "errors", "checks")
    return {k: step.get(k) for k in keys} | {"latency_ms": step.get("latency_ms")}


def _step_line(step: dict) -> str:
    lat = step["latency_ms"]
    return (
        f"offered {step['offered_per_second']:,.0f}/s -> {step['achieved_per_second']:,.0f}/s, "
        f"p50 {lat.get('p50')} p99 {lat.get('p99')} max {lat.get('max')} ms, "
        f"errors {step['checks']['errors']} non-2xx {step['checks']['non_2xx']}, "
        f"generator {step['generator_cpu_share']:.0%} CPU, "
        f"other {step['cpu']['other_share']:.0%}"
        + ("" if step["sustained"] else "  [not sustained]")
    )


# --- Report --------------------------------------------------------------------------


def versions(db: Database) -> dict:
    import aiohttp
    import django
    import gunicorn
    import psycopg

    return {
        "python": platform.python_version(),
        "django": django.get_version(),
        "gunicorn": gunicorn.__version__,
        "aiohttp": aiohttp.__version__,
        "psycopg": psycopg.__version__,
        "postgres": db.value("SHOW server_version"),
        "postgres_settings": dict(
            db.rows(
                "SELECT name, setting FROM pg_settings WHERE name IN ('shared_buffers', "
                "'synchronous_commit', 'fsync', 'wal_sync_method', 'max_connections')"
            )
        ),
    }


def _steps(run: dict) -> list[dict]:
    return [*run.get("steps", []), *([run["half"]] if "half" in run else [])]


def summarize(result: dict) -> dict:
    """Per repeat: the ratio of the saturation rates (receive view accepted/s over trivial
    view req/s, each measured just before or after the other) and the receive view's p99
    at half its saturation; medians over repeats."""
    pairs = [r for r in result["repeats"] if "half" in r.get("ingest", {})]
    pairs = [r for r in pairs if "half" in r.get("trivial", {})]
    if not pairs:
        return {}
    ratios = [
        r["ingest"]["saturation"]["achieved_per_second"]
        / r["trivial"]["saturation"]["achieved_per_second"]
        for r in pairs
    ]
    p99s = [r["ingest"]["half"]["latency_ms"]["p99"] for r in pairs]
    ratio, p99 = statistics.median(ratios), _median_ms(p99s)
    # The same comparison from CPU instead of throughput: CPU per request of everything on
    # the machine that works for the request (server, its backends, the generator), at
    # half saturation. Less sensitive to other load coming and going between steps.
    cost_ratios = [_cpu_per_request(r["trivial"]) / _cpu_per_request(r["ingest"]) for r in pairs]
    runs = [run for r in result["repeats"] for run in r.values() if isinstance(run, dict)]
    every = [step for run in runs for step in _steps(run)]
    storing_steps = [step for run in runs if run["server"] != "trivial" for step in _steps(run)]
    return {
        "trivial_saturation_per_second": [
            r["trivial"]["saturation"]["achieved_per_second"] for r in pairs
        ],
        "ingest_saturation_accepted_per_second": [
            r["ingest"]["saturation"]["achieved_per_second"] for r in pairs
        ],
        "ratios": [round(x, 3) for x in ratios],
        "ratio": round(ratio, 3),
        "ratio_target": TARGET_RATIO,
        "ratio_met": ratio >= TARGET_RATIO,
        "cpu_cost_ratio": round(statistics.median(cost_ratios), 3),
        # The same without the generator's CPU, which both servers pay alike per request
        # and which therefore pulls the ratio towards 1.
        "server_cpu_cost_ratio": round(
            statistics.median(
                _cpu_per_request(r["trivial"], generator=False)
                / _cpu_per_request(r["ingest"], generator=False)
                for r in pairs
            ),
            3,
        ),
        "ingest_half_rates_per_second": [r["ingest"]["half"]["offered_per_second"] for r in pairs],
        "ingest_half_p99s_ms": p99s,
        "ingest_half_p99_ms": p99,
        "p99_target_ms": TARGET_P99_MS,
        "p99_met": p99 < TARGET_P99_MS and all(r["ingest"]["half"]["sustained"] for r in pairs),
        "five_xx": sum(step["checks"]["5xx"] for step in every),
        # With no transport error (a client timeout can leave a request the server still
        # commits), stored events must equal the "accepted" answers, one outbox row each.
        "stored_mismatches": sum(
            1
            for step in storing_steps
            if step["checks"]["errors"] == 0 and not step["checks"]["stored_equals_accepted"]
        ),
        "correct": all(step["checks"]["5xx"] == 0 for step in every)
        and all(
            step["checks"]["stored_equals_accepted"]
            for step in storing_steps
            if step["checks"]["errors"] == 0
        ),
    }


def _median_ms(values) -> float:
    return round(statistics.median(values), 2)


def _cpu_per_request(run: dict, *, generator: bool = True) -> float:
    cpu = run["half"]["cpu"]
    return (
        cpu["server_us_per_request"]
        + cpu["postgres_us_per_request"]
        + (cpu["generator_us_per_request"] if generator else 0.0)
    )


def markdown(result: dict) -> str:
    s = result["summary"]
    rows = [
        "| run | server | closed loop req/s | saturation offered/s | sustained/s "
        "| p99 at sat. ms | half rate/s | p50 ms | p90 ms | p99 ms | max ms "
        "| CPU us/req server / PG / generator (half) | generator CPU share (sat.) "
        "| other CPU (sat. / half) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: |",
    ]
    for i, rep in enumerate(result["repeats"], 1):
        for name in SERVERS:
            srv = rep.get(name)
            if not srv or "half" not in srv:
                continue
            sat, half = srv["saturation"], srv["half"]
            lat, cpu = half["latency_ms"], half["cpu"]
            label = LABELS[name]
            rows.append(
                f"| {i} | {label} | {srv['closed_loop']['ok_per_second']:,.0f} "
                f"| {sat['offered_per_second']:,.0f} | {sat['achieved_per_second']:,.0f} "
                f"| {sat['latency_ms']['p99']} | {half['offered_per_second']:,.0f} "
                f"| {lat['p50']} | {lat['p90']} | {lat['p99']} | {lat['max']} "
                f"| {cpu['server_us_per_request']:,.0f} / {cpu['postgres_us_per_request']:,.0f} / "
                f"{half['generator_cpu_us_per_request']:,.0f} "
                f"| {sat['generator_cpu_share']:.0%} "
                f"| {sat['cpu']['other_share']:.0%} / {cpu['other_share']:.0%} |"
            )
    rows += [
        "",
        "Ratio (receive view accepted/s over trivial view req/s at saturation, median of "
        f"{len(s['ratios'])}): **{s['ratio']:.2f}** (target >= {TARGET_RATIO}): "
        + ("met" if s["ratio_met"] else "**NOT met**")
        + ".",
        "CPU per request, trivial over receive view (server + its PostgreSQL backends + "
        f"generator, at half saturation; median): {s['cpu_cost_ratio']:.2f}; without the "
        f"generator: {s['server_cpu_cost_ratio']:.2f}.",
        "Receive view p99 at half its saturation (median): "
        f"**{s['ingest_half_p99_ms']} ms** (target < {TARGET_P99_MS:.0f} ms): "
        + ("met" if s["p99_met"] else "**NOT met**")
        + ".",
        "Correctness: "
        + (
            "stored events = accepted answers = outbox rows in every step, no 5xx."
            if s["correct"]
            else f"**FAILED**: {s['five_xx']} 5xx, {s['stored_mismatches']} steps where "
            "stored events differ from accepted answers."
        ),
        f"{result['cpu_count']} CPUs, gunicorn {result['gunicorn']['workers']} workers, "
        f"steps of {result['args']['step_seconds']:g} s, half saturation for "
        f"{result['args']['half_seconds']:g} s.",
    ]
    others = [
        step["cpu"]["other_share"]
        for rep in result["repeats"]
        for run in rep.values()
        if isinstance(run, dict)
        for step in _steps(run)
    ]
    if others and max(others) > 0.1:
        rows.append(
            f"Warning: up to {max(others):.0%} of the machine's CPU went to other processes "
            "during the steps; absolute figures are skewed (rerun on a quiet machine)."
        )
    rows += [
        "",
        "| run | server | offered/s | achieved/s | p50 ms | p99 ms | max ms | sustained "
        "| generator CPU | other CPU |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for i, rep in enumerate(result["repeats"], 1):
        for name in SERVERS:
            for step in rep.get(name, {}).get("steps", []):
                lat = step["latency_ms"]
                rows.append(
                    f"| {i} | {name} | {step['offered_per_second']:,.0f} "
                    f"| {step['achieved_per_second']:,.0f} | {lat.get('p50')} "
                    f"| {lat.get('p99')} | {lat.get('max')} "
                    f"| {'yes' if step['sustained'] else 'no'} "
                    f"| {step['generator_cpu_share']:.0%} | {step['cpu']['other_share']:.0%} |"
                )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workers",
        type=int,
        default=(os.cpu_count() or 1) + 1,
        help="GUNICORN_WORKERS, both servers; default: the product's, cores + 1",
    )
    parser.add_argument(
        "--step", type=float, default=None, help="ramp step, req/s (200, less on a slow box)"
    )
    parser.add_argument(
        "--start-rate", type=float, default=None, help="first step (half the closed loop's)"
    )
    parser.add_argument("--min-rate", type=float, default=20.0)
    parser.add_argument("--max-rate", type=float, default=10_000)
    parser.add_argument("--step-seconds", type=float, default=5.0)
    parser.add_argument("--half-seconds", type=float, default=10.0)
    parser.add_argument("--closed-seconds", type=float, default=5.0)
    parser.add_argument("--closed-concurrency", type=int, default=16)
    parser.add_argument("--closed-max-requests", type=int, default=40_000)
    parser.add_argument("--warmup-seconds", type=float, default=2.0)
    parser.add_argument("--settle", type=float, default=1.0, help="idle seconds before a step")
    parser.add_argument("--conn-limit", type=int, default=2000, help="generator connections")
    parser.add_argument("--request-timeout", type=float, default=30.0)
    parser.add_argument("--budget", type=float, default=1200.0, help="seconds for everything")
    parser.add_argument("--repeat", type=int, default=1, help="pairs of runs; medians")
    parser.add_argument(
        "--servers",
        default="trivial,ingest",
        help=f"comma-separated, in order, from {', '.join(SERVERS)} (trivial,ingest)",
    )
    parser.add_argument("--db-name", default="webhooks_ingest_bench")
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="for both servers"
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "ingest.json")
    parser.add_argument("--py-spy", type=Path, default=None, metavar="DIR")
    parser.add_argument("--py-spy-mode", choices=("gil", "cpu", "wall"), default="wall")
    args = parser.parse_args(argv)

    base_url = database_url()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    atexit.register(stop_all)
    logs = Path(tempfile.mkdtemp(prefix="bench-ingest-"))
    ensure_database(base_url, args.db_name)
    db = Database(with_db(base_url, args.db_name, "bench-ctl"))
    prepare_database(db, {**os.environ, "DATABASE_URL": with_db(base_url, args.db_name)})
    # Persistent connections for the whole run (the default is 60 s) so that every
    # step's backend CPU is read from the same backends; a reconnect a minute costs
    # nothing measurable either way.
    server_env = {"DATABASE_CONN_MAX_AGE": "3600", **parse_env(args.env)}
    result: dict = {
        "benchmark": "ingest",
        "cpu_count": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "versions": versions(db),
        "database": args.db_name,
        "gunicorn": {
            "config": "project/gunicorn.conf.py",
            "workers": args.workers,
            "worker_class": os.environ.get(
                "GUNICORN_WORKER_CLASS", "project.gunicorn_worker.ThreadWorker"
            ),
        },
        "server_env": server_env,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "targets": {"ratio": TARGET_RATIO, "half_saturation_p99_ms": TARGET_P99_MS},
        "repeats": [],
    }
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    if not names or set(names) - set(SERVERS):
        raise SystemExit(f"--servers: choose from {', '.join(SERVERS)}")
    failed = None
    try:
        gen = Generator(logs)
        bench = Bench(args, db, gen)
        for i in range(args.repeat):
            rep: dict = {}
            result["repeats"].append(rep)
            # Alternate the order, so that neither server always runs on a warmer machine.
            for name in names if i % 2 == 0 else names[::-1]:
                print(
                    f"[{i + 1}/{args.repeat}] {name}: gunicorn {args.workers} workers, "
                    f"{SERVERS[name]}",
                    flush=True,
                )
                rep[name] = {}
                bench.measure_server(
                    name,
                    rep[name],
                    db_url=with_db(base_url, args.db_name, APPLICATION_NAME),
                    env=server_env,
                    logs=logs,
                )
        with contextlib.suppress(BenchError):
            gen.call({"op": "quit"}, timeout=5)
    except BenchError as exc:
        failed = str(exc)
        result["failed"] = failed
        print(f"FAILED: {exc}\nlogs: {logs}", file=sys.stderr)
    finally:
        stop_all()
    result["summary"] = summarize(result)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2, default=str) + "\n")
    if result["summary"]:
        print()
        print(markdown(result))
    print(f"\nresults: {args.output}")
    if failed:
        return 1
    shutil.rmtree(logs, ignore_errors=True)
    return 0 if result["summary"].get("correct", True) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        stop_all()
        sys.exit(130)
