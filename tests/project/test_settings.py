"""Database settings from the environment, read by a fresh process as in production."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHOW = (
    "import json; from django.conf import settings; "
    "print(json.dumps(settings.DATABASES['default'], default=str))"
)


def manage(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env={**os.environ, "LOG_LEVEL": "WARNING", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_sqlite_database_url_gets_the_embedded_defaults_settings_and_migrates(tmp_path):
    url = f"sqlite:///{tmp_path}/sub/webhooks.sqlite3"
    shown = manage("shell", "-c", SHOW, DATABASE_URL=url)
    assert shown.returncode == 0, shown.stderr
    options = json.loads(shown.stdout.strip().splitlines()[-1])["OPTIONS"]
    assert options["transaction_mode"] == "IMMEDIATE"
    assert "journal_mode=WAL" in options["init_command"]
    assert "prepare_threshold" not in options  # a PostgreSQL option
    migrated = manage("migrate", "--no-input", DATABASE_URL=url)
    assert migrated.returncode == 0, migrated.stderr
    assert (tmp_path / "sub" / "webhooks.sqlite3").exists()


def test_a_postgresql_url_prepares_the_hot_statements_unless_told_not_to():
    url = "postgres://webhooks@127.0.0.1:5432/webhooks"
    for env, expected in [({}, 5), ({"DATABASE_PREPARE_THRESHOLD": "0"}, None)]:
        shown = manage("shell", "-c", SHOW, DATABASE_URL=url, **env)
        assert shown.returncode == 0, shown.stderr
        options = json.loads(shown.stdout.strip().splitlines()[-1])["OPTIONS"]
        assert options["prepare_threshold"] == expected


def _metrics_allow_ips(**env: str) -> list[str]:
    show = "from django.conf import settings; print(json.dumps(settings.METRICS_ALLOW_IPS))"
    environ = {k: v for k, v in os.environ.items() if k not in ("DEBUG", "METRICS_ALLOW_IPS")}
    shown = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", f"import json; {show}"],
        cwd=ROOT,
        env={**environ, "LOG_LEVEL": "WARNING", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout.strip().splitlines()[-1])


def test_metrics_allow_no_address_by_default_and_loopback_only_under_debug():
    # Behind a proxy on the same host every request comes from loopback.
    assert _metrics_allow_ips() == []
    assert _metrics_allow_ips(DEBUG="1") == ["127.0.0.1", "::1"]
    assert _metrics_allow_ips(METRICS_ALLOW_IPS="10.0.0.7") == ["10.0.0.7"]
