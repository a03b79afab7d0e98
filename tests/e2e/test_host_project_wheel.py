"""A team pip-installs the product into its own Django project, and it works there.

The wheel is built from a copy of this checkout, installed with its declared
dependencies (and nothing else) into a fresh virtualenv, and run by a host project of
its own (``tests/host_project/``: an app with an ``Invoice`` in its admin, a DRF view on
its own ``REST_FRAMEWORK``), copied to a temporary directory so that nothing of this
checkout is importable. On a PostgreSQL database of its own the host migrates, publishes
an event in the transaction that creates an invoice (and rolls another pair back), runs
the scheduler, relay and workers from its ``manage.py`` to a local receiver that checks
every signature with the ``standardwebhooks`` library, and serves the product's API, its
own API and its admin side by side.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import zipfile
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from standardwebhooks.webhooks import Webhook

ROOT = Path(__file__).resolve().parents[2]
HOST_PROJECT = ROOT / "tests" / "host_project"
# What a source tree holds that is no source: a copy without them builds as a clean clone.
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", "var",
    ".pytest_cache", ".ruff_cache", ".hypothesis", "test-output", "node_modules",
)  # fmt: skip
TIMEOUT = 180

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Received:
    headers: dict[str, str]
    body: bytes
    refused: str  # why standardwebhooks refused the signature; "" when it verified


class Receiver:
    """An ``http.server`` on 127.0.0.1 in a thread: every POST verified with the
    endpoint's secret (set once the endpoint exists) and recorded."""

    def __init__(self) -> None:
        self.secret = ""
        self.received: list[Received] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                headers = {k.lower(): v for k, v in self.headers.items()}
                try:
                    Webhook(receiver.secret).verify(body, headers)
                    refused = ""
                except Exception as exc:
                    refused = repr(exc)
                receiver.received.append(Received(headers, body, refused))
                self.send_response(400 if refused else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hooks/invoices"

    def __enter__(self) -> "Receiver":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def run(args: list, **kwargs) -> subprocess.CompletedProcess:
    """Run to completion (killed at the timeout); fail with its output on a non-zero exit."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT, **kwargs)
    except subprocess.TimeoutExpired as exc:
        out, err = (o.decode() if isinstance(o, bytes) else o for o in (exc.stdout, exc.stderr))
        pytest.fail(f"{args} timed out:\n{out}\n--- stderr\n{err}")
    assert done.returncode == 0, (
        f"{args} exited {done.returncode}:\n{done.stdout}\n--- stderr\n{done.stderr}"
    )
    return done


@dataclass
class Host:
    root: Path  # the copied host project
    python: Path  # the fresh virtualenv's
    env: dict[str, str]
    wheel: Path

    def manage(self, *args: str) -> str:
        return run([self.python, "manage.py", *args], cwd=self.root, env=self.env).stdout

    def shell(self, code: str) -> dict:
        """Run ``code`` in ``manage.py shell``; the JSON it prints last."""
        return json.loads(self.manage("shell", "--no-imports", "-c", code).splitlines()[-1])


def _host_database_env(name: str) -> tuple[dict, dict[str, str]]:
    """The suite's PostgreSQL server, as connection arguments for psycopg (to the suite's
    own database, to create and drop the host's) and as the host's HOST_DB_* variables."""
    from django.conf import settings

    db = settings.DATABASES["default"]
    assert db["ENGINE"] == "django.db.backends.postgresql", "this test needs PostgreSQL"
    server = {
        "host": db["HOST"] or "127.0.0.1",
        "port": str(db["PORT"] or 5432),
        "user": db["USER"],
        "password": db["PASSWORD"],
    }
    env = {f"HOST_DB_{k.upper()}": v for k, v in server.items()}
    return {**server, "dbname": db["NAME"]}, {**env, "HOST_DB_NAME": name}


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")

    # 1. The wheel, built as the README says (python -m build, in its isolated build
    # environment) from a copy of the checkout, so no build/ or *.egg-info lands in it
    # and no stale build/ leaks in.
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", tmp / "dist", source],
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    (wheel,) = (tmp / "dist").glob("trusty_webhooks-*.whl")

    # 2. A fresh virtualenv with the wheel and its declared dependencies, nothing else.
    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", venv])
    python = venv / "bin" / "python"
    run(
        [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", wheel],
        cwd=tmp,
    )

    # 3. The host project, away from this checkout, on a database of its own.
    project = tmp / "host_project"
    shutil.copytree(HOST_PROJECT, project, ignore=NOT_SOURCE)
    name = f"host_wheel_{os.getpid()}"
    server, db_env = _host_database_env(name)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DATABASE_URL", "DJANGO_SETTINGS_MODULE", "PYTHONPATH", "VIRTUAL_ENV"}
    }
    env.update(db_env, PYTHONUNBUFFERED="1", PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}")
    with psycopg.connect(autocommit=True, **server) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        host = Host(root=project, python=python, env=env, wheel=wheel)
        host.manage("migrate", "--no-input")
        yield host
    finally:
        with psycopg.connect(autocommit=True, **server) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def test_the_wheel_carries_the_apps_whole_and_the_host_imports_them_from_it(host):
    names = set(zipfile.ZipFile(host.wheel).namelist())
    assert {n.split("/")[0] for n in names} == {
        "deliveries",
        "ingest",
        host.wheel.name.split("-py3")[0] + ".dist-info",
    }
    # Every file of the apps' sources (migrations, templates, package data), none missing.
    sources = {
        str(p.relative_to(ROOT))
        for app in ("deliveries", "ingest")
        for p in (ROOT / app).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert sources - names == set()

    where = host.shell(
        "import json, sys, deliveries, ingest, django, rest_framework\n"
        "print(json.dumps({'apps': [deliveries.__file__, ingest.__file__], "
        "'deps': [django.__file__, rest_framework.__file__], 'path': sys.path}))"
    )
    venv = host.python.parents[1]
    site = run(
        [host.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
    ).stdout.strip()
    assert site != sysconfig.get_paths()["purelib"]
    for module in where["apps"] + where["deps"]:
        assert Path(module).is_relative_to(site), module
    assert not [p for p in where["path"] if p and Path(p).resolve().is_relative_to(ROOT)]
    assert Path(site).is_relative_to(venv)


PUBLISH = """
import json
from django.db import transaction
from billing.models import Invoice
from deliveries import services
from deliveries.models import Delivery, Event

tenant, key = services.tenant_create(name="billing")
endpoint, secret = services.endpoint_create(tenant=tenant, url={url!r})

with transaction.atomic():
    invoice = Invoice.objects.create(number="INV-1", amount_cents=1200)
    services.publish_event(tenant=tenant, event_type="invoice.created",
                           payload={{"invoice": invoice.number, "amount_cents": 1200}})


class Undone(Exception):
    pass


try:
    with transaction.atomic():
        invoice = Invoice.objects.create(number="INV-2", amount_cents=3400)
        services.publish_event(tenant=tenant, event_type="invoice.created",
                               payload={{"invoice": invoice.number, "amount_cents": 3400}})
        raise Undone
except Undone:
    pass

print(json.dumps({{
    "key": key,
    "secret": secret,
    "invoices": list(Invoice.objects.values_list("number", flat=True)),
    "events": [json.loads(bytes(b)) for b in Event.objects.values_list("body", flat=True)],
    "deliveries": [str(i) for i in Delivery.objects.values_list("id", flat=True)],
}}))
"""

COMMITTED = {"invoice": "INV-1", "amount_cents": 1200}


@pytest.fixture(scope="module")
def published(host):
    """The two transactions published from the host's shell, then the pipeline run to
    idle from the host's manage.py: the receiver's records and what the shell saw."""
    with Receiver() as receiver:
        seen = host.shell(PUBLISH.format(url=receiver.url))
        receiver.secret = seen["secret"]
        # One after another, as cron or a batch job would: the scheduler admits the due
        # delivery (its --until-idle would wait for the delivery to end), the relay
        # publishes it, the workers send it and record the answer.
        host.manage("run_scheduler", "--once")
        host.manage("run_relay", "--until-idle")
        host.manage("run_workers", "--until-idle")
        return seen, list(receiver.received)


def test_an_event_commits_and_rolls_back_with_the_hosts_transaction(published):
    seen, _ = published
    assert seen["invoices"] == ["INV-1"]
    assert seen["events"] == [COMMITTED]
    assert len(seen["deliveries"]) == 1


def test_the_hosts_pipeline_delivers_the_committed_event_alone_and_signed(published):
    seen, received = published
    assert [json.loads(r.body) for r in received] == [COMMITTED]
    assert [r.refused for r in received] == [""]
    assert [r.headers["webhook-id"] for r in received] == seen["deliveries"]
    # Independently of the receiver's verdict: the signature checks out, and only with
    # the endpoint's own secret.
    (copy,) = received
    assert Webhook(seen["secret"]).verify(copy.body, copy.headers) == COMMITTED
    with pytest.raises(Exception, match="signature"):
        Webhook("whsec_" + "A" * 43 + "=").verify(copy.body, copy.headers)


CALL = """
import base64, json
from django.contrib.auth.models import User
from django.test import Client
from billing.models import Invoice

Invoice.objects.create(number="INV-3", amount_cents=560)
User.objects.create_user("clerk", password="pw")
boss = User.objects.create_superuser("boss", "boss@example.com", "pw")
tenant = Client(HTTP_AUTHORIZATION="Bearer {key}")
clerk = Client(HTTP_AUTHORIZATION="Basic " + base64.b64encode(b"clerk:pw").decode())
staff = Client()
staff.force_login(boss)


def answer(response):
    ctype = response.get("Content-Type", "")
    body = response.json() if ctype.startswith("application/json") else response.text
    return [response.status_code, body]


print(json.dumps({{
    "events": answer(tenant.get("/api/v1/events/")),
    "deliveries": answer(tenant.get("/api/v1/deliveries/")),
    "events_anonymous": answer(Client().get("/api/v1/events/")),
    "events_by_session": answer(staff.get("/api/v1/events/")),
    "invoices": answer(clerk.get("/host/invoices/")),
    "invoices_anonymous": answer(Client().get("/host/invoices/")),
    "invoices_by_tenant_key": answer(tenant.get("/host/invoices/")),
    "admin": answer(staff.get("/admin/")),
    "admin_deliveries": answer(staff.get("/admin/deliveries/delivery/")),
}}))
"""


@pytest.fixture(scope="module")
def answers(host, published):
    seen, _ = published
    return host.shell(CALL.format(key=seen["key"]))


def test_the_product_api_keeps_its_own_auth_and_pagination_in_the_host(answers):
    status, events = answers["events"]
    assert status == 200
    assert sorted(events) == ["next", "previous", "results"]
    assert [e["payload"] for e in events["results"]] == [COMMITTED]
    status, deliveries = answers["deliveries"]
    assert status == 200
    assert [d["state"] for d in deliveries["results"]] == ["succeeded"]
    # Neither anonymous nor the host's session gets in; the error is in the product's shape.
    for call in ("events_anonymous", "events_by_session"):
        status, body = answers[call]
        assert status == 401, call
        assert sorted(body) == ["error"], call
        assert body["error"]["code"], call


def test_the_hosts_own_api_keeps_the_hosts_rest_framework(answers):
    status, page = answers["invoices"]
    assert status == 200
    # PageNumberPagination with PAGE_SIZE 1, beside the product's cursors.
    assert page["count"] == 2
    assert page["results"] == [{"number": "INV-1", "amount_cents": 1200}]
    assert page["next"] == "http://testserver/host/invoices/?page=2"
    # The host's exception handler; SessionAuthentication first, so 403 (DRF's rule). The
    # product's API key opens nothing of the host's.
    for call in ("invoices_anonymous", "invoices_by_tenant_key"):
        status, body = answers[call]
        assert status == 403, call
        assert body["host_error"]["status"] == 403, call


def test_the_hosts_admin_holds_its_models_and_the_products(answers):
    status, page = answers["admin"]
    assert status == 200
    for text in ("Billing", "Invoices", "Outbound webhooks", "Deliveries", "Inbound webhooks"):
        assert f">{text}<" in page, text
    # The product's admin templates came with the wheel (its change list's own link).
    status, page = answers["admin_deliveries"]
    assert status == 200
    assert "Dead letters" in page
