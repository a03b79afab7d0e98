"""Expand-contract: the migration linter that `make test` runs refuses a
backward-incompatible migration and passes the project's own (docs/compatibility.md)."""

import pytest

from tests.conftest import manage, subprocess_env

pytestmark = [pytest.mark.django_db, pytest.mark.slow]


def lint(*args: str, **env: str):
    return manage(
        "lintmigrations", *args, "--quiet", "ok", env=subprocess_env(LOG_LEVEL="WARNING", **env)
    )


def test_the_linter_refuses_a_backward_incompatible_migration():
    result = lint("linter_fixture", DJANGO_SETTINGS_MODULE="tests.project.linter_fixture.settings")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "(linter_fixture, 0003_contract_too_early)... ERR" in result.stdout
    assert "DROPPING columns" in result.stdout
    assert "NOT NULL constraint on columns" in result.stdout
    # The expand step (nullable column, default kept in the database) is fine.
    assert "0002_expand)... ERR" not in result.stdout
    assert "Erroneous migrations: 1/3" in result.stdout


def test_the_projects_migrations_are_backward_compatible():
    result = lint()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Erroneous migrations: 0/" in result.stdout
