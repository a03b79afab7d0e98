"""A team pip-installs the product into its own Django project, and it works there.

The wheel is built from a copy of this checkout, installed with its declared
dependencies (and nothing else) into a fresh virtualenv (tests/e2e/host_wheel.py), and
run by a host project of its own (``tests/host_project/``: an app with an ``Invoice`` in
its admin, a DRF view on its own ``REST_FRAMEWORK`` and DRF's own schema class, and of
the apps' settings only docs/install.md's block), copied to a temporary directory so
that nothing of this checkout is importable. It passes ``check --deploy --fail-level
WARNING``. On a PostgreSQL database of its own the host migrates, publishes an event in
the transaction that creates an invoice (and rolls another pair back), runs the
scheduler, relay and workers from its ``manage.py`` to a local receiver that checks
every signature with the ``standardwebhooks`` library, and serves the product's API, its
own API and its admin side by side.
"""

import ast
import json
import os
import secrets
import shutil
import subprocess
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from cryptography.fernet import Fernet
from psycopg import sql
from standardwebhooks.webhooks import Webhook

from deliveries.core import conf as deliveries_conf
from ingest import conf as ingest_conf
from tests.e2e.host_wheel import (
    NOT_SOURCE,
    ROOT,
    Receiver,
    WheelVenv,
    install_settings_block,
    run,
)

HOST_PROJECT = ROOT / "tests" / "host_project"
APP_SETTINGS = {*deliveries_conf.DEFAULTS, *ingest_conf.DEFAULTS}

pytestmark = pytest.mark.slow


@dataclass
class Host:
    root: Path  # the copied host project
    python: Path  # the fresh virtualenv's
    env: dict[str, str]
    wheel: Path

    def command(self, *args: str) -> subprocess.CompletedProcess:
        return run([self.python, "manage.py", *args], cwd=self.root, env=self.env)

    def manage(self, *args: str) -> str:
        return self.command(*args).stdout

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
def host(wheel_venv: WheelVenv, tmp_path_factory):
    # The host project, away from this checkout, on a database of its own, with the two
    # variables docs/install.md's block reads.
    project = tmp_path_factory.mktemp("host") / "host_project"
    shutil.copytree(HOST_PROJECT, project, ignore=NOT_SOURCE)
    name = f"host_wheel_{os.getpid()}"
    server, db_env = _host_database_env(name)
    env = wheel_venv.environ(
        **db_env,
        SECRETS_ENCRYPTION_KEYS=Fernet.generate_key().decode(),
        METRICS_TOKEN=secrets.token_urlsafe(24),
    )
    with psycopg.connect(autocommit=True, **server) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        host = Host(root=project, python=wheel_venv.python, env=env, wheel=wheel_venv.wheel)
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


def _assigned(code: str) -> set[str]:
    """The upper-case names a settings module assigns (``X = …``, ``X += …``)."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        targets = node.targets if isinstance(node, ast.Assign) else []
        targets += [node.target] if isinstance(node, ast.AugAssign) else []
        names |= {t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper()}
    return names


def test_the_hosts_settings_are_install_mds_block_and_pass_the_deploy_check(host):
    # Of the apps' settings the host writes docs/install.md's block as it is, and the
    # README's one line for a receiver on loopback; nothing else.
    written = (host.root / "hostsite" / "settings.py").read_text()
    block = install_settings_block()
    assert block in written
    assert _assigned(written) & APP_SETTINGS == (_assigned(block) & APP_SETTINGS) | {
        "EGRESS_ALLOW_NETWORKS"
    }
    # Its own DRF views on DRF's own schema class, and the deploy check clean: no app
    # warning, no drf_spectacular.E001 on the host's views.
    assert "rest_framework.schemas.openapi.AutoSchema" in written
    checked = host.command("check", "--deploy", "--fail-level", "WARNING")
    assert "System check identified no issues (1 silenced)." in checked.stdout
    assert checked.stderr == ""  # not even django-q2's warning: the block sets Q_CLUSTER


def test_the_apps_log_lines_reach_the_hosts_logging_as_json(published):
    *_, logs = published
    lines = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
    assert [line for line in logs.splitlines() if not line.startswith("{")] == []
    started = {(line["logger"].split(".")[0], line["action"]) for line in lines if "action" in line}
    assert {("deliveries", f"{loop}.start") for loop in ("scheduler", "relay", "workers")} <= (
        started
    )


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
        logs = "".join(
            host.command(*command).stderr
            for command in (
                ("run_scheduler", "--once"),
                ("run_relay", "--until-idle"),
                ("run_workers", "--until-idle"),
            )
        )
        return seen, list(receiver.received), logs


def test_an_event_commits_and_rolls_back_with_the_hosts_transaction(published):
    seen, *_ = published
    assert seen["invoices"] == ["INV-1"]
    assert seen["events"] == [COMMITTED]
    assert len(seen["deliveries"]) == 1


def test_the_hosts_pipeline_delivers_the_committed_event_alone_and_signed(published):
    seen, received, _ = published
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
    "api_docs": answer(Client().get("/api/docs/")),
}}))
"""


@pytest.fixture(scope="module")
def answers(host, published):
    seen, *_ = published
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


def test_the_product_api_docs_page_renders_without_drf_spectacular_installed(answers):
    status, page = answers["api_docs"]
    assert status == 200
    assert "swagger-ui-bundle.js" in page
    assert "/static/drf_spectacular_sidecar/" in page


def test_the_hosts_admin_holds_its_models_and_the_products(answers):
    status, page = answers["admin"]
    assert status == 200
    for text in ("Billing", "Invoices", "Outbound webhooks", "Deliveries", "Inbound webhooks"):
        assert f">{text}<" in page, text
    # The product's admin templates came with the wheel (its change list's own link).
    status, page = answers["admin_deliveries"]
    assert status == 200
    assert "Dead letters" in page
