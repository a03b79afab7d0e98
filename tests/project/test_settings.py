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
