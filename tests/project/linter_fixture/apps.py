from django.apps import AppConfig


class LinterFixtureConfig(AppConfig):
    """An app that exists only for tests/project/test_migration_linter.py: its migrations
    show what the linter refuses and what it lets through."""

    name = "tests.project.linter_fixture"
    label = "linter_fixture"
