"""The README's "Use it in your project" and docs/install.md, run as written.

A project fresh from ``django-admin startproject``, in a virtualenv holding only the
wheel and its dependencies (tests/e2e/host_wheel.py), gets the pages' code blocks as a
new team would copy them: each ``# settings.py`` block appended to its settings, each
``# urls.py`` block to its URLconf, the ``python manage.py`` lines run in a shell, the
other Python blocks run in ``manage.py shell`` with the few names they leave to the
reader (an ``invoice``, ``notify_account``) defined first. The blocks are read from the
pages on every run, so a changed page is tested again; a block of a kind these tests do
not know fails the first test.

Two projects: one with docs/install.md's settings (on its SQLite database, with the
README's line for a receiver on loopback), which passes ``check --deploy`` of everything
but Django's own security settings, migrates, publishes the README's Decimal amount,
tells a customer through the signal receiver install.md shows, and delivers with the
README's commands; and one with the README's short settings block alone, which
passes ``check`` with only the warnings install.md's block answers.
"""

import json
import os
import re
import signal
import subprocess
import zipfile
from pathlib import Path

import pytest
from cryptography.fernet import Fernet
from standardwebhooks.webhooks import Webhook

from tests.e2e.host_wheel import ROOT, Fence, Receiver, WheelVenv, fences, run

README = fences(ROOT / "README.md", section="Use it in your project")
INSTALL = fences(ROOT / "docs" / "install.md")

pytestmark = pytest.mark.slow


def kind(fence: Fence) -> str:
    lines = [line for line in fence.code.splitlines() if line.strip()]
    if fence.lang == "sh" and all(line.startswith("pip install ") for line in lines):
        return "pip"
    if fence.lang == "sh" and all(line.startswith("python manage.py ") for line in lines):
        return "manage"
    if fence.lang == "python":
        for file in ("settings", "urls"):
            if fence.first_line.startswith(f"# {file}.py"):
                return file
        return "shell"
    return "unknown"


def of(kind_: str, blocks: list[Fence]) -> list[Fence]:
    return [f for f in blocks if kind(f) == kind_]


def test_every_code_block_of_the_host_docs_is_one_these_tests_run():
    unknown = [(page, f.line) for page, blocks in (("README", README), ("install", INSTALL))
               for f in blocks if kind(f) == "unknown"]  # fmt: skip
    assert unknown == []
    for blocks in (README, INSTALL):
        assert of("settings", blocks), "each page has settings"
        assert of("urls", blocks), "each page has a URLconf"
    assert of("manage", README) and of("shell", README) and of("shell", INSTALL)


def test_the_wheel_install_md_names_is_the_wheel_that_is_built(wheel_venv: WheelVenv):
    named = {w for f in of("pip", INSTALL) for w in re.findall(r"[\w.-]+\.whl", f.code)}
    assert named == {wheel_venv.wheel.name}
    extras = set(re.findall(r"\.whl\[([\w,]+)\]", " ".join(f.code for f in INSTALL)))
    metadata = zipfile.ZipFile(wheel_venv.wheel).read(
        f"{wheel_venv.wheel.name.split('-py3')[0]}.dist-info/METADATA"
    )
    provided = set(re.findall(r"^Provides-Extra: (\S+)$", metadata.decode(), flags=re.M))
    assert {e for group in extras for e in group.split(",")} <= provided


def startproject(venv: WheelVenv, where: Path, blocks: list[Fence], env: dict) -> Path:
    """``django-admin startproject mysite``, then the blocks appended as they are."""
    where.mkdir()
    run([venv.bin / "django-admin", "startproject", "mysite", where], env=env)
    for file in ("settings", "urls"):
        with (where / "mysite" / f"{file}.py").open("a") as module:
            for block in of(file, blocks):
                module.write("\n\n" + block.code)
    return where


def issues(output: str) -> set[str]:
    return set(re.findall(r"\(([a-z_]+\.[EWCI]\d+)\)", output))


@pytest.fixture(scope="module")
def install_project(wheel_venv: WheelVenv, tmp_path_factory):
    env = wheel_venv.environ(
        SECRETS_ENCRYPTION_KEYS=Fernet.generate_key().decode(),  # one key, as a string
        METRICS_TOKEN="a-token-for-prometheus",
    )
    # install.md's blocks, and the README's for a receiver on this machine.
    loopback = [f for f in of("settings", README) if "EGRESS_ALLOW_NETWORKS" in f.code]
    root = startproject(
        wheel_venv, tmp_path_factory.mktemp("docs") / "mysite", INSTALL + loopback, env
    )
    return root, env


def test_install_md_s_settings_pass_the_deploy_check_but_django_s_own_security(
    install_project, wheel_venv
):
    root, env = install_project
    checked = run([wheel_venv.python, "manage.py", "check", "--deploy"], cwd=root, env=env)
    found = issues(checked.stdout + checked.stderr)
    # startproject's DEBUG = True and its insecure key are the project's to change.
    assert found and {i for i in found if not i.startswith("security.")} == set()
    assert "Retry and timeout are misconfigured" not in checked.stderr  # Q_CLUSTER is set


def test_the_readme_s_short_settings_leave_only_what_install_md_s_block_answers(
    wheel_venv, tmp_path_factory
):
    env = wheel_venv.environ()
    root = startproject(wheel_venv, tmp_path_factory.mktemp("docs") / "readme", README, env)
    checked = run([wheel_venv.python, "manage.py", "check"], cwd=root, env=env)
    # A cache the processes share and django-q2's cluster: docs/install.md's block.
    assert issues(checked.stdout + checked.stderr) == {"deliveries.W002", "deliveries.W004"}
    routed = run(
        [wheel_venv.python, "manage.py", "shell", "--no-imports", "-c",
         "from django.urls import reverse; print(reverse('schema'), reverse('healthz'))"],
        cwd=root, env=env,
    )  # fmt: skip
    assert routed.stdout.split() == ["/webhooks/api/schema/", "/webhooks/healthz"]


# What the README's and install.md's Python blocks leave to the reader: an invoice of the
# host's (an amount from a DecimalField), the host's own notify_account, and an endpoint
# of the tenant the README's block makes, pointing at the test's receiver.
BEFORE = """
import json
from decimal import Decimal

from deliveries import services


class Invoice:
    id = 42
    account_id = 7
    amount = Decimal("12.50")
    paid = False

    def mark_paid(self):
        self.paid = True


invoice = Invoice()
told = []


def notify_account(*args):
    told.append([str(a) for a in args])


_tenant, _ = services.tenant_get_or_create(external_id="7")
_endpoint, _secret = services.endpoint_create(tenant=_tenant, url={url!r})
_old, _ = services.endpoint_create(tenant=_tenant, url={url!r} + "/old", event_types=["-"])
"""

AFTER = """
services.endpoint_disable(endpoint=_old, reason="the customer left")
print(json.dumps({{"secret": _secret, "paid": invoice.paid, "told": told, "old": _old.url}}))
"""


@pytest.fixture(scope="module")
def delivered(install_project, wheel_venv):
    """The README's and install.md's blocks run in order in the install.md project: its
    migrate line, the Python blocks in one shell, then its commands until the
    receiver has the event."""
    root, env = install_project
    (migrate, loops) = [line for f in of("manage", README) for line in f.code.splitlines()]
    run(["bash", "-c", migrate], cwd=root, env=env)
    with Receiver() as receiver:
        blocks = [f.code for f in of("shell", README + INSTALL)]
        code = "\n".join([BEFORE.format(url=receiver.url), *blocks, AFTER.format()])
        shell = run(
            [wheel_venv.python, "manage.py", "shell", "--no-imports", "-c", code],
            cwd=root,
            env=env,
        )
        seen = json.loads(shell.stdout.splitlines()[-1])
        receiver.secret = seen["secret"]
        logs = root / "loops.log"
        with logs.open("w") as out:
            loops_run = subprocess.Popen(
                ["bash", "-c", loops], cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
            try:
                arrived = receiver.arrived.wait(90)
            finally:
                os.killpg(loops_run.pid, signal.SIGTERM)
                loops_run.wait(60)
        assert arrived, logs.read_text()
        return seen, list(receiver.received), logs.read_text()


def test_the_readme_s_decimal_amount_is_delivered_signed_by_its_commands(delivered):
    seen, received, _ = delivered
    assert seen["paid"] is True
    (copy,) = received
    assert copy.refused == ""
    assert copy.body == b'{"invoice_id":42,"amount":"12.50"}'
    assert Webhook(seen["secret"]).verify(copy.body, copy.headers) == {
        "invoice_id": 42,
        "amount": "12.50",
    }


def test_install_md_s_signal_receiver_tells_the_customer(delivered):
    seen, _, _ = delivered
    assert seen["told"] == [["7", seen["old"], "the customer left"]]


def test_install_md_s_logging_writes_the_loops_json_lines(delivered):
    *_, output = delivered
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    started = {line["action"] for line in lines if line["logger"].startswith("deliveries")}
    # The README runs no relay: the database broker's workers take the outbox rows.
    assert {"scheduler.start", "workers.start"} <= started
    # On SQLite with install.md's options the processes wait for each other's
    # writes: no "database is locked", no warning of any kind.
    assert [line for line in lines if line["level"] not in {"DEBUG", "INFO"}] == []
