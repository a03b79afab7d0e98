"""Database trouble, one kind at a time: every long-running process (run_scheduler,
run_relay, run_workers, which also runs the inbound processing jobs, run_jobs, which runs
background jobs, and the gunicorn web server that receives inbound webhooks) keeps
running through

- ``pg_terminate_backend`` of its own connections, command by command, then of all;
- a restart of the server (``pg_ctl restart -m fast``, then ``-m immediate``: crash
  recovery);

with no restart by hand, and after each, new outbound events are delivered, new
inbound events applied once and new background jobs done. Nothing published before or
during the trouble is lost.

    python -m tests.chaos.dbtrouble [--json PATH]

Runs against a private PostgreSQL cluster (pgcluster.py); exit status 0 only if every
check holds. tests/deliveries/test_database_trouble.py runs it.
"""

import argparse
import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.outbound import child_pids
from tests.chaos.pgcluster import PrivateCluster, free_port
from tests.chaos.soak import ROOT, Fleet, SendStats, post_signed, setup_django

PER_PHASE = 20  # outbound events and inbound events published after each trouble
PHASE_DEADLINE = 90.0


SOAK_CONNECTIONS_SQL = (
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE backend_type = 'client backend' AND application_name LIKE 'soak-%'"
)


def run(json_path: str | None, only: str = "") -> int:
    cluster = PrivateCluster().start()
    fleet = web = receiver = None

    def interrupted(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    try:
        env = setup_django(cluster)
        from django.db import InterfaceError, OperationalError, connection

        from deliveries import services
        from deliveries.jobs.background import enqueue
        from deliveries.jobs.models import Job, JobState
        from deliveries.models import Delivery, Tenant
        from ingest.models import InboundEvent
        from ingest.schemes import get_scheme
        from ingest.sources import source_create
        from tests.chaos.handlers import SOURCE
        from tests.chaos.receiver import ChaosReceiver

        receiver = ChaosReceiver(seed=0).start()
        tenant = Tenant.objects.create(name="dbtrouble")
        _, secret = services.endpoint_create(tenant=tenant, url=receiver.url("/ok"))
        receiver.add("/ok", secret=secret)
        inbound_secret = "whsec_" + base64.b64encode(os.urandom(24)).decode()
        source_create(slug=SOURCE, scheme="standard", secrets=[inbound_secret])
        connection.close()

        fleet = Fleet(env, cluster.dir / "logs", workers=1, job_workers=1)
        for role in fleet.killable:
            fleet.start(role)
        port = free_port()
        web = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-c", "project/gunicorn.conf.py"],
            env={
                **env,
                "GUNICORN_BIND": f"127.0.0.1:{port}",
                "GUNICORN_WORKERS": "1",
                "PGAPPNAME": "soak-web",
            },
            cwd=ROOT,
            stdout=(cluster.dir / "logs" / "web.log").open("ab"),
            stderr=subprocess.STDOUT,
        )
        pids = {role: p.popen.pid for role, p in fleet.procs.items()} | {"web": web.pid}
        scheme = get_scheme("standard")
        url = f"http://127.0.0.1:{port}/ingest/{SOURCE}/"
        sent = SendStats()

        def with_retry(fn):
            """The application's side: a publish whose connection dropped is retried."""
            for _ in range(60):
                try:
                    return fn()
                except (OperationalError, InterfaceError):
                    connection.close()
                    time.sleep(0.5)
            raise RuntimeError("the database never came back")

        def traffic(phase: str) -> None:
            for i in range(PER_PHASE):
                with_retry(
                    lambda i=i: services.publish_event(
                        tenant=tenant, event_type="t", payload={"phase": phase, "i": i}
                    )
                )
                with_retry(lambda i=i: enqueue("soak.ok", {"i": i, "entity": f"{phase}-{i % 3}"}))
                event_id = f"{phase}-{i}"
                body = json.dumps({"type": "t", "data": {"id": f"{phase}-{i % 3}"}}).encode()
                sent.occurred[event_id] = None
                if post_signed(scheme, url, inbound_secret, event_id, body, sent) is None:
                    sent.failed += 1

        def settled() -> bool:
            try:
                busy = (
                    Delivery.objects.exclude(state="succeeded").exists()
                    or InboundEvent.objects.exclude(state="processed").exists()
                    or Job.objects.exclude(state=JobState.DONE).exists()
                )
            except (OperationalError, InterfaceError):
                busy = True
            connection.close()
            return not busy

        def waiting() -> dict:
            from collections import Counter

            found = (
                Counter(f"delivery {s}" for s in Delivery.objects.values_list("state", flat=True))
                + Counter(
                    f"inbound {s}" for s in InboundEvent.objects.values_list("state", flat=True)
                )
                + Counter(f"job {s}" for s in Job.objects.values_list("state", flat=True))
            )
            stuck = list(
                InboundEvent.objects.filter(state="processing").values(
                    "event_id", "attempt_count", "last_error", "lease_until", "dispatch_count"
                )
            )
            connection.close()
            finished = ("succeeded", "processed", "job done")
            left = {k: v for k, v in found.items() if not any(f in k for f in finished)}
            return {**left, "stuck": stuck[:3]} if stuck else left

        phases = [("baseline", lambda: 0)]
        for role in [*fleet.killable, "web"]:
            phases.append(
                (f"terminate {role}", lambda r=role: cluster.terminate_backends(f"soak-{r}"))
            )

        def restart(mode: str) -> int:
            """Restart the server; the effect is the service's connections it dropped."""
            connected = int(cluster.psql(SOAK_CONNECTIONS_SQL).strip() or 0)
            cluster.restart(mode)
            return connected

        phases += [
            ("terminate all", cluster.terminate_backends),
            ("restart fast", lambda: restart("fast")),
            ("restart immediate", lambda: restart("immediate")),
        ]
        if only:
            phases = [p for p in phases if p[0] == "baseline" or only in p[0]]
        # gunicorn's workers, which its master would replace if one died.
        deadline = time.monotonic() + 60
        while not (web_workers := child_pids(web.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        report = []
        for name, trouble in phases:
            connection.close()
            effect = trouble()
            t0 = time.monotonic()
            traffic(name.replace(" ", "-"))
            last_note = time.monotonic()
            while not settled() and time.monotonic() - t0 < PHASE_DEADLINE:
                time.sleep(0.25)
                if time.monotonic() - last_note > 10:
                    last_note = time.monotonic()
                    print(f"dbtrouble: {name}: still waiting: {waiting()}", flush=True)
            ok = settled()
            report.append({"phase": name, "effect": effect, "settled": ok,
                           "seconds": round(time.monotonic() - t0, 2)})  # fmt: skip
            print(f"dbtrouble: {name}: {effect} -> settled {ok} in {report[-1]['seconds']} s",
                  flush=True)  # fmt: skip

        alive = {role: p.popen.poll() is None for role, p in fleet.procs.items()}
        alive["web"] = web.poll() is None
        same_pids = {role: p.popen.pid for role, p in fleet.procs.items()} | {"web": web.pid}
        same_web_workers = child_pids(web.pid)
        fleet.reap(restart=False)
        codes = fleet.stop()
        web.send_signal(signal.SIGTERM)
        codes["web"] = web.wait(30)
        receiver.stop()

        deliveries = Delivery.objects.count()
        delivered = Delivery.objects.filter(state="succeeded").count()
        copies = receiver.snapshot().copies
        jobs = Job.objects.count()
        jobs_done = Job.objects.filter(state=JobState.DONE).count()
        with connection.cursor() as cursor:
            cursor.execute("SELECT event_id, count(*) FROM chaos_effect GROUP BY event_id")
            effects = dict(cursor.fetchall())
        result = {
            "phases": report,
            "alive": alive,
            # The same processes, gunicorn's workers included (a worker that died would
            # have been replaced by its master, with a new pid).
            "never_restarted": same_pids == pids
            and bool(web_workers)
            and same_web_workers == web_workers,
            "web_workers": sorted(web_workers),
            "unexpected_exits": fleet.unexpected,
            "stop_codes": codes,
            "deliveries": deliveries,
            "delivered": delivered,
            "received": len(copies),
            "jobs": jobs,
            "jobs_done": jobs_done,
            "inbound_sent": len(sent.occurred),
            "inbound_applied_once": sum(1 for k in sent.occurred if effects.get(k) == 1),
            "inbound_applied_twice": sum(1 for v in effects.values() if v > 1),
            "inbound_post_retries": sent.retried,
            "inbound_failed_posts": sent.failed,
        }
        result["ok"] = (
            all(p["settled"] for p in report)
            and all(alive.values())
            and result["never_restarted"]
            and not fleet.unexpected
            and all(c == 0 for c in codes.values())
            and deliveries == delivered == len(copies) == PER_PHASE * len(phases)
            and jobs == jobs_done == PER_PHASE * len(phases)
            and result["inbound_applied_once"] == result["inbound_sent"]
            and result["inbound_applied_twice"] == 0
            and not sent.failed
        )
        print(json.dumps(result, indent=2, default=str))
        if json_path:
            Path(json_path).write_text(json.dumps(result, default=str))
        return 0 if result["ok"] else 1
    finally:
        for p in fleet.procs.values() if fleet else []:
            if p.popen.poll() is None:
                p.popen.kill()
        if web is not None and web.poll() is None:
            web.terminate()
            web.wait(20)
        if receiver is not None:
            receiver.stop()
        if os.environ.get("SOAK_KEEP_LOGS"):
            shutil.copytree(cluster.dir / "logs", os.environ["SOAK_KEEP_LOGS"], dirs_exist_ok=True)
        cluster.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--only", default="", help="run the phases whose name contains this")
    a = parser.parse_args(argv)
    return run(a.json_path, a.only)


if __name__ == "__main__":
    sys.exit(main())
