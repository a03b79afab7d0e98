"""The apps installed into a host project that sets none of their settings."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from django.conf import global_settings

from deliveries.core import conf as deliveries_conf
from ingest import conf as ingest_conf

ROOT = Path(__file__).resolve().parents[2]
APP_DEFAULTS = {**deliveries_conf.DEFAULTS, **ingest_conf.DEFAULTS}
# Settings the host owns, which the apps read but do not default: Django's own (in
# global_settings) and django-q2's cluster, which has defaults of its own.
HOST_SETTINGS = {"Q_CLUSTER"}
APP_READ = re.compile(r"settings\.(?:{})\b".format("|".join(APP_DEFAULTS)))


def host(*args: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in APP_DEFAULTS and k != "DATABASE_URL"}
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env={
            **environ,
            "DJANGO_SETTINGS_MODULE": "tests.host_settings",
            "HOST_SQLITE_PATH": str(tmp_path / "host.sqlite3"),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_a_host_with_none_of_the_apps_settings_passes_check_and_migrates(tmp_path):
    checked = host("check", "--fail-level", "ERROR", tmp_path=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert "ERRORS" not in checked.stderr
    migrated = host("migrate", "--no-input", tmp_path=tmp_path)
    assert migrated.returncode == 0, migrated.stderr
    show = (
        "import json; from deliveries.core.conf import settings as d; "
        "from ingest.conf import settings as i; "
        "print(json.dumps([d.DELIVERY_RETRY_SCHEDULE, d.QUEUE_NAME, i.POLL_MAX_PAGES, "
        "d.API_THROTTLE_RATE]))"
    )
    shown = host("shell", "-c", show, tmp_path=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout.strip().splitlines()[-1]) == [
        list(deliveries_conf.DEFAULTS["DELIVERY_RETRY_SCHEDULE"]),
        "webhooks",
        1000,
        "50/s",
    ]


# What a host's deploy check may report of the apps: the settings it has not made for a
# production deployment (docs/settings.md), and nothing else: no error, no model warning,
# no third-party check broken by the apps' views.
DEPLOY_ISSUES_OF_A_BARE_HOST = {
    "deliveries.W002",
    "deliveries.W003",
    "deliveries.W004",
    "deliveries.W030",
}


def test_a_bare_hosts_deploy_check_reports_only_its_unmade_settings(tmp_path):
    checked = host("check", "--deploy", tmp_path=tmp_path)
    issues = set(re.findall(r"\(([a-z_]+\.[EWCI]\d+)\)", checked.stderr + checked.stdout))
    ours = {i for i in issues if not i.startswith("security.")}
    assert ours == DEPLOY_ISSUES_OF_A_BARE_HOST, checked.stderr
    # The host's own models keep the host's DEFAULT_AUTO_FIELD; the apps' migrations hold.
    assert host("makemigrations", "--check", "--dry-run", tmp_path=tmp_path).returncode == 0


# A tenant's API call through the host's URLconf, with DRF's settings left at DRF's
# defaults: the API still pages, answers errors in its one shape and throttles.
CALL_THE_API = """
import json
from django.test import Client
from deliveries import services
_, key = services.tenant_create(name="host")
client = Client(HTTP_AUTHORIZATION=f"Bearer {key}")
listed = client.get("/api/v1/events/")
missing = client.get("/api/v1/events/no-such-event/")
print(json.dumps([listed.status_code, sorted(listed.json()), missing.json()]))
"""


def test_a_host_without_rest_framework_settings_serves_the_api_as_documented(tmp_path):
    assert host("migrate", "--no-input", tmp_path=tmp_path).returncode == 0
    called = host("shell", "-c", CALL_THE_API, tmp_path=tmp_path)
    assert called.returncode == 0, called.stderr
    status, keys, missing = json.loads(called.stdout.strip().splitlines()[-1])
    assert status == 200
    assert keys == ["next", "previous", "results"]
    assert missing["error"]["code"] == "not_found"


# The same calls under a host whose REST_FRAMEWORK disagrees on everything, and the
# host's own view beside them.
CALL_BOTH_APIS = """
import base64, json
from django.contrib.auth.models import User
from django.test import Client
from deliveries import services
_, key = services.tenant_create(name="host")
for name in ("ann", "bob"):
    User.objects.create_user(name, password="pw")
tenant = Client(HTTP_AUTHORIZATION=f"Bearer {key}")
for n in range(3):
    tenant.post("/api/v1/events/", {"event_type": "t", "payload": {"n": n}},
                content_type="application/json")
product = [tenant.get("/api/v1/events/?limit=2") for _ in range(3)]
nul = tenant.post("/api/v1/events/", '{"event_type": "t", "payload": {"s": "\\u0000"}}',
                  content_type="application/json")
anonymous = Client().get("/api/v1/events/")
schema = Client().get("/api/schema/?format=json")
docs = Client().get("/api/docs/")
basic = "Basic " + base64.b64encode(b"ann:pw").decode()
host = Client(HTTP_AUTHORIZATION=basic).get("/host/users/")
host_anonymous = Client().get("/host/users/")
print(json.dumps({
    "product": [[r.status_code, sorted(r.json()), len(r.json()["results"])] for r in product],
    "cursor": "cursor=" in product[0].json()["next"],
    "nul": [nul.status_code, nul.json()["error"]["code"]],
    "anonymous": [anonymous.status_code, sorted(anonymous.json())],
    "schema": [schema.status_code, sorted(schema.json()["paths"])[:1],
               any("/host/" in p for p in schema.json()["paths"])],
    "docs": [docs.status_code, b"swagger-ui-bundle.js" in docs.content],
    "host": [host.status_code, host.json()["count"], host.json()["next"]],
    "host_anonymous": [host_anonymous.status_code, sorted(host_anonymous.json())],
}))
"""


def test_a_hosts_rest_framework_neither_changes_the_api_nor_is_changed_by_it(tmp_path):
    env = {"DJANGO_SETTINGS_MODULE": "tests.host_settings_rest"}
    assert host("migrate", "--no-input", tmp_path=tmp_path, **env).returncode == 0
    called = host("shell", "-c", CALL_BOTH_APIS, tmp_path=tmp_path, **env)
    assert called.returncode == 0, called.stderr
    seen = json.loads(called.stdout.strip().splitlines()[-1])

    # The product: its key, its cursor pages of the size asked, no host throttle, its
    # strict parser and its one error shape.
    assert seen["product"] == [[200, ["next", "previous", "results"], 2]] * 3
    assert seen["cursor"] is True
    assert seen["nul"] == [400, "parse_error"]
    assert seen["anonymous"] == [401, ["error"]]
    assert seen["schema"] == [200, ["/api/v1/backfill-runs/"], False]
    # Without drf_spectacular in INSTALLED_APPS (deliveries.apps.TRUSTY_APPS), the docs
    # page still renders drf-spectacular's template.
    assert seen["docs"] == [200, True]
    # The host: its basic auth, its page numbers of one, its error handler.
    assert seen["host"] == [200, 2, "http://testserver/host/users/?page=2"]
    assert seen["host_anonymous"] == [401, ["host_error"]]


def test_a_host_with_drf_views_on_drf_s_own_schema_class_passes_the_deploy_check(tmp_path):
    # drf-spectacular's deploy check walks every DRF view of the host and fails on one
    # whose schema is not drf-spectacular's: the apps do not install it.
    env = {"DJANGO_SETTINGS_MODULE": "tests.host_settings_rest"}
    checked = host("check", "--deploy", tmp_path=tmp_path, **env)
    issues = set(re.findall(r"\(([a-z_]+\.[EWCI]\d+)\)", checked.stderr + checked.stdout))
    assert {i for i in issues if not i.startswith("security.")} == DEPLOY_ISSUES_OF_A_BARE_HOST
    assert "drf_spectacular" not in checked.stderr + checked.stdout


def test_a_host_misconfiguration_is_reported_with_its_stable_id(tmp_path):
    bad = host("check", tmp_path=tmp_path, DJANGO_SETTINGS_MODULE="tests.host_settings_bad")
    assert bad.returncode != 0
    assert "deliveries.E002" in bad.stderr
    assert "deliveries.E004" in bad.stderr


def test_the_namespace_wins_over_the_flat_setting_which_wins_over_the_default(settings):
    from deliveries.core.conf import settings as app

    settings.METRICS_TOKEN = "the-hosts-own"
    settings.TRUSTY_WEBHOOKS = {}
    assert app.METRICS_TOKEN == "the-hosts-own"
    settings.TRUSTY_WEBHOOKS = {"METRICS_TOKEN": "the-apps"}
    assert app.METRICS_TOKEN == "the-apps"
    del settings.API_THROTTLE_RATE
    assert app.API_THROTTLE_RATE == "50/s"
    assert app.SECRET_KEY == settings.SECRET_KEY  # any other name is Django's


def test_every_app_setting_has_a_default_and_every_default_is_documented():
    read = set()
    for path in [*ROOT.glob("deliveries/**/*.py"), *ROOT.glob("ingest/**/*.py")]:
        read |= set(re.findall(r"\bsettings\.([A-Z][A-Z0-9_]+)", path.read_text()))
    django_owned = {name for name in dir(global_settings) if name.isupper()}
    undefaulted = read - set(APP_DEFAULTS) - django_owned - HOST_SETTINGS
    assert not undefaulted, f"read by the apps with no default in a conf.py: {undefaulted}"
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", (ROOT / "docs/settings.md").read_text()))
    assert not set(APP_DEFAULTS) - documented, set(APP_DEFAULTS) - documented
    assert not set(APP_DEFAULTS) & django_owned, "an app default would shadow Django's"


def test_the_app_modules_read_their_settings_through_the_defaults():
    # django.conf.settings would answer AttributeError in a host that did not copy a name.
    direct = [
        str(path.relative_to(ROOT))
        for path in [*ROOT.glob("deliveries/**/*.py"), *ROOT.glob("ingest/**/*.py")]
        if "from django.conf import settings" in path.read_text()
        and path.name != "conf.py"
        and APP_READ.search(path.read_text())
    ]
    assert direct == []


def test_every_logger_of_the_apps_is_under_the_names_a_host_configures():
    # docs/install.md's LOGGING names "deliveries" and "ingest": a logger outside them
    # would write nothing in a host that copied it.
    named = []
    for path in [*ROOT.glob("deliveries/**/*.py"), *ROOT.glob("ingest/**/*.py")]:
        for name in re.findall(r"getLogger\(([^)]*)\)", path.read_text()):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            named.append(module if name == "__name__" else name.strip("\"'"))
    assert named, "the apps log"
    # aiosmtpd's logger: the SMTP listener only sets its level (ingest.smtp.quiet_library_log).
    libraries = {"mail.log"}
    assert [n for n in named if n.split(".")[0] not in {"deliveries", "ingest"}] == [*libraries]
