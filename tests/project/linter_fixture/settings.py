"""The project's settings plus the linter fixture app (never used outside that test)."""

from project.settings import *  # noqa: F403

INSTALLED_APPS = [*INSTALLED_APPS, "tests.project.linter_fixture"]  # noqa: F405
